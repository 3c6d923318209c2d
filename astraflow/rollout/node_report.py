"""What a rollout node reports: its heartbeat's stats, and its Prometheus metrics (``--metrics-port``).

Cumulative stats are exported as counters (``..._total``), advanced by what changed since the last
export; the rest as gauges. Node-wide metrics carry ``policy=""``; per-policy ones (``version``,
``weight_sync_*``) the policy.
"""

from __future__ import annotations

from astraflow.metrics import Metrics
from astraflow.rollout.node_weights import NodeWeights
from astraflow.streams.messages import TOOL_COUNTS, RolloutStats, Trajectory

NODE_STATS = ("tasks", "trajectories", "tokens", "gen_s", "pull_s", "publish_s", "failed", "stale_naks", "drained_naks", "held",
              "refreshes", "refresh_s", "refresh_errors", "joined", "rejected_tasks",
              "switched")  # a node's stats, all from the start
NODE_GAUGES = ("held", "joined")  # the other node stats are cumulative: exported as counters
WEIGHT_SYNC_STATS = ("keyframes", "deltas", "bytes", "joins", "fallbacks", "failures", "refetches", "rejected",
                     "keyframe_requests")  # WeightSync.stats keys exported from the start (others when they appear)
NODE_COUNTERS = {"gen_s": "gen_seconds", "pull_s": "pull_seconds", "publish_s": "publish_seconds",
                 "refresh_s": "refresh_seconds"}  # renamed for Prometheus (others keep their stats key)


class NodeReport:
    """The node's ``stats`` and its ``weights``, as a heartbeat carries them and as Prometheus reads them."""

    def __init__(self, stats: dict[str, float], weights: NodeWeights, metrics: Metrics | None) -> None:
        self.stats = stats
        self.weights = weights
        self.metrics = metrics  # None: no Prometheus export
        self._exported: dict[tuple[str, str], float] = {}  # counters' values at the last export

    def add(self, key: str, value: float) -> None:
        self.stats[key] += value

    def done(self, trajectories: list[Trajectory]) -> None:
        """A task's trajectories were published."""
        self.stats["tasks"] += 1
        self.stats["trajectories"] += len(trajectories)
        self.stats["tokens"] += sum(len(t.completion_ids) // 4 for t in trajectories)
        self.stats["switched"] += sum(_switched(t) for t in trajectories)
        for key in TOOL_COUNTS:  # agents' tool use (openai_agent, multi_turn_tools), when their trajectories count it
            n = sum(_count(t.meta.get(key)) for t in trajectories)
            if n or key in self.stats:
                self.stats[key] = self.stats.get(key, 0.0) + n

    def heartbeat_stats(self, endpoint: str) -> RolloutStats:
        typed = set(RolloutStats.model_fields) - {"role", "counters", "weights", "joined", "endpoint"}
        s = self.stats
        return RolloutStats(**{k: s[k] for k in typed}, joined=bool(s["joined"]), endpoint=endpoint,
                            counters={k: v for k, v in s.items() if k not in typed and k != "joined"},
                            weights={p: {k: float(v) for k, v in sync.stats.items()} for p, sync in self.weights.syncs.items()})

    def export(self, draining: bool) -> None:
        """Push the stats to Prometheus (nothing without an exporter)."""
        if self.metrics is None:
            return
        counters = {NODE_COUNTERS.get(k, k): v for k, v in self.stats.items() if k not in NODE_GAUGES}
        self.metrics.set({k: self.stats[k] for k in NODE_GAUGES})
        self.metrics.set({"draining": float(draining)})
        self._inc(self.metrics, "", counters)
        for p, sync in self.weights.syncs.items():
            m = self.metrics.child(p)
            m.set({"version": float(sync.version), "announced_version": float(self.weights.newest()[p])})
            totals = {**dict.fromkeys(WEIGHT_SYNC_STATS, 0.0), **sync.stats}  # every series exists from the start
            self._inc(m, p, {f"weight_sync_{k}": float(v) for k, v in totals.items()})

    def _inc(self, m: Metrics, policy: str, totals: dict[str, float]) -> None:
        deltas = {}
        for key, total in totals.items():
            delta = total - self._exported.get((policy, key), 0.0)
            if delta > 0 or (policy, key) not in self._exported:
                deltas[key] = delta
                self._exported[(policy, key)] = total
        m.inc(deltas)


def _count(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _switched(t: Trajectory) -> bool:
    """Its generated tokens come from more than one version (a partial rollout, or a refresh between turns)."""
    if t.versions == t.versions[:4] * (len(t.versions) // 4):  # every token's version the same: most trajectories
        return False
    v = t.token_versions()[t.mask() == 1]
    return len(v) > 0 and int(v.min()) != int(v.max())
