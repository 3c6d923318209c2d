"""What the launcher sees on the plane, written to the run directory as it happens.

Like any operator, the launcher reads only the plane: heartbeats, weight announcements, the run
state. Every weight version becomes a line of ``metrics.jsonl`` (once, however often a session
restarts; only announcements a node would follow, ``weights/checks.py``: what a foreign writer
announced that no trainer could have made is dead-lettered, not recorded), every held-out
evaluation a line of ``evals.jsonl`` (one per subject: the evaluated policy, or a team's
policies and the team), and the pool is sampled into ``pool.jsonl``. The trajectory count is the
dataflow's durable one (the trajectories of every group that completed into it, read from its
state on the server every turn), so it survives restarts of either side; the TRAJ stream's
message count is no such count, since a message may carry a whole group.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astraflow.config import Recipe
from astraflow.launch.rundir import RunDir
from astraflow.streams.census import backlogs
from astraflow.streams.dataflow_state import DataflowState, Quarantine
from astraflow.streams.messages import HEARTBEAT_PERIOD_S, TOOL_COUNTS, Heartbeat, RolloutStats, TrainerStats, WeightVersion
from astraflow.streams.plane import Plane, Subscription
from astraflow.streams.state import AutoscaleRecord, DoneRecord, EvalRecord, StateSchemaError
from astraflow.streams.weight_channel import WeightChannel
from astraflow.weights.checks import announcement_problem, order_problem

log = logging.getLogger(__name__)
STALE_BEATS = 3  # a worker silent for this many heartbeat periods is gone
SAMPLE_EVERY_S = 2.0


@dataclass
class Live:
    """The latest of everything, for the view."""

    beats: dict[str, tuple[Heartbeat, float]] = field(default_factory=dict)  # worker -> (heartbeat, monotonic time received)
    versions: dict[str, int] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)  # batch-mean train reward of the last version, per policy
    evals: dict[int, float] = field(default_factory=dict)
    lags: dict[str, int] = field(default_factory=dict)
    trajectories: int = 0
    rate: float = 0.0  # trajectories per second over the last sampling window
    advice: AutoscaleRecord | None = None
    events: list[str] = field(default_factory=list)
    quarantined: dict[str, Quarantine] = field(default_factory=dict)  # nodes the dataflow cut off, and why

    def alive(self, now: float | None = None) -> dict[str, Heartbeat]:
        now = time.monotonic() if now is None else now
        return {w: hb for w, (hb, at) in self.beats.items() if now - at < STALE_BEATS * HEARTBEAT_PERIOD_S}

    def nodes(self) -> int:
        return sum(1 for hb in self.alive().values() if isinstance(hb.stats, RolloutStats) and hb.state != "draining")


class RunWatcher:
    def __init__(self, plane: Plane, recipe: Recipe, rundir: RunDir, wanted_evals: set[int],
                 subjects: tuple[str, ...] = ()) -> None:
        self.plane, self.recipe, self.rundir = plane, recipe, rundir
        self.subjects = subjects or (recipe.eval_policy,)  # whose evaluations are recorded (a team has several)
        self.wanted_evals = {(s, v) for s in self.subjects for v in wanted_evals}
        self.live = Live()
        self.subs: list[Subscription] = []
        self._recorded: set[tuple[str, int, str | None]] = set()
        self._trajectories_at: dict[tuple[str, int], int] = {}  # (policy, version) -> trajectories stored when it was recorded
        for r in rundir.rows("metrics.jsonl"):
            self._recorded.add((r["policy"], r["version"], r.get("state_digest")))
            self._seen_version(r)
        evals = list(rundir.rows("evals.jsonl"))
        self._evals = {(r["policy"], int(r["version"])) for r in evals}
        self.trained = False  # every trainer done (:meth:`finished`); the run may still wait for evaluations
        self.live.evals = {int(r["version"]): float(r["reward"]) for r in evals if r.get("policy") == recipe.eval_policy and "reward" in r}
        self._offset = rundir.wall_s()  # run time before this session
        self._start = time.time()
        self._sampled: tuple[float, int] | None = None
        self._targets: list[dict[str, Any]] = []
        self._newest: dict[str, WeightVersion] = {}  # per policy: the newest announcement recorded
        self._unrecorded: list[WeightVersion] = []  # fetched from the followers, not yet in metrics.jsonl
        self._announcements = [WeightChannel(plane, p).follower(start="all", check=self._possible_on(p)) for p in recipe.policy_names]

    async def start(self) -> None:
        self.subs.append(await self.plane.on_heartbeats(self._on_beat))

    async def stop(self) -> None:
        for s in self.subs:
            await s.stop()
        for follower in self._announcements:
            await follower.close()

    def _on_beat(self, hb: Heartbeat) -> None:
        self.live.beats[hb.worker_id] = (hb, time.monotonic())

    async def read_dataflow(self) -> None:
        """The dataflow's durable count, as its state on the server has it now (written every turn that changed it):
        never lower, whatever restarted; and the nodes it has quarantined."""
        try:
            state = await self.plane.state.get(DataflowState)
        except StateSchemaError as e:  # a state this build cannot read: the count stays where it is
            log.debug("dataflow state unreadable: %s", e)
            return
        if state is not None:
            self.live.trajectories = max(self.live.trajectories, sum(lane.ledger.samples for lane in state.lanes.values()))
            self.live.quarantined = dict(state.quarantined)

    def _possible_on(self, policy: str) -> Callable[[WeightVersion], str | None]:
        def check(ann: WeightVersion) -> str | None:
            """The follower's check, in stream order: why no trainer of ``policy`` could have made ``ann``, or None."""
            newest = self._newest.get(policy)
            problem = announcement_problem(ann, policy) or order_problem(ann, newest)
            if problem is None and (newest is None or ann.version > newest.version):
                self._newest[policy] = ann
            return problem

        return check

    def run_time(self) -> float:
        """Seconds of this run, every session included."""
        return self._offset + time.time() - self._start

    def _seen_version(self, row: dict[str, Any]) -> None:
        p = row["policy"]
        self._trajectories_at[(p, row["version"])] = row.get("trajectories", 0)  # the last record of a version wins
        if row["version"] >= self.live.versions.get(p, -1):
            self.live.versions[p] = row["version"]
            if "reward_mean" in row:
                self.live.rewards[p] = row["reward_mean"]

    async def poll(self, wait: float) -> None:
        """One turn: announcements, evaluations, lags and a pool sample. The dataflow's count is read after the
        announcements arrive: read before, a version trained while the fetch waited would be recorded with a count
        from before its own batch. Announcements fetched in a turn that fails after the fetch (the server restarting
        under the read) are recorded in the next one: a follower hands each over once."""
        for i, f in enumerate(self._announcements):
            self._unrecorded += await f.fetch(wait if i == 0 else 0.0)
        await self.read_dataflow()
        anns, self._unrecorded = self._unrecorded, []
        for ann in anns:
            key = (ann.policy, ann.version, ann.state_digest)
            if key in self._recorded:
                continue
            self._recorded.add(key)
            row = {
                "policy": ann.policy,
                "version": ann.version,
                "encoding": ann.encoding,
                "bytes": ann.objects[0].size if ann.objects else 0,
                "state_digest": ann.state_digest,
                "ts": ann.created_at,
                "run_s": round(self.run_time(), 2),
                "trajectories": self.live.trajectories,
                **ann.metrics,
            }
            self.rundir.append("metrics.jsonl", row)
            self._seen_version(row)
        await self._poll_evals()
        await self._sample()

    async def _poll_evals(self) -> None:
        """Read the evaluations that may exist by now: of versions already announced (one KV read each; the ones still
        ahead would be a read per poll each, for nothing)."""
        epol = self.recipe.eval_policy
        newest = max(self.live.versions.values(), default=-1)
        for subject, v in sorted(w for w in self.wanted_evals - self._evals if w[1] <= newest):
            try:
                got = await self.plane.state.get(EvalRecord, subject, v)
            except StateSchemaError as e:  # not a record (a writer the permissions let through): no figure, the run goes on
                log.warning("evaluation of %s v%d is not readable, left out of the figures: %s", subject, v, e)
                self._evals.add((subject, v))
                continue
            if got is None:
                continue
            self._evals.add((subject, v))
            if got.skipped:  # gone before the evaluator got to it: no figures, the reason recorded
                log.warning("evaluation of %s v%d skipped: %s", subject, v, got.skipped)
                self.rundir.append("evals.jsonl", {"policy": subject, "version": v, "skipped": got.skipped,
                                                   "run_s": round(self.run_time(), 2)})
                continue
            if subject == epol:
                self.live.evals[v] = got.reward
            rollouts = self._trajectories_at.get((epol, v), self.live.trajectories)  # generated when v was trained
            self.rundir.append(
                "evals.jsonl",
                {
                    "policy": subject,
                    "version": v,
                    "reward": got.reward,
                    "avg@k": got.avg_at_k,
                    "pass@k": got.pass_at_k,
                    "k": got.k,
                    "rollouts": rollouts,
                    "run_s": round(self.run_time(), 2),
                },
            )

    async def _sample(self) -> None:
        now = time.time()
        if self._sampled is not None and now - self._sampled[0] < SAMPLE_EVERY_S:
            return
        for label, lag in (await backlogs(self.plane, self.recipe.rollout.pool, self.recipe.policy_names)).items():
            if lag is not None:
                self.live.lags[label] = lag.pending + lag.ack_pending
        if self._sampled is not None:
            t0, c0 = self._sampled
            self.live.rate = max(0.0, (self.live.trajectories - c0) / max(now - t0, 1e-9))
        self._sampled = (now, self.live.trajectories)
        alive = self.live.alive()
        row: dict[str, Any] = {"wall_ts": now, "run_s": round(self.run_time(), 2), "trajectories": self.live.trajectories,
                               "rate": round(self.live.rate, 3), "nodes": self.live.nodes()}
        for hb in alive.values():  # a trainer's wait exists only once the trainer does
            if isinstance(hb.stats, TrainerStats):
                row[f"wait.{hb.policy}"] = round(hb.stats.wait_frac, 4)
        nodes = [hb.stats.counters for hb in alive.values() if isinstance(hb.stats, RolloutStats)]
        for key in TOOL_COUNTS:  # agents' tool calls, and those that did not parse, over the live nodes
            if any(key in c for c in nodes):
                row[key] = sum(c.get(key, 0.0) for c in nodes)
        self.rundir.append("pool.jsonl", row)
        self._write_targets(alive)
        self.live.advice = await self.plane.state.get(AutoscaleRecord, self.recipe.rollout.pool)

    def _write_targets(self, alive: dict[str, Heartbeat]) -> None:
        """``prometheus_targets.json`` (Prometheus ``file_sd`` format): every live role that serves metrics."""
        targets = [{"targets": [hb.metrics], "labels": {"role": hb.role, "worker": w, "policy": hb.policy, "run": self.rundir.run}}
                   for w, hb in sorted(alive.items()) if hb.metrics]
        if targets != self._targets:
            self._targets = targets
            path = self.rundir.file("prometheus_targets.json")
            path.with_suffix(".tmp").write_text(json.dumps(targets, indent=2))
            path.with_suffix(".tmp").replace(path)  # Prometheus never reads a half-written file

    async def record_accounting(self, wait: float = 0.0) -> None:
        """The dataflow's task accounting into ``accounting.json`` (the summary reads it): once the dataflow has taken
        in every trainer's last announcement (it writes its state within ``COMMIT_EVERY_S`` of a change), or as it
        stands after ``wait`` seconds (a dataflow that is gone)."""
        deadline = time.monotonic() + wait
        state = await self.plane.state.get(DataflowState)
        while time.monotonic() < deadline and not self._accounted(state):
            await asyncio.sleep(0.1)
            state = await self.plane.state.get(DataflowState)
        if state is not None:
            self.rundir.file("accounting.json").write_text(
                json.dumps({p: a.model_dump() for p, a in state.accounting.items()}, indent=2))

    def _accounted(self, state: DataflowState | None) -> bool:
        """The dataflow's state shows every trainer's last version taken in."""
        if state is None:
            return False
        return all(p in state.lanes and state.lanes[p].followed >= cfg.trainer.steps for p, cfg in self.recipe.policies.items())

    async def finished(self) -> bool:
        """Every trainer done, its last version's announcement recorded in ``metrics.jsonl`` (after a server's restart
        the announcements may reach the launcher after the trainer's done record), and every wanted evaluation in."""
        for p, c in self.recipe.policies.items():
            if self.live.versions.get(p, -1) < c.trainer.steps:
                return False
            done = await self.plane.state.get(DoneRecord, p)
            if done is None or done.version < c.trainer.steps:
                return False
        self.trained = True
        return self.wanted_evals <= self._evals
