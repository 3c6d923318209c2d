"""What the dataflow measures for autoscale advice, and where it publishes the advice.

Inputs, all measured: live nodes of the pool and how busy they are (rollout heartbeats), each
trainer's waiting (its own cumulative ``wait_s`` heartbeat stat; until two of those are in,
samples of its batch consumer's lag read from the server), groups produced and trained per
second. The advice (``autoscale.advise``) goes to the KV as ``autoscale.{pool}``: on every
change, every beat while it says up or down, and every 10 s while it holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from astraflow.config import AutoscaleConfig
from astraflow.dataflow.autoscale import Advice, Meter, Nodes, Observation, Starvation, advise
from astraflow.streams.batch_queue import BatchQueue
from astraflow.streams.messages import Heartbeat, RolloutStats, TrainerStats
from astraflow.streams.plane import Plane
from astraflow.streams.state import AutoscaleRecord

if TYPE_CHECKING:
    from astraflow.dataflow.lane import PolicyLane


log = logging.getLogger(__name__)


class PoolAdvisor:
    def __init__(self, plane: Plane, pool: str, policies: tuple[str, ...], cfg: AutoscaleConfig) -> None:
        self.plane, self.pool, self.cfg = plane, pool, cfg
        self.nodes = Nodes(cfg.window_s)
        self.starved = {p: Starvation(cfg.window_s) for p in policies}
        self.trainer_wait: dict[str, Meter] = {}  # per policy: the trainer's cumulative wait_s
        self.produced, self.consumed = Meter(cfg.window_s), Meter(cfg.window_s)
        self.advice: Advice | None = None
        self.put_at = 0.0
        self.measured = 0.0

    def seen(self, hb: Heartbeat, now: float) -> None:
        if isinstance(hb.stats, RolloutStats) and hb.pool == self.pool:
            self.nodes.seen(hb.worker_id, now, hb.state == "running", hb.stats.gen_s)
        elif isinstance(hb.stats, TrainerStats) and hb.policy in self.starved:
            self.trainer_wait.setdefault(hb.policy, Meter(self.cfg.window_s)).add(hb.ts, hb.stats.wait_s)

    async def measure(self, lanes: dict[str, PolicyLane], produced: float, consumed: float, every_s: float = 0.25) -> None:
        """Sample each trainer's batch consumer (nothing queued nor in hand: that trainer waits) and the rates."""
        now = time.time()
        if now - self.measured < every_s:
            return
        self.measured = now
        for p, lane in lanes.items():
            try:
                lag = await BatchQueue(self.plane, p).backlog()
            except TimeoutError:  # a slow server: skip this sample (the next comes in ``every_s``), never stop the dataflow
                log.warning("measuring %s's batch consumer timed out; sample skipped", p)
                continue
            lane.backlog = lag.pending
            self.starved[p].sample(now, lag.pending == 0 and lag.ack_pending == 0)
        self.produced.add(now, produced)
        self.consumed.add(now, consumed)

    def wait_frac(self, policy: str) -> float:
        """The trainer's own waiting share over the window, else what its consumer's lag says."""
        own = self.trainer_wait.get(policy)
        if own is not None and len(own.samples) > 1:
            return min(1.0, max(0.0, own.rate()))
        return self.starved[policy].fraction()

    def observation(self) -> Observation:
        now = time.time()
        return Observation(nodes=len(self.nodes.live_ids(now)), wait_frac=max(self.wait_frac(p) for p in self.starved),
                           produce_rate=self.produced.rate(), consume_rate=self.consumed.rate(), busy=self.nodes.busy(now))

    async def publish(self) -> tuple[Advice, Observation]:
        obs = self.observation()
        before, self.advice = self.advice, advise(obs, self.cfg)
        now = time.time()
        changed = before is None or (before.target, before.action) != (self.advice.target, self.advice.action)
        if changed or self.advice.action != "hold" or now - self.put_at > 10:
            await self.plane.state.put(AutoscaleRecord(pool=self.pool, **asdict(self.advice), nodes=obs.nodes, wait_frac=obs.wait_frac,
                                                       produce_rate=obs.produce_rate, consume_rate=obs.consume_rate, busy=obs.busy))
            self.put_at = now
        return self.advice, obs
