"""Engines by name: ``register_engine`` records a factory and its option model, ``build_engine``
builds the engine ``rollout.engine`` names.

A built-in engine registers when its module is imported (``build_engine`` imports them all; each
imports its runtime only when built). A plug-in engine registers the same way from a module in
``rollout.plugins``, which is imported before the recipe is validated, so its options are
checked at load like a built-in's:

    class EchoOptions(Options):
        type: Literal["echo"] = "echo"
        delay_s: float = 0.0

    @register_engine("echo", EchoOptions)
    def build_echo(options, model_cfg, rollout_cfg, tokenizer) -> Engine: ...
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from astraflow.registry import ENGINE_OPTIONS, Options, type_name
from astraflow.rollout.engines.base import Engine, checked_engine

if TYPE_CHECKING:
    from astraflow.config import ModelConfig, RolloutConfig

EngineFactory = Callable[[Any, "ModelConfig", "RolloutConfig", Any], Engine]
"""Builds an engine from its options (``rollout.engine``), the policy's model config, the rollout config and the tokenizer."""
ENGINES: dict[str, EngineFactory] = {}
BUILTIN = ("hf", "scripted", "sglang", "vllm")  # modules of this package


def register_engine(name: str, options: type[Options] | None = None) -> Callable[[EngineFactory], EngineFactory]:
    """Register an engine factory under ``name``, with its option model (none: the one registered for the name,
    else a bare one that takes no options)."""
    if options is not None and type_name(options) != name:
        raise ValueError(f"engine {name!r} registered with options of type {type_name(options)!r}")

    def deco(factory: EngineFactory) -> EngineFactory:
        if options is None:
            ENGINE_OPTIONS.ensure(name)
        else:
            ENGINE_OPTIONS.register(options)
        ENGINES[name] = factory
        return factory

    return deco


def build_engine(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, tokenizer: Any) -> Engine:
    """The engine ``rollout_cfg.engine`` names, built for one policy's model."""
    for module in BUILTIN:  # cached after the first call
        importlib.import_module(f"astraflow.rollout.engines.{module}")
    options = rollout_cfg.engine
    try:
        factory = ENGINES[options.type]
    except KeyError:
        raise ValueError(f"rollout.engine {options.type!r} has options but no engine registered; "
                         f"engines: {sorted(ENGINES)}") from None
    return checked_engine(factory(options, model_cfg, rollout_cfg, tokenizer), options.type)
