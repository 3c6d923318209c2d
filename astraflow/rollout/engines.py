"""Imports every built-in engine module so each registers itself in ``ENGINES``."""

from astraflow.rollout import hf_engine  # noqa: F401
from astraflow.rollout import scripted_engine  # noqa: F401,E402
from astraflow.rollout import sglang_engine  # noqa: F401,E402  (imports sglang only when launched)
from astraflow.rollout import vllm_engine  # noqa: F401,E402  (imports vllm only when used)
