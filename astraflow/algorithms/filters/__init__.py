"""Filters: decide after rollout which groups may be trained on (registry: ``FILTERS``)."""
