"""Building the engine ``rollout.engine`` names, from the engine registry (``astraflow.registry.ENGINES``).

A built-in engine registers when its module is imported (the registry imports them on first use;
each imports its runtime only when built). A plug-in engine registers the same way from a module in
``rollout.plugins`` (imported before the recipe is validated, so its options are checked at load
like a built-in's) or from a package's entry point in the group ``astraflow.engine``:

    class EchoOptions(Options):
        type: Literal["echo"] = "echo"
        delay_s: float = 0.0

    @ENGINES.register("echo", EchoOptions)
    def build_echo(options, model_cfg, rollout_cfg, tokenizer) -> Engine: ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from astraflow.registry import ENGINES
from astraflow.rollout.engines.base import Engine, checked_engine

if TYPE_CHECKING:
    from astraflow.config import ModelConfig, RolloutConfig

EngineFactory = Callable[[Any, "ModelConfig", "RolloutConfig", Any], Engine]
"""Builds an engine from its options (``rollout.engine``), the policy's model config, the rollout config and the tokenizer."""


def build_engine(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, tokenizer: Any) -> Engine:
    """The engine ``rollout_cfg.engine`` names, built for one policy's model."""
    options = rollout_cfg.engine
    factory: EngineFactory = ENGINES.get(options.type)
    return checked_engine(factory(options, model_cfg, rollout_cfg, tokenizer), options.type)
