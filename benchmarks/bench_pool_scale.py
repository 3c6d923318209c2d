"""Many rollout nodes, real processes, one machine: the plane's load and the first bottleneck as the pool grows.

Each point runs, on a real nats-server (``single``) or a 3-server cluster with every stream replicated (``cluster3``):

* the real dataflow and a real trainer (``astraflow worker dataflow`` / ``worker trainer``, the recipe's tiny model, so a
  step takes milliseconds), each its own process;
* N rollout nodes (``RolloutNode``, the real worker loop, each with its own connection, heartbeats, weights and
  ``scripted`` engine) spread over a few host processes. The engine gives each request real tokens from the tiny
  model, then holds it for a lognormal latency (median 2 s, sigma 1: a long tail), as a model server would;
* a counter on the driver's own connection that sees every JetStream API request and ack, and every heartbeat.

Once every node has joined and the pool has warmed up, a window of ``--window`` seconds measures:

* trajectories per second (the trajectory stream's sequence) against what the pool offers (slots × group / mean task
  time, measured at the smallest point, where nothing else limits);
* CPU per trajectory and cores used, for the dataflow, the server(s), the node hosts and the trainer (``/proc``);
* the server's resident memory, messages in/out (``/varz``), and the plane's load: heartbeats, run-state (KV) reads,
  task pulls and acks per second;
* task latency p50/p99, from the task's issue (``Task.created_at``) to its trajectories published and the task acked;
* the first bottleneck: the dataflow is one process and one event loop, so it saturates at one core; the machine
  saturates when all cores are busy.

All of it shares this machine's cores: the node hosts' own Python work competes with the dataflow and the server, so the
CPU per trajectory of each part, not the machine's ceiling, is what carries to a real pool
(``benchmarks/pool_model.py`` extrapolates from it). Writes ``benchmarks/results/pool_scale.json``.

    python benchmarks/bench_pool_scale.py [--nodes 32 64 128 256 512] [--topology single cluster3] [--window 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import nats
import yaml
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_async_vs_sync import Roles  # noqa: E402
from proc_stats import cpu_s  # noqa: E402
from result_files import write  # noqa: E402

from astraflow.config import load_recipe  # noqa: E402
from astraflow.streams.server import EmbeddedServer, cluster_members, free_port  # noqa: E402
from astraflow.streams.subjects import Names  # noqa: E402

SLOTS, GROUP, BATCH, MEDIAN_S, SIGMA, NEW_TOKENS = 4, 8, 32, 2.0, 1.0, 4


def recipe(nodes: int, replicas: int) -> dict[str, Any]:
    return {
        "name": "pool-scale", "workflow": "single_turn", "reward": "arithmetic",
        "model": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "data": {"type": "arithmetic", "max_operand": 19, "n_train": 300, "n_eval": 20},
        "sft": {"steps": 0}, "eval": {"enabled": False},
        "trainer": {"steps": 1_000_000, "threads": 1, "checkpoint_every": 32},
        "rollout": {"tasks_per_generate": SLOTS, "max_new_tokens": NEW_TOKENS, "drain_timeout": 0.0,
                    "engine": {"type": "scripted", "latency": "lognormal", "latency_median_s": MEDIAN_S, "latency_sigma": SIGMA,
                               "concurrency": SLOTS * GROUP}},
        "dataflow": {"group_size": GROUP, "groups_per_batch": BATCH, "max_tasks_in_flight": nodes * SLOTS + 2 * BATCH,
                     "max_staleness": 1000, "max_batch_backlog": 4},
        "plane": {"replicas": replicas},
    }


# ------------------------------------------------------------------ node hosts (child processes)

def seeded(r: Any, i: int) -> Any:
    """The recipe with node ``i``'s own latency seed: the engine seeds with the process id too, and a host runs many."""
    engine = r.rollout.engine.model_copy(update={"latency_seed": i})
    return r.model_copy(update={"rollout": r.rollout.model_copy(update={"engine": engine})})


