"""Advantages: per-sample credit within a group (registry: ``ADVANTAGES``)."""
