"""Autoscale advice: a target rollout-pool size from measured trainer wait and data rates.

Pure (no I/O, no clock): the dataflow feeds it what it measured over the last window and
publishes the advice (KV ``autoscale.{pool}``, dataflow heartbeats); ``astraflow up
--autoscale`` acts on it. The rule, with a dead band ``lo <= wait <= hi`` where nothing moves:

    capacity = produce_rate / (nodes * busy)          groups/s one fully busy node delivers
    demand   = consume_rate / (1 - wait)              groups/s the trainers would take if never idle
    need     = ceil(demand / capacity)

    wait > hi:  up   to min(max(need, nodes + 1), nodes + max_step, max_nodes)
    wait < lo:  down to max(need, nodes - max_step, min_nodes), and never above nodes
                (when need >= nodes the pool is fully used: hold)
    otherwise:  hold

``wait`` is the share of the window the most-starved trainer spent waiting for a batch: the
slope of its own cumulative ``wait_s`` heartbeat stat, or, until two heartbeats are in, the
share of samples in which its batch consumer had nothing queued and nothing in hand (read
from the server). ``produce_rate`` is groups completed per second, ``consume_rate`` groups
trained per second, ``busy`` the mean share of the window the live nodes spent generating
(their ``gen_s`` heartbeat stat; 1 when unknown).
Scaling down never drops below what the measured rates require, so the dead band plus the
rate sizing keep a balanced pool from oscillating.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from astraflow.config import AutoscaleConfig


@dataclass(frozen=True)
class Observation:
    """What the dataflow measured over the last window."""

    nodes: int  # live rollout nodes of the pool (heartbeats)
    wait_frac: float  # share of the window the most-starved trainer had no batch
    produce_rate: float  # groups completed per second
    consume_rate: float  # groups trained per second
    busy: float = 1.0  # mean share of the window live nodes spent generating


@dataclass(frozen=True)
class Advice:
    target: int
    action: Literal["up", "down", "hold"]
    reason: str
    need: int | None = None  # nodes the measured rates require (None: not measurable yet)


def _advice(target: int, n: int, reason: str, need: int | None) -> Advice:
    action: Literal["up", "down", "hold"] = "up" if target > n else "down" if target < n else "hold"
    return Advice(target, action, reason, need)


def advise(obs: Observation, cfg: AutoscaleConfig) -> Advice:
    n = obs.nodes
    if n < cfg.min_nodes:
        return _advice(cfg.min_nodes, n, f"{n} live nodes, below min_nodes", None)
    per_node = obs.produce_rate / (n * max(obs.busy, 1e-3)) if n > 0 else 0.0
    demand = obs.consume_rate / max(1.0 - obs.wait_frac, 0.05)
    need = math.ceil(demand / per_node - 1e-9) if per_node > 0 else None
    wait = f"trainers wait {obs.wait_frac:.0%}"
    if obs.wait_frac > cfg.hi:
        target = min(max(need or 0, n + 1), n + cfg.max_step, cfg.max_nodes)
        return _advice(target, n, f"{wait} > hi {cfg.hi:.0%}", need)
    if obs.wait_frac < cfg.lo:
        if need is None or need >= n:
            return _advice(min(n, cfg.max_nodes), n, f"{wait} < lo {cfg.lo:.0%}, but the pool is fully used", need)
        target = min(n, max(need, n - cfg.max_step, cfg.min_nodes))
        return _advice(target, n, f"{wait} < lo {cfg.lo:.0%}", need)
    return _advice(min(n, cfg.max_nodes), n, f"{wait}, within [{cfg.lo:.0%}, {cfg.hi:.0%}]", need)


class Meter:
    """A cumulative counter sampled over time; ``rate`` is its slope over the last window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        if self.samples and value < self.samples[-1][1]:  # the counter restarted (its process did)
            self.samples.clear()
        self.samples.append((t, value))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.window_s:
            self.samples.popleft()

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


class Starvation:
    """Share of the window a trainer had no batch, from periodic samples of its consumer's lag."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.spans: deque[tuple[float, float, bool]] = deque()  # (start, end, starved)
        self.last: tuple[float, bool] | None = None

    def sample(self, t: float, starved: bool) -> None:
        if self.last is not None and t > self.last[0]:
            self.spans.append((self.last[0], t, self.last[1]))
        self.last = (t, starved)
        while self.spans and t - self.spans[0][1] > self.window_s:
            self.spans.popleft()

    def fraction(self) -> float:
        total = sum(e - s for s, e, _ in self.spans)
        return sum(e - s for s, e, starved in self.spans if starved) / total if total > 0 else 0.0


class Nodes:
    """Live rollout nodes of a pool and how busy they are, from their heartbeats.

    A node is live while its last heartbeat is under ``stale_s`` old and it is not draining;
    its busy share is the slope of its cumulative generation time (``gen_s``) over the window.
    """

    def __init__(self, window_s: float, stale_s: float = 6.0) -> None:
        self.window_s = window_s
        self.stale_s = stale_s
        self.meters: dict[str, Meter] = {}
        self.last: dict[str, tuple[float, bool]] = {}  # worker -> (ts, running)

    def seen(self, worker_id: str, ts: float, running: bool, gen_s: float | None = None) -> None:
        self.last[worker_id] = (ts, running)
        if gen_s is not None:
            self.meters.setdefault(worker_id, Meter(self.window_s)).add(ts, gen_s)

    def live_ids(self, now: float) -> list[str]:
        return sorted(w for w, (ts, running) in self.last.items() if running and now - ts < self.stale_s)

    def busy(self, now: float) -> float:
        shares = [min(1.0, self.meters[w].rate()) for w in self.live_ids(now) if w in self.meters and len(self.meters[w].samples) > 1]
        return sum(shares) / len(shares) if shares else 1.0
