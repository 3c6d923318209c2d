"""``astraflow up``: an embedded server (or ``--nats``), one process per role, live progress, summary.

Every role is its own process (``astraflow worker ROLE``) that meets the others only on the
plane. The launcher watches the plane like any operator would — heartbeats, weight
announcements, run-state KV — and writes the run directory: the resolved recipe, a log per
process, ``metrics.jsonl``, ``summary.json`` and the reward-curve PNG.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from astraflow.config import Recipe, dump_recipe
from astraflow.streams.codec import decode
from astraflow.streams.messages import Heartbeat, WeightVersion
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer, spawn_kwargs

console = Console()


@dataclass
class Role:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    essential: bool = True  # a crash of an essential role aborts the run


@dataclass
class Watch:
    """What the launcher has seen on the plane."""

    versions: list[dict[str, Any]] = field(default_factory=list)
    evals: dict[int, float] = field(default_factory=dict)
    eval_at: dict[int, float] = field(default_factory=dict)  # seconds after launch when the version's eval landed
    beats: dict[str, Heartbeat] = field(default_factory=dict)


def spawn(run_dir: Path, recipe_file: Path, opts: NatsOptions, run: str, role: str, name: str, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    log = open(run_dir / "logs" / f"{name}.log", "ab")
    cmd = [sys.executable, "-m", "astraflow.cli", "worker", role, "--recipe", str(recipe_file), "--nats", opts.url,
           "--run", run, "--id", name, *(extra or [])]
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **spawn_kwargs())  # type: ignore[arg-type]
    finally:
        log.close()


def stop_all(roles: list[Role], timeout: float = 20.0) -> None:
    """SIGTERM (nodes finish or nak what they hold), then SIGKILL what is still there."""
    for r in roles:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in roles:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


class LocalPool:
    """``up --autoscale``: start and retire local rollout workers toward the dataflow's advised target.

    At most one change per ``cooldown_s`` (the advice itself has a dead band). Retiring sends
    SIGTERM to the newest node: it finishes the tasks it holds and leaves.
    """

    def __init__(self, roles: list[Role], start: Callable[[str], Role], cooldown_s: float = 10.0, max_nodes: int = 64) -> None:
        self.roles = roles
        self.start = start
        self.cooldown_s = cooldown_s
        self.max_nodes = max_nodes
        self.retiring: set[str] = set()
        self.last = -float("inf")
        self.started = 0

    def live(self) -> list[Role]:
        return [r for r in self.roles if r.role == "rollout" and r.proc.poll() is None and r.name not in self.retiring]

    def act(self, target: int, now: float) -> str | None:
        """Move one node toward ``target``; returns what it did (None: nothing)."""
        live = self.live()
        target = max(0, min(target, self.max_nodes))
        if target == len(live) or now - self.last < self.cooldown_s:
            return None
        self.last = now
        if target > len(live):
            names = {r.name for r in self.roles}
            i = next(i for i in range(len(names) + 1) if f"rollout-{i}" not in names)
            self.roles.append(self.start(f"rollout-{i}"))
            self.started += 1
            return f"started rollout-{i} ({len(live) + 1}/{target})"
        newest = live[-1]
        newest.proc.send_signal(signal.SIGTERM)
        self.retiring.add(newest.name)
        return f"retiring {newest.name} ({len(live) - 1}/{target})"


def dashboard(recipe: Recipe, watch: Watch, lags: dict[str, int]) -> Table:
    t = Table(title=f"AstraFlow · {recipe.name}", expand=False)
    for col in ("worker", "role", "version", "stats"):
        t.add_column(col)
    for wid, hb in sorted(watch.beats.items()):
        keys = ("tasks", "trajectories", "issued", "in_flight", "buffered", "batches", "reward_mean", "wait_frac", "loss")
        stats = " ".join(f"{k}={hb.stats[k]:.3g}" for k in keys if k in hb.stats)
        t.add_row(wid, hb.role, str(hb.version), stats)
    lag_txt = " ".join(f"{k}={v}" for k, v in lags.items())
    evals = " ".join(f"v{v}={r:.2f}" for v, r in sorted(watch.evals.items()))
    t.caption = f"lag: {lag_txt}   held-out reward: {evals or '—'}"
    return t


async def monitor(recipe: Recipe, opts: NatsOptions, run: str, run_dir: Path, roles: list[Role], timeout: float,
                  scaler: LocalPool | None = None) -> Watch:
    plane = await Plane.connect(opts, run, "launcher")
    await plane.ensure_topology(recipe.topology())
    watch = Watch()
    steps = {p: c.trainer.steps for p, c in recipe.policies.items()}
    epol = recipe.eval_policy
    from astraflow.rollout.evaluator import eval_versions  # lazy: pulls in the model stack

    wanted_evals = set(eval_versions(recipe)) if recipe.eval.enabled else set()

    async def on_beat(msg: Any) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
            watch.beats[hb.worker_id] = hb
        except ValueError:
            pass

    await plane.nc.subscribe(f"af.{run}.hb.>", cb=on_beat)
    from nats.js import api  # the launcher reads announcements like any watcher

    ann_sub = await plane.js.pull_subscribe(plane.names.all("weights"), stream=plane.names.weights_stream,
                                            config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL))
    metrics_file = open(run_dir / "metrics.jsonl", "w")  # rebuilt from the announcements (all of them on --resume)
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)
    bars = {p: progress.add_task(f"{p} versions", total=n) for p, n in steps.items()}
    lags: dict[str, int] = {}
    started = time.monotonic()
    live = Live(console=console, refresh_per_second=2, transient=False) if console.is_terminal else None
    last_print = 0.0
    try:
        if live:
            live.start()
        while True:
            try:
                for m in await ann_sub.fetch(batch=64, timeout=0.5):
                    ann = decode(m.data, WeightVersion)
                    row = {"policy": ann.policy, "version": ann.version, "encoding": ann.encoding, "bytes": ann.objects[0].size, "ts": ann.created_at, **ann.metrics}
                    watch.versions.append(row)
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                    progress.update(bars[ann.policy], completed=ann.version)
            except Exception:  # fetch timeout: nothing new
                pass
            for v in wanted_evals - set(watch.evals):
                got = await plane.state_get(f"eval.{epol}.{v}")
                if got is not None:
                    watch.evals[v] = got["reward"]
                    watch.eval_at[v] = round(time.monotonic() - started, 1)
            names = plane.names
            for label, stream, durable in (("task", names.task_stream, names.pool_consumer(recipe.rollout.pool)),
                                           ("traj", names.traj_stream, names.DATAFLOW_CONSUMER),
                                           *((f"batch.{p}", names.batch_stream, names.trainer_consumer(p)) for p in steps)):
                lag = await plane.lag(stream, durable)
                lags[label] = lag.pending + lag.ack_pending
            if live:
                from rich.console import Group

                live.update(Group(progress, dashboard(recipe, watch, lags)))
            elif time.monotonic() - last_print > 5:
                last_print = time.monotonic()
                last = {r["policy"]: r for r in watch.versions}
                vs = " ".join(f"{p} v{last[p]['version'] if p in last else 0}/{n} reward={last.get(p, {}).get('reward_mean', float('nan')):.3f}" for p, n in steps.items())
                console.print(f"[{time.monotonic() - started:6.1f}s] {vs} lag={lags} held-out={watch.evals}")
            if scaler is not None:
                advice = await plane.state_get(f"autoscale.{recipe.rollout.pool}")
                if advice and time.time() - advice["ts"] < 30:
                    did = scaler.act(int(advice["target"]), time.monotonic())
                    if did:
                        console.print(f"[bold]autoscale[/]: {did} — {advice['reason']}")
            done = all([int(await plane.state_get(f"done.{p}", -1)) >= n for p, n in steps.items()])
            if done and wanted_evals <= set(watch.evals):
                return watch
            for r in roles:
                if r.essential and r.proc.poll() is not None and not (r.role == "trainer" and r.proc.returncode == 0):
                    raise RuntimeError(f"{r.name} exited with {r.proc.returncode}; see {run_dir / 'logs' / (r.name + '.log')}")
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"run did not finish in {timeout:.0f}s")
    finally:
        if live:
            live.stop()
        metrics_file.close()
        await plane.close()


def summarize(recipe: Recipe, run_dir: Path, watch: Watch, wall_s: float) -> dict[str, Any]:
    evals = dict(sorted(watch.evals.items()))
    per_policy = {}
    for p, cfg in recipe.policies.items():
        rows = [r for r in watch.versions if r["policy"] == p]
        deltas = [r["bytes"] for r in rows if r["encoding"] == "delta"]
        per_policy[p] = {
            "steps": cfg.trainer.steps,
            "train_reward_last5": sum(r.get("reward_mean", 0) for r in rows[-5:]) / max(1, len(rows[-5:])),
            "keyframe_bytes": max((r["bytes"] for r in rows if r["encoding"] == "keyframe"), default=0),
            "delta_bytes_mean": sum(deltas) / max(1, len(deltas)),
        }
    summary = {
        "recipe": recipe.name, "wall_s": round(wall_s, 1), "eval_policy": recipe.eval_policy,
        "held_out_reward": {str(k): v for k, v in evals.items()},
        "initial_reward": evals.get(0), "final_reward": evals.get(recipe.policies[recipe.eval_policy].trainer.steps),
        "eval_at_s": {str(k): v for k, v in sorted(watch.eval_at.items())},
        "policies": per_policy,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot(watch, run_dir / "reward.png", recipe.name)
    t = Table(title=f"{recipe.name}: summary")
    t.add_column("metric")
    t.add_column("value")
    for k, v in summary.items():
        t.add_row(k, json.dumps(v) if not isinstance(v, float) else f"{v:.3f}")
    console.print(t)
    console.print(f"run directory: {run_dir}")
    return summary


def plot(watch: Watch, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in dict.fromkeys(r["policy"] for r in watch.versions):
        rows = [r for r in watch.versions if r["policy"] == p and "reward_mean" in r]
        ax.plot([r["version"] for r in rows], [r["reward_mean"] for r in rows], label=f"{p}: train reward (batch mean)", alpha=0.7)
    if watch.evals:
        ev = sorted(watch.evals.items())
        ax.plot([v for v, _ in ev], [r for _, r in ev], "o-", label="held-out reward (greedy)")
    ax.set_xlabel("policy version (optimizer steps)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def up(recipe: Recipe, run_dir: Path, nats_url: str | None = None, timeout: float = 3600.0, autoscale: bool = False,
       resume: bool = False) -> dict[str, Any]:
    """Run ``recipe`` in ``run_dir``. ``resume``: continue the run kept there (same run id, same
    JetStream store when embedded, trainers from their checkpoints, dataflow from its KV state)."""
    run = run_dir.name
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    recipe_file = run_dir / "recipe.yaml"
    if resume and not recipe_file.exists():
        raise FileNotFoundError(f"{run_dir} holds no recipe.yaml: not a run directory")
    dump_recipe(recipe, recipe_file)
    server = None if nats_url else EmbeddedServer(run_dir).start()
    opts = NatsOptions(url=nats_url or server.url)  # type: ignore[union-attr]
    console.print(f"[bold]AstraFlow[/] run [cyan]{run}[/] on {opts.url} ({'external' if nats_url else 'embedded'} nats-server)")
    roles: list[Role] = []
    started = time.monotonic()
    try:
        for p in recipe.policy_names:
            ckpt = run_dir / "checkpoints" / p  # exact resume: `astraflow up --resume RUN_DIR`
            roles.append(Role(f"trainer-{p}", "trainer", spawn(run_dir, recipe_file, opts, run, "trainer", f"trainer-{p}",
                                                                ["--policy", p, "--checkpoint-dir", str(ckpt)])))
        roles.append(Role("dataflow", "dataflow", spawn(run_dir, recipe_file, opts, run, "dataflow", "dataflow")))
        if recipe.eval.enabled:
            roles.append(Role("evaluator", "evaluator", spawn(run_dir, recipe_file, opts, run, "evaluator", "evaluator")))
        for i in range(recipe.rollout.nodes):
            name = f"rollout-{i}"
            roles.append(Role(name, "rollout", spawn(run_dir, recipe_file, opts, run, "rollout", name), essential=False))
        scaler = None
        if autoscale:  # start and retire local rollout workers toward the dataflow's advice
            a = recipe.dataflow.autoscale
            scaler = LocalPool(roles, lambda name: Role(name, "rollout", spawn(run_dir, recipe_file, opts, run, "rollout", name), essential=False),
                               max_nodes=a.max_nodes)
        watch = asyncio.run(monitor(recipe, opts, run, run_dir, roles, timeout, scaler))
    finally:
        stop_all(roles)
        if server:
            server.stop()
    return summarize(recipe, run_dir, watch, time.monotonic() - started)


def new_run_dir(recipe: Recipe, base: Path = Path("runs")) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return base / f"{recipe.name}-{stamp}-{os.getpid() % 10000}"