def host_main(url: str, run: str, recipe_file: str, first: int, count: int, out: str) -> None:
    """``count`` rollout nodes in this process, one connection each; on SIGTERM, write each task's latency and exit."""
    import torch

    from astraflow.rollout.node import RolloutNode
    from astraflow.runtime import Stop
    from astraflow.streams.plane import NatsOptions, Plane

    torch.set_num_threads(1)
    r = load_recipe(recipe_file)
    done: list[tuple[float, float, float]] = []  # (when settled, seconds from the task's issue, seconds from its pull)

    class TimedNode(RolloutNode):
        async def serve_task(self, d: Any, slots: Any, stop: asyncio.Event, max_deliver: int) -> None:
            pulled = time.time()
            await super().serve_task(d, slots, stop, max_deliver)
            now = time.time()
            done.append((now, now - d.msg.created_at, now - pulled))

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        nodes = [TimedNode(seeded(r, i), await Plane.connect(NatsOptions(url=url), run, f"n{i}"), f"n{i}")
                 for i in range(first, first + count)]
        runs = [asyncio.create_task(n.run(Stop())) for n in nodes]
        while not all(n.stats["joined"] for n in nodes):
            if any(t.done() for t in runs):
                raise RuntimeError(f"a node ended before joining: {next(t for t in runs if t.done()).exception()}")
            await asyncio.sleep(0.2)
        Path(out + ".ready").touch()
        await stop.wait()
        Path(out).write_text(json.dumps({"done": done, "stats": [n.stats for n in nodes]}))
        os._exit(0)  # the nodes' threads sleep in the scripted engine: nothing of theirs is worth waiting for

    asyncio.run(main())


# ------------------------------------------------------------------ the driver

