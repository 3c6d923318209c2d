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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from astraflow.moe_routing import Routes


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
    adapter: str | None = None  # the LoRA adapter that generates it, on an engine serving several on one base (shared_base.py)


@dataclass(frozen=True)
class Completion:
    """One generated continuation. Arrays are aligned with ``token_ids``."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each token under the sampling distribution
    versions: list[int]  # weight version that produced each token
    finish_reason: str  # "stop" | "length"
    routing: Routes | None = None  # the experts its prompt and tokens were routed to (engines that ``record_routing``)


@runtime_checkable
class RecordsRouting(Protocol):
    """An engine that can record each position's Mixture-of-Experts routing (``trainer.routing``; ``hf`` can)."""

    def record_routing(self) -> None:
        """From now on every completion carries its ``routing``; ValueError when the model has no routers."""


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

    def expect_callers(self, n: int) -> None:
        """``n`` threads will call ``generate`` at once (a node's generation slots). An engine that batches concurrent
        calls itself (``hf``) waits a little for all of them; one whose server batches ignores it."""

    def close(self) -> None:
        """Release what the engine holds (a launched server, a staging directory); nothing when it holds nothing."""


ENGINE_METHODS = ("generate", "load_state", "state_view", "expect_callers", "close")


def checked_engine(engine: object, name: str) -> Engine:
    """``engine`` as the factory registered under ``name`` built it, if it speaks the whole contract; a plug-in
    that leaves a method out fails here, when it is built, with the methods named."""
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if missing or not hasattr(engine, "version"):
        raise TypeError(f"engine {name!r} built a {type(engine).__name__} that lacks {missing or ['version']}: an engine "
                        f"implements version, {', '.join(ENGINE_METHODS)} (astraflow/rollout/engines/base.py, Engine)")
    return engine  # type: ignore[return-value]
