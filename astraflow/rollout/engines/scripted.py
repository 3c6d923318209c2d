"""``scripted`` engine — A BENCHMARK ENGINE: real tokens from a tiny model, scripted latency.

It exists to measure the system itself (scheduling, staleness, tail latency), not a model
server. Its options (``rollout.engine: {type: scripted, ...}``) are ``ScriptedOptions``. Each request:

1. gets its tokens at once from a real in-process model (an ``hf`` engine underneath, the
   recipe's tiny model and weights): token ids, behaviour logprobs and the weight version of
   every token are the model's own, so training on them is real;
2. then holds one of ``concurrency`` slots for a latency drawn from ``latency``
   (``lognormal``: median ``latency_median_s``, shape ``latency_sigma``;
   ``pareto``: median ``latency_median_s``, tail index ``latency_alpha``; ``constant``:
   ``latency_median_s``), as ``time.sleep`` on a pool of ``concurrency`` threads.

Requests of one call and of concurrent calls (a workflow running tasks in threads) share the
slots first come, first served, so latencies overlap up to ``concurrency`` at a time and a node
behaves like a server with that many sequences in flight. The compute time of the real model
counts toward a request's latency. Latencies come from ``random.Random`` seeded with
``latency_seed`` and the process id: nodes draw independent streams; the
distribution, not the sequence, is what a run pins.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from astraflow.registry import ENGINES
from astraflow.rollout.engines.base import Completion, GenerationRequest
from astraflow.rollout.engines.options import HfOptions, ScriptedOptions


@dataclass
class Latency:
    """A per-request latency distribution (seconds)."""

    dist: str  # "lognormal" | "pareto" | "constant"
    median_s: float
    sigma: float = 1.0  # lognormal: sd of log latency
    alpha: float = 1.5  # pareto: tail index (> 0); the mean is finite only for alpha > 1
    seed: int | str = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.lock = threading.Lock()

    def draw(self) -> float:
        with self.lock:
            if self.dist == "constant":
                return self.median_s
            if self.dist == "lognormal":
                return self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0))
            if self.dist == "pareto":  # x_m * U^(-1/alpha), with x_m chosen so the median is median_s
                x_m = self.median_s / 2 ** (1.0 / self.alpha)
                return x_m * (1.0 - self.rng.random()) ** (-1.0 / self.alpha)
        raise ValueError(f"unknown latency distribution {self.dist!r}")


class ScriptedEngine:
    """Wraps a real engine for tokens; every request then holds a slot for a scripted latency."""

    def __init__(self, inner: Any, latency: Latency, concurrency: int) -> None:
        self.inner = inner
        self.latency = latency
        self.concurrency = concurrency
        self.slots = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="scripted-slot")
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "latency_s": 0.0}

    @property
    def version(self) -> int:
        return self.inner.version

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        self.inner.load_state(state, version)

    def state_view(self) -> Mapping[str, Any]:
        return self.inner.state_view()

    def expect_callers(self, n: int) -> None:
        """Nothing to do: each call sleeps its own scripted latency."""

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        if not requests:
            return []
        t0 = time.monotonic()
        delays = [self.latency.draw() for _ in requests]
        completions = self.inner.generate(requests)  # real tokens, logprobs and versions, now
        compute = time.monotonic() - t0
        # the slot's wait is what is left of the latency once the model's own time is counted
        futures = [self.slots.submit(time.sleep, max(0.0, d - compute)) for d in delays]
        for f in futures:
            f.result()
        with self.lock:
            self.stats["requests"] += len(requests)
            self.stats["latency_s"] += sum(delays)
        return completions

    def close(self) -> None:
        self.slots.shutdown(wait=False, cancel_futures=True)


@ENGINES.register("scripted", ScriptedOptions)
def build_scripted(options: ScriptedOptions, model_cfg: Any, rollout_cfg: Any, tokenizer: Any) -> ScriptedEngine:
    from astraflow.rollout.engines.hf import build_hf

    o = options
    latency = Latency(o.latency, o.latency_median_s, o.latency_sigma, o.latency_alpha, seed=f"{o.latency_seed}:{os.getpid()}")
    return ScriptedEngine(build_hf(HfOptions(), model_cfg, rollout_cfg, tokenizer), latency, o.concurrency)
