"""Imports every built-in engine module so each registers itself in ``ENGINES``."""

from astraflow.rollout import hf_engine  # noqa: F401