def rss_mib(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def varz(port: int) -> dict[str, Any]:
    """The server's monitoring figures (a loaded machine may take a while to answer)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=60) as f:
        return dict(json.loads(f.read()))


class PlaneCounter:
    """Every JetStream API request, ack and heartbeat of the run, counted by kind (core NATS delivers a copy to this
    subscriber as well as to the server's own)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.last_beat: dict[str, float] = {}  # subject (role and worker) -> when its last heartbeat came
        self.beat_gap_max = 0.0  # the longest silence of a worker between two heartbeats (a worker silent 3 beats is gone)

    async def attach(self, nc: Any, run: str) -> None:
        async def api(msg: Any) -> None:
            s = msg.subject
            kind = ("pulls" if ".CONSUMER.MSG.NEXT." in s else
                    "kv_reads" if (".DIRECT.GET.KV_" in s or ".STREAM.MSG.GET.KV_" in s) else "other_api")
            self.counts[kind] += 1

        async def ack(_: Any) -> None:
            self.counts["acks"] += 1

        async def beat(msg: Any) -> None:
            self.counts["heartbeats"] += 1
            now = time.monotonic()
            if (last := self.last_beat.get(msg.subject)) is not None:
                self.beat_gap_max = max(self.beat_gap_max, now - last)
            self.last_beat[msg.subject] = now

        await nc.subscribe("$JS.API.>", cb=api)
        await nc.subscribe("$JS.ACK.>", cb=ack)
        await nc.subscribe(f"af.{run}.hb.>", cb=beat)


class Point:
    """One pool size on one topology: its servers, and the processes of the run (``roles``: the dataflow, the trainer and
    the node hosts, as ``bench_async_vs_sync.Roles`` runs them), started and stopped by handle."""

    def __init__(self, work: Path, topology: str, nodes: int, hosts: int) -> None:
        self.work, self.topology, self.nodes = work, topology, nodes
        self.run = "ps" + uuid.uuid4().hex[:8]
        self.hosts = max(1, min(hosts, nodes))
        self.servers: list[EmbeddedServer] = []
        self.monitor: list[int] = []
        self.roles: Roles | None = None

    def start(self, recipe_file: Path) -> Roles:
        """The servers, then the run's processes' handle (none started yet) on their address."""
        size = 3 if self.topology == "cluster3" else 1
        self.monitor = [free_port() for _ in range(size)]
        if size == 1:
            self.servers = [EmbeddedServer(self.work / "nats", f"http: 127.0.0.1:{self.monitor[0]}\n")]
        else:
            self.servers = cluster_members(self.work / "cluster", size, "", [(free_port(), free_port()) for _ in range(size)])
            for s, port in zip(self.servers, self.monitor, strict=True):
                s.extra_config = f"http: 127.0.0.1:{port}\n"
        for s in self.servers:
            s.start()
        self.roles = Roles(",".join(s.url for s in self.servers), self.run, recipe_file, self.work)
        return self.roles

    def stop(self) -> None:
        if self.roles is not None:
            self.roles.stop()
        for s in self.servers:
            s.stop()

    def cpu(self) -> dict[str, float]:
        assert self.roles is not None
        procs = self.roles.procs
        parts = {"dataflow": cpu_s(procs["dataflow"].pid), "trainer": cpu_s(procs["trainer-solver"].pid),
                 "nodes": sum(cpu_s(p.pid) for n, p in procs.items() if n.startswith("host")),
                 "server": sum(cpu_s(s.proc.pid) for s in self.servers if s.proc)}
        return {**parts, "driver": sum(os.times()[:2])}

    def msgs(self) -> tuple[int, int]:
        vs = [varz(port) for port in self.monitor]
        return sum(v["in_msgs"] for v in vs), sum(v["out_msgs"] for v in vs)


async def groups_stored(js: Any, names: Names) -> int:
    """Messages ever stored in the TRAJ stream: a task's group of trajectories travels as one message."""
    return int((await js.stream_info(names.traj_stream)).state.last_seq)


def quantiles(xs: list[float]) -> dict[str, float | None]:
    xs = sorted(xs)
    return {"p50": round(statistics.median(xs), 2) if xs else None, "p99": round(xs[int(0.99 * (len(xs) - 1))], 2) if xs else None}


async def measure(work: Path, topology: str, nodes: int, hosts: int, window: float, warmup: float,
                  console: Console) -> dict[str, Any]:
    pt = Point(work, topology, nodes, hosts)
    work.mkdir(parents=True)
    recipe_file = work / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe(nodes, 3 if topology == "cluster3" else 1)))
    try:
        roles = pt.start(recipe_file)
        roles.start("trainer", "trainer-solver", "--policy", "solver", "--checkpoint-dir", str(work / "ckpt"))
        roles.start("dataflow", "dataflow")
        share = [nodes // pt.hosts + (i < nodes % pt.hosts) for i in range(pt.hosts)]
        for i, count in enumerate(share):
            roles.spawn(f"host{i}", [sys.executable, __file__, "--host", roles.url, pt.run, str(recipe_file), str(sum(share[:i])),
                                     str(count), str(work / f"host{i}.json")])
        t0 = time.monotonic()
        while not all((work / f"host{i}.json.ready").exists() for i in range(pt.hosts)):
            roles.check()
            if time.monotonic() - t0 > 120 + nodes:
                raise TimeoutError(f"{nodes} nodes not joined after {time.monotonic() - t0:.0f}s")
            await asyncio.sleep(0.5)
        joined_s = time.monotonic() - t0
        nc = await nats.connect(roles.url.split(","))
        js = nc.jetstream()
        names = Names(pt.run)
        counter = PlaneCounter()
        await counter.attach(nc, pt.run)
        await asyncio.sleep(warmup)
        roles.check()
        c0, m0, s0, n0, w0, t_start = pt.cpu(), pt.msgs(), await groups_stored(js, names), Counter(counter.counts), time.time(), \
            time.monotonic()
        counter.beat_gap_max = 0.0
        await asyncio.sleep(window)
        c1, m1, s1, n1, w1, span = pt.cpu(), pt.msgs(), await groups_stored(js, names), Counter(counter.counts), time.time(), \
            time.monotonic() - t_start
        roles.check()
        rss = sum(rss_mib(s.proc.pid) for s in pt.servers if s.proc)
        await nc.close()
    finally:
        host_procs = [p for name, p in (pt.roles.procs if pt.roles else {}).items() if name.startswith("host")]
        for p in host_procs:  # the hosts write their tasks' latencies on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in host_procs:
            try:
                p.wait(180)  # a host of hundreds of nodes on a starved machine takes a while to get to its file
            except subprocess.TimeoutExpired:
                p.kill()
        pt.stop()
    timed = [(issued, served) for i in range(pt.hosts) for at, issued, served in json.loads((work / f"host{i}.json").read_text())["done"]
             if w0 <= at <= w1]
    trajs = (s1 - s0) * GROUP
    per = {k: c1[k] - c0[k] for k in c0}
    cores = {k: v / span for k, v in per.items()}
    row: dict[str, Any] = {
        "topology": topology, "nodes": nodes, "host_processes": pt.hosts, "joined_s": round(joined_s, 1),
        "traj_per_s": round(trajs / span, 1), "tasks_per_s": round(trajs / GROUP / span, 2),
        "cpu_ms_per_traj": {k: round(1000 * v / max(trajs, 1), 3) for k, v in per.items()},
        "cores": {**{k: round(v, 2) for k, v in cores.items()}, "total": round(sum(cores.values()), 2)},
        "server_rss_mib": round(rss, 1),
        "rates": {"heartbeats_per_s": round((n1["heartbeats"] - n0["heartbeats"]) / span, 1),
                  "kv_reads_per_s": round((n1["kv_reads"] - n0["kv_reads"]) / span, 1),
                  "pulls_per_s": round((n1["pulls"] - n0["pulls"]) / span, 1),
                  "acks_per_s": round((n1["acks"] - n0["acks"]) / span, 1),
                  "js_api_per_s": round(sum(n1[k] - n0[k] for k in ("pulls", "kv_reads", "other_api")) / span, 1),
                  "server_msgs_in_per_s": round((m1[0] - m0[0]) / span, 1),
                  "server_msgs_out_per_s": round((m1[1] - m0[1]) / span, 1),
                  "heartbeat_gap_max_s": round(counter.beat_gap_max, 2)},
        "task_latency_s": quantiles([issued for issued, _ in timed]),  # from the dataflow's issue to settled
        "service_s": quantiles([served for _, served in timed]),  # from the node's pull to settled
        "service_mean_s": round(statistics.fmean(served for _, served in timed), 3) if timed else None,
        "tasks_timed": len(timed),
    }
    row["bottleneck"] = bottleneck(row)
    console.print(f"{topology} N={nodes}: {row['traj_per_s']} traj/s, cores {row['cores']}, p50/p99 "
                  f"{row['task_latency_s']['p50']}/{row['task_latency_s']['p99']} s · {row['bottleneck']}")
    return row


def bottleneck(row: dict[str, Any]) -> str:
    """What gives first: the dataflow's one event loop at a core, or the machine's cores all busy (then the part that
    takes most of them), or nothing (the pool's own latency bounds the rate)."""
    cores, machine = row["cores"], os.cpu_count() or 1
    if cores["dataflow"] >= 0.85:
        return f"dataflow at {cores['dataflow']:.2f} of its one core"
    if cores["total"] >= 0.85 * machine:
        top = max((k for k in cores if k != "total"), key=lambda k: cores[k])
        return f"machine's {machine} cores busy ({cores['total']:.2f}); most to {top} ({cores[top]:.2f})"
    return "none: the nodes' latency bounds the rate"


def table(rows: list[dict[str, Any]], offered: float) -> Table:
    t = Table(title=f"many nodes · scripted lognormal(median {MEDIAN_S} s, sigma {SIGMA}), {SLOTS} slots/node, groups of {GROUP}")
    for c in ("topology", "nodes", "traj/s", "offered", "ms CPU/traj df · srv · nodes · trainer", "cores df · srv · nodes · total",
              "server RSS MiB", "hb · kv · pulls · acks /s", "task p50 / p99 s", "served p50 / p99 s", "first bottleneck"):
        t.add_column(c)
    for r in rows:
        c, k, q = r["cpu_ms_per_traj"], r["cores"], r["rates"]
        t.add_row(r["topology"], str(r["nodes"]), f"{r['traj_per_s']:.0f}", f"{offered * r['nodes']:.0f}",
                  f"{c['dataflow']:.2f} · {c['server']:.2f} · {c['nodes']:.2f} · {c['trainer']:.2f}",
                  f"{k['dataflow']:.2f} · {k['server']:.2f} · {k['nodes']:.2f} · {k['total']:.2f}", f"{r['server_rss_mib']:.0f}",
                  f"{q['heartbeats_per_s']:.0f} · {q['kv_reads_per_s']:.0f} · {q['pulls_per_s']:.0f} · {q['acks_per_s']:.0f}",
                  f"{r['task_latency_s']['p50']} / {r['task_latency_s']['p99']}", f"{r['service_s']['p50']} / {r['service_s']['p99']}",
                  r["bottleneck"])
    return t


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Trajectories/s against what the pool offers, and each part's CPU per trajectory, against the node count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, cpu) = plt.subplots(1, 2, figsize=(11, 4))
    for topology, style in (("single", "-o"), ("cluster3", "--s")):
        pts = sorted((r for r in rows if r["topology"] == topology), key=lambda r: r["nodes"])
        if not pts:
            continue
        n = [r["nodes"] for r in pts]
        rate.plot(n, [r["traj_per_s"] for r in pts], style, label=f"measured ({topology})")
        for part, colour in (("dataflow", "C0"), ("server", "C1"), ("nodes", "C2"), ("trainer", "C3")):
            cpu.plot(n, [r["cpu_ms_per_traj"][part] for r in pts], style, color=colour, label=f"{part} ({topology})")
    offered = sorted({(r["nodes"], r["offered_traj_per_s"]) for r in rows})
    rate.plot([n for n, _ in offered], [o for _, o in offered], ":", color="grey", label="offered by the pool")
    for ax, title, unit in ((rate, "trajectories per second", "traj/s"), (cpu, "CPU per trajectory", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rollout nodes")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Many nodes on {os.cpu_count()} cores: the nodes' own work fills the machine first", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--host":
        url, run, recipe_file, first, count, out = sys.argv[2:8]
        host_main(url, run, recipe_file, int(first), int(count), out)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    ap.add_argument("--topology", choices=["single", "cluster3"], nargs="+", default=["single", "cluster3"])
    ap.add_argument("--hosts", type=int, default=4, help="processes the nodes are spread over")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured per point")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds after every node joined, before the window")
    ap.add_argument("--figure", type=Path, default=ROOT / "benchmarks" / "figures" / "pool-scale.png")
    args = ap.parse_args()
    console = Console()
    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="pool-scale-") as tmp:
        for topology in args.topology:
            for n in args.nodes:
                try:
                    rows.append(asyncio.run(measure(Path(tmp) / f"{topology}-{n}", topology, n, args.hosts, args.window, args.warmup,
                                                    console)))
                except Exception as e:  # recorded as what gave, and the sweep goes on
                    console.print(f"[red]{topology} N={n} failed: {type(e).__name__}: {e}[/]")
                    failed.append({"topology": topology, "nodes": n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    smallest = min(rows, key=lambda r: r["nodes"])
    offered = SLOTS * GROUP / smallest["service_mean_s"]  # per node: busy slots at the task time nothing else stretches
    for r in rows:
        r["offered_traj_per_s"] = round(offered * r["nodes"], 1)
    console.print(table(rows, offered))
    write("pool_scale", {"setup": {"latency": "lognormal", "latency_median_s": MEDIAN_S, "latency_sigma": SIGMA, "slots_per_node": SLOTS,
                                   "group_size": GROUP, "max_new_tokens": NEW_TOKENS, "host_processes": args.hosts,
                                   "cores": os.cpu_count(), "window_s": args.window},
                         "points": rows, "failed": failed})
    plot(rows, args.figure)  # after the record: its commit is the tree the run ran on
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
