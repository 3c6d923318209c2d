"""Bundled text environments served over HTTP (``python -m astraflow.rollout.envs.server``)."""
