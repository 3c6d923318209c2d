"""A discrete-event model of a rollout pool at scale, calibrated on the plane's measured figures.

The pool: ``nodes`` rollout nodes with ``slots_per_node`` task slots each. A task is a group of ``group_size`` samples,
each its own request held for a latency drawn as the ``scripted`` engine draws it (every request of a task runs at once,
so the task takes the longest of its group's draws). The dataflow issues tasks within its staleness budget, ``min
(max_tasks_in_flight, (max_staleness + 1) · groups_per_batch) − in flight − buffered`` (``dataflow/issuing.py``), each
with a floor of ``version − max_staleness``; a free slot takes the oldest issued task and rolls it out with the newest
version its node holds (waiting for the floor's weights if it holds an older one). A finished group queues for the
dataflow (one queue per shard, ``group_size × CPU per trajectory`` each), is dropped if it lags the trainer by more than
``max_staleness``, else buffered. The trainer takes ``groups_per_batch`` groups (oldest first) whenever it is idle and
has them, and announces a version ``step_s`` later; a version reaches every node ``fanout_s`` after its announcement
(:func:`fanout`: hub → region mirrors → nodes, optionally through relays). Staleness is the trainer's version when it
takes a group minus the version that generated it.

Left out: partial rollouts (a task keeps the version it started with), per-node differences in when a version lands (every
node gets it when the last does, which overstates staleness a little), pull and publish round trips (milliseconds against
seconds of generation), failures. Where cores are shared (the measured runs: every process on one machine), ``machine_cores``
adds one more queue: each group's CPU work, all processes together, at the speed of the cores left after the per-node
chatter.

    from pool_model import Latency, Pool, simulate, fanout, size_tiers
    from pool_calibration import load   # the Calibration, from benchmarks/results/*.json
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


# ------------------------------------------------------------------------------------------------ latency
@dataclass(frozen=True)
class Latency:
    """A request's latency (seconds), drawn as ``rollout/engines/scripted.py`` draws it."""

    dist: str = "lognormal"  # "lognormal" | "pareto" | "constant"
    median_s: float = 2.0
    sigma: float = 1.0  # lognormal: sd of log latency
    alpha: float = 1.5  # pareto: tail index

    def draw(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        if self.dist == "lognormal":  # median · e^(σ z)
            return self.median_s * np.exp(self.sigma * rng.standard_normal(shape))
        if self.dist == "pareto":  # x_m · U^(−1/α), x_m = median / 2^(1/α)
            return self.median_s / 2 ** (1 / self.alpha) * (1.0 - rng.random(shape)) ** (-1 / self.alpha)
        return np.full(shape, self.median_s)

    def mean_max(self, k: int) -> float:
        """E[max of k draws]: a task's mean time when its k requests run at once."""
        if self.dist == "lognormal":  # ∫ median e^(σz) · k Φ(z)^(k−1) φ(z) dz
            z = np.linspace(-10, 10, 4001)
            phi, cdf = np.exp(-z * z / 2) / math.sqrt(2 * math.pi), 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
            return float(np.trapezoid(self.median_s * np.exp(self.sigma * z) * k * cdf ** (k - 1) * phi, z))
        if self.dist == "pareto":  # x_m · k · B(k, 1 − 1/α); infinite for α ≤ 1
            if self.alpha <= 1:
                return math.inf
            x_m = self.median_s / 2 ** (1 / self.alpha)
            return x_m * k * math.gamma(k) * math.gamma(1 - 1 / self.alpha) / math.gamma(k + 1 - 1 / self.alpha)
        return self.median_s


# ------------------------------------------------------------------------------------------------ the pool
@dataclass(frozen=True)
class Pool:
    """What the simulation runs: the pool, the dataflow, the trainer, and when a version reaches the nodes."""

    nodes: int
    slots_per_node: int
    group_size: int
    latency: Latency
    groups_per_batch: int
    step_s: float
    max_staleness: int
    max_tasks_in_flight: int | None = None  # None: only the staleness budget bounds what is issued
    dataflow_ms_per_traj: float = 0.0  # the dataflow's CPU per trajectory (one event loop per shard)
    dataflow_idle: float = 0.0  # share of the dataflow's core taken whatever the rate (per-node chatter)
    dataflow_shards: int = 1
    fanout_s: float = 0.0  # announcement → every node holds the version
    machine_cores: float | None = None  # shared cores (the measured runs); None: every part has its own
    machine_ms_per_traj: float = 0.0  # CPU per trajectory, every process together, on the shared cores
    machine_idle_cores: float = 0.0  # cores the shared machine spends whatever the rate (per-node chatter)

    @property
    def slots(self) -> int:
        return self.nodes * self.slots_per_node

    @property
    def offered_traj_per_s(self) -> float:
        """Little's law with every slot busy: slots × group / E[task time]."""
        return self.slots * self.group_size / self.latency.mean_max(self.group_size)


@dataclass(frozen=True)
class Run:
    """What a simulated window shows."""

    traj_per_s: float  # trajectories landed and kept
    trained_traj_per_s: float
    tasks_per_s: float
    task_latency_p50_s: float  # the dataflow's issue → the group published (the measured runs' definition)
    task_latency_p99_s: float
    service_p50_s: float  # a slot took the task → the group published
    service_p99_s: float
    staleness: Mapping[int, float]  # lag → share of trained groups
    staleness_mean: float
    dropped_share: float  # groups dropped as too stale (landing or waiting in the buffer), of those landed
    dataflow_util: float  # busy share of the dataflow's shards
    machine_util: float
    slot_util: float  # slot-seconds held (generating or waiting for weights) over slot-seconds
    version_interval_s: float
    versions: int


def simulate(pool: Pool, window_s: float, warmup_s: float | None = None, seed: int = 0, backlog_s: float = 0.0) -> Run:
    """Run the pool for ``warmup_s`` (default: three mean task times), then measure ``window_s``. The first budget of
    tasks is issued ``backlog_s`` before the nodes start (as when nodes are still joining)."""
    g, s, b = pool.group_size, pool.max_staleness, pool.groups_per_batch
    warmup = 3 * pool.latency.mean_max(g) if warmup_s is None else warmup_s
    end = warmup + window_s
    cap = (s + 1) * b if pool.max_tasks_in_flight is None else min(pool.max_tasks_in_flight, (s + 1) * b)
    rng = np.random.default_rng(seed)
    draws: list[float] = []
    df_service = g * pool.dataflow_ms_per_traj / 1000 / max(1e-9, 1 - pool.dataflow_idle)  # seconds per group
    m_cores = (pool.machine_cores - pool.machine_idle_cores) if pool.machine_cores else 0.0
    m_service = g * pool.machine_ms_per_traj / 1000 / m_cores if m_cores > 0 else 0.0
    if pool.machine_cores and m_cores <= 0:
        raise ValueError(f"the per-node chatter alone takes {pool.machine_idle_cores:.2f} of {pool.machine_cores} cores")

    heap: list[tuple[float, int, int, float, int, float]] = []  # (time, seq, kind, issued at, generating version, pulled at)
    seq = itertools.count()
    done, land, step = 0, 1, 2
    version, arrive, announced = 0, [0.0], [0.0]  # arrive[v]: when every node holds v (v0 from the start)
    issued: deque[tuple[float, int]] = deque()  # (issue time, floor version)
    idle, in_flight, buffered, n_buffered = pool.slots, 0, Counter[int](), 0
    training = False
    df_free, m_free = [0.0] * pool.dataflow_shards, 0.0
    kept = trained = tasks = dropped = landed = 0
    lag_counts: Counter[int] = Counter()
    latencies: list[float] = []
    services: list[float] = []
    busy_df = busy_m = busy_slots = 0.0

    def draw() -> float:
        if not draws:
            draws.extend(pool.latency.draw(rng, (8192, g)).max(axis=1).tolist())
        return draws.pop()

    def in_window(a: float, z: float) -> float:  # the part of [a, z] inside the window
        return max(0.0, min(z, end) - max(a, warmup))

    def issue(t: float, stamp: float | None = None) -> None:
        nonlocal in_flight
        n = cap - in_flight - n_buffered
        if n > 0:
            issued.extend([(t if stamp is None else stamp, max(0, version - s))] * n)
            in_flight += n
        dispatch(t)

    def dispatch(t: float) -> None:
        nonlocal idle, busy_slots
        while idle and issued:
            issued_at, floor = issued.popleft()
            idle -= 1
            begin = max(t, arrive[floor])  # a node older than the floor waits for its weights
            held = bisect.bisect_right(arrive, begin) - 1
            finish = begin + draw()
            busy_slots += in_window(t, finish)
            heapq.heappush(heap, (finish, next(seq), done, issued_at, held, t))

    def train(t: float) -> None:
        nonlocal training, n_buffered, trained, dropped
        stale = [v for v in buffered if version - v > s]  # served only within max_staleness of the trainer
        for v in stale:
            gone = buffered.pop(v)
            n_buffered -= gone
            dropped += gone if t >= warmup else 0
        if stale:
            issue(t)
        if training or n_buffered < b:
            return
        need = b
        for v in sorted(buffered):  # oldest first
            take = min(need, buffered[v])
            buffered[v] -= take
            need -= take
            if t >= warmup:
                lag_counts[version - v] += take
                trained += take
            if not buffered[v]:
                del buffered[v]
            if not need:
                break
        n_buffered -= b
        training = True
        heapq.heappush(heap, (t + pool.step_s, next(seq), step, 0.0, 0, 0.0))
        issue(t)

    issue(0.0, stamp=-backlog_s)
    while heap:
        t, _, kind, issued_at, v, pulled_at = heapq.heappop(heap)
        if t > end:
            break
        if kind == done:  # the group goes through the shared cores (if any), then the dataflow's shard free first
            idle += 1
            tasks += t >= warmup
            m_start = max(t, m_free)
            m_free = m_start + m_service
            busy_m += in_window(m_start, m_free)
            if t >= warmup:
                latencies.append(m_free - issued_at)
                services.append(m_free - pulled_at)
            free = heapq.heappop(df_free)
            start = max(m_free, free)
            heapq.heappush(df_free, start + df_service)
            busy_df += in_window(start, start + df_service)
            heapq.heappush(heap, (start + df_service, next(seq), land, issued_at, v, 0.0))
            dispatch(t)
        elif kind == land:
            in_flight -= 1
            landed += t >= warmup
            if version - v > s:
                dropped += t >= warmup
                issue(t)
            else:
                kept += t >= warmup
                buffered[v] += 1
                n_buffered += 1
                train(t)
        else:  # a step ends: the version is announced, and lands everywhere fanout_s later
            version += 1
            announced.append(t)
            arrive.append(t + pool.fanout_s)
            training = False
            issue(t)
            train(t)
    shown = sum(lag_counts.values()) or 1
    in_win = [a for a in announced if warmup <= a <= end]
    return Run(
        traj_per_s=kept * g / window_s, trained_traj_per_s=trained * g / window_s, tasks_per_s=tasks / window_s,
        task_latency_p50_s=float(np.percentile(latencies, 50)) if latencies else math.nan,
        task_latency_p99_s=float(np.percentile(latencies, 99)) if latencies else math.nan,
        service_p50_s=float(np.percentile(services, 50)) if services else math.nan,
        service_p99_s=float(np.percentile(services, 99)) if services else math.nan,
        staleness={lag: n / shown for lag, n in sorted(lag_counts.items())},
        staleness_mean=sum(lag * n for lag, n in lag_counts.items()) / shown,
        dropped_share=dropped / landed if landed else 0.0,
        dataflow_util=busy_df / window_s / pool.dataflow_shards + pool.dataflow_idle,
        machine_util=(busy_m * m_cores / window_s + pool.machine_idle_cores) / pool.machine_cores if pool.machine_cores else 0.0,
        slot_util=busy_slots / window_s / pool.slots,
        version_interval_s=(in_win[-1] - in_win[0]) / (len(in_win) - 1) if len(in_win) > 1 else math.inf,
        versions=len(in_win))


# ------------------------------------------------------------------------------------------------ fan-out
@dataclass(frozen=True)
class Links:
    """How fast the tiers send a version: a fixed part, then copies at each sender's rate (bytes/s)."""

    base_s: float  # announcement → fetch under way, whatever the copies
    hub_bps: float
    leaf_bps: float  # a region's mirror
    relay_bps: float  # a node (or sub-mirror) that passes the version on


@dataclass(frozen=True)
class FanOut:
    hub_copies: int
    leaf_copies: int  # the busiest mirror's
    depth: int  # relay levels below a mirror (1: the mirror sends to every node of its region)
    hub_bytes: float  # per version
    leaf_bytes: float
    to_all_s: float


def copies(nodes: int, regions: int) -> tuple[int, int]:
    """(copies the hub sends, copies the busiest mirror sends) per version: regions = 0 means every node reads the hub."""
    return (nodes, 0) if regions == 0 else (regions, math.ceil(nodes / regions))


def relayed(nodes: int, regions: int, relays: int, delta_bytes: float, links: Links) -> tuple[FanOut, int]:
    """Hub → region mirrors → ``relays`` relay servers per region (each a mirror of its region's) → nodes, store and
    forward, each server's copies sharing its link; a relay costs a copy as a mirror does. Also the busiest relay's copies.

    to_all = base + regions · b / hub + relays · b / mirror + ⌈nodes / (regions · relays)⌉ · b / mirror"""
    per_relay = math.ceil(nodes / (regions * relays))
    to_all = (links.base_s + regions * delta_bytes / links.hub_bps + relays * delta_bytes / links.leaf_bps
              + per_relay * delta_bytes / links.leaf_bps)
    return FanOut(regions, relays, 2, regions * delta_bytes, relays * delta_bytes, to_all), per_relay


def fanout(nodes: int, regions: int, delta_bytes: float, links: Links, relay: int | None = None) -> FanOut:
    """Hub → mirrors → nodes, each sender's copies sharing its link (so its last copy lands after copies × bytes / rate).

    With ``relay`` f, a mirror sends f copies and every node that holds the version sends f more: after L levels
    f + f² + … + f^L nodes hold it; each level takes f × bytes / rate (store and forward: an upper bound).
    """
    hub, per_region = copies(nodes, regions)
    if regions == 0:  # base + N × bytes / hub rate
        return FanOut(hub, 0, 0, hub * delta_bytes, 0.0, links.base_s + hub * delta_bytes / links.hub_bps)
    f = per_region if relay is None else min(relay, per_region)
    depth, reached = 1, f
    while reached < per_region:
        depth += 1
        reached += f ** depth
    to_all = (links.base_s + hub * delta_bytes / links.hub_bps + f * delta_bytes / links.leaf_bps
              + (depth - 1) * f * delta_bytes / links.relay_bps)
    return FanOut(hub, f, depth, hub * delta_bytes, f * delta_bytes, to_all)


def on_links(run: Mapping[str, Any]) -> float:
    """The model's fan-out time for a ``bench_fanout.py`` run on its emulated links: every server at the links' rate,
    no fixed part (a flat layout: the server's copies; relays: :func:`relayed`; a tree: a level's copies per level)."""
    rate = run["link_bytes_per_s"]
    links = Links(0.0, rate, rate, rate)
    if run["mode"] == "relayed":
        return relayed(run["nodes"], run["regions"], run["relays"], run["delta_bytes"], links)[0].to_all_s
    return fanout(run["nodes"], run["regions"], run["delta_bytes"], links, relay=run["relays"] or None).to_all_s


# ------------------------------------------------------------------------------------------------ what was measured
@dataclass(frozen=True)
class Calibration:
    """Every figure the model takes from a measurement (``pool_calibration.load`` reads them from the results files);
    ``sources`` says where each came from: a results file, a section of BENCHMARKS.md recorded by hand, or "assumption"
    where nothing was measured."""

    dataflow_ms_per_traj: float  # dataflow CPU per trajectory
    dataflow_ms_per_node_s: float  # dataflow CPU per node and second, whatever the rate
    server_us_per_msg: float  # nats-server CPU per message in or out
    msgs_per_traj: float  # server messages (in + out) per trajectory
    msgs_per_node_s: float  # server messages per node and second, whatever the rate
    rates: Mapping[str, tuple[float, float]]  # heartbeats, kv_reads, pulls, acks: (per task, per node and second)
    cluster_cpu_factor: float  # a cluster of 3's server CPU (all members) over one server's, for the same work
    election_stall_s: float  # training stalled when the member leading the streams is killed
    fanout_base_s: float  # bench_fanout: announcement → fetch under way
    hub_copy_s: float  # per copy of fanout_bytes the hub sends
    leaf_copy_s: float  # per copy a region's mirror sends (three mirrors sharing the machine)
    fanout_bytes: float
    fanout_cores: int  # cores of the machine the fan-out runs shared
    bytes_per_changed: float  # delta bytes per changed bf16 element at lr 1e-6
    changed_fraction: float  # elements one step at lr 1e-6 changes
    sources: Mapping[str, str] = field(default_factory=dict)

    def links(self) -> Links:
        """The fan-out's links as measured (loopback, every server on one machine)."""
        return Links(self.fanout_base_s, self.fanout_bytes / self.hub_copy_s, self.fanout_bytes / self.leaf_copy_s,
                     self.fanout_bytes / self.leaf_copy_s)

    def send_bps_per_core(self) -> float:
        """A server's send rate per core: the hub alone sending (the direct runs), over the machine's cores."""
        return self.fanout_bytes / self.hub_copy_s / self.fanout_cores

    def links_at(self, server_cores: int, nic_bps: float) -> Links:
        """Every sender a host of ``server_cores`` cores behind a ``nic_bps`` link: min(cores × rate per core, link)."""
        rate = min(server_cores * self.send_bps_per_core(), nic_bps)
        return Links(self.fanout_base_s, rate, rate, rate)

    def delta_bytes(self, params: float, changed_fraction: float | None = None) -> float:
        """A bf16 delta: parameters × changed fraction × bytes per changed element."""
        return params * (self.changed_fraction if changed_fraction is None else changed_fraction) * self.bytes_per_changed


# ------------------------------------------------------------------------------------------------ sizing
@dataclass(frozen=True)
class Tier:
    """One tier's load and what carries it at a stated headroom."""

    tier: str
    msgs_per_s: float  # what one unit of the tier handles
    egress_bytes_per_s: float  # versions sent, per unit
    cores: float  # messages × µs per message (× a member's share) + egress / send rate per core
    needs: int  # how many of ``unit``
    unit: str


def size_tiers(cal: Calibration, nodes: int, regions: int, run: Run, fan: FanOut, server_cores: int, nic_bps: float,
               headroom: float, step_s: float) -> list[Tier]:
    """Each tier's load at the simulated rate, and how many units keep it under ``headroom`` of its cores and link.

    Every node's plane traffic (pulls, acks, heartbeats, groups) passes its region's mirror and reaches the hub, where the
    streams are: msgs/s = msgs per trajectory × traj/s + msgs per node-second × nodes. Egress = bytes per version over
    the interval between versions; a pool that announced fewer than two versions in its window (its versions cannot
    reach the nodes in time) is read at one version per trainer step, ``step_s``.
    """
    interval = run.version_interval_s if math.isfinite(run.version_interval_s) else step_s
    msgs = cal.msgs_per_traj * run.traj_per_s + cal.msgs_per_node_s * nodes
    unit = f"{server_cores}-core server ({nic_bps * 8 / 1e9:g} Gbit/s) at {100 * headroom:.0f} %"

    def server(name: str, msgs: float, egress: float, share: float = 1.0, what: str = unit) -> Tier:
        cores = msgs * cal.server_us_per_msg / 1e6 * share + egress / cal.send_bps_per_core()
        need = max(cores / (server_cores * headroom), egress / (nic_bps * headroom))
        return Tier(name, msgs, egress, cores, max(1, math.ceil(need)), what)

    df_cores = (run.traj_per_s * cal.dataflow_ms_per_traj + nodes * cal.dataflow_ms_per_node_s) / 1000
    tiers = [server("hub: one server", msgs, fan.hub_bytes / interval),
             server("hub: each member of a cluster of 3", msgs, fan.hub_bytes / interval, cal.cluster_cpu_factor / 3,
                    f"cluster of 3 × {unit}")]
    if regions:
        tiers.append(server(f"region mirror (each of {regions})", msgs / regions, fan.leaf_bytes / interval))
    if fan.depth > 1:  # a node passing the version on: its link's share
        relay = fan.leaf_bytes / interval
        busy = f"node (its link {100 * relay / nic_bps:.1f} % busy)"
        tiers.append(Tier("relay node", 0.0, relay, relay / cal.send_bps_per_core(), 1, busy))
    tiers.append(Tier("dataflow", 0.0, 0.0, df_cores, max(1, math.ceil(df_cores / headroom)),
                      f"shard (one event loop: one core) at {100 * headroom:.0f} %"))
    return tiers
