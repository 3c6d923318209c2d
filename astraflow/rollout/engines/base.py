"""The Engine contract every rollout runtime speaks (hf, sglang, vllm, scripted, plug-ins).

An engine generates completions with the behaviour logprob and the weight version of every
token, applies a weight version (``load_state``) and reports the version it holds. Engines are
blocking objects; the worker calls them from a thread. ``generate`` and ``load_state`` never
overlap on one engine (each implementation serialises them), so the version an engine reports
for a token is the version whose weights produced it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 8
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # stop strings; the completion keeps the stop string and ends with "stop"
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


class StaleWeights(RuntimeError):
    """The engine holds weights older than the task allows; the task goes back to the pool."""


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int:
        """Weight version currently loaded (-1 before the first)."""

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Generate one completion per request (blocking; callers run it off the event loop)."""

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Apply weight version ``version`` given as a full bf16 state (in place; waits for generation in flight)."""

    def state_view(self) -> Mapping[str, torch.Tensor]:
        """The engine's current weights by name (what the node last applied, for remote engines)."""


def expect_callers(engine: Any, n: int) -> None:
    """Tell an engine that batches concurrent calls itself (``hf``) that ``n`` threads call it at once, if it asks."""
    expect = getattr(engine, "expect_callers", None)
    if callable(expect):
        expect(n)


def close_engine(engine: Any) -> None:
    """Release what an engine holds (a launched server, a staging directory), if it has anything."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()
