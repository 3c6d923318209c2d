"""Curators: decide before rollout which prompts are worth generating for (registry: ``CURATORS``)."""
