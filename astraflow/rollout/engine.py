"""The Engine contract every rollout runtime speaks (hf, sglang, vllm, scripted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from astraflow.config import ModelConfig, RolloutConfig


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class Completion:
    """One generated continuation. Arrays are aligned with ``token_ids``."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each token under the sampling distribution
    versions: list[int]  # weight version that produced each token
    finish_reason: str  # "stop" | "length"


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int:
        """Weight version currently loaded (-1 before the first)."""

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Generate one completion per request (blocking; callers run it off the event loop)."""

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Install a full bf16 state as ``version`` (in place, without reloading the model)."""

    def state_view(self) -> Mapping[str, torch.Tensor]:
        """The engine's current weights by name (for in-place delta application)."""


EngineFactory = Callable[["ModelConfig", "RolloutConfig", Any], Engine]
"""Builds an engine from the policy's model config, the rollout config and the tokenizer."""
ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    def deco(factory: EngineFactory) -> EngineFactory:
        ENGINES[name] = factory
        return factory

    return deco


def build_engine(name: str, model_cfg: "ModelConfig", rollout_cfg: "RolloutConfig", tokenizer: Any) -> Engine:
    import astraflow.rollout.engines  # noqa: F401  (registers the built-in engines)

    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(f"rollout.engine {name!r} is not available; registered: {sorted(ENGINES)}") from None
    return factory(model_cfg, rollout_cfg, tokenizer)
