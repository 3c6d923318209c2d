"""The Engine contract every rollout runtime speaks (hf, sglang, vllm, scripted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

import torch


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
