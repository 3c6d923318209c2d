"""Async (dataflow) vs synchronous (trainer-centred) mode, side by side in one run.

The workload (pinned; the same nodes and trainers in both modes, only ``dataflow.mode`` differs):

- solver + verifier (``solver_verifier`` workflow): the solver answers a prompt 8 times, the
  verifier judges each answer; each policy has its own trainer (a real torch trainer on the
  tiny Qwen2 of the CPU recipe) and gets groups of 8 in batches of 8 groups;
- 4 rollout nodes (``astraflow worker rollout``) with the ``scripted`` engine: real tokens from
  the policy's tiny model, then a per-request latency drawn from a lognormal with median
  0.5 s and sigma 1.0 (a long tail: p99 ≈ 5 s), 8 requests in flight per node; each node works
  on up to 8 tasks at once (``rollout.tasks_per_generate`` generation slots), admitting one whenever one finishes;
- a real nats-server, the real dataflow, an evaluator (held-out accuracy of the solver, greedy, or avg@k with ``eval.k`` > 1,
  at v0 and at the last version, on its own ``hf`` engine so it adds no scripted latency).

``async``: tasks flow within the staleness budget (max_staleness 6, at most 40 tasks in
flight) while the trainers train. ``sync``: one batch of 8 tasks per version, all of it back
and trained before the next is released (tasks demand the current version: on-policy).

Figures, per mode, over versions 1 → N of each policy (the same number of samples trained):
wall time per training step, trainer idle fraction (the trainer's own measured batch wait
over that span), held-out accuracy at v0 and vN, and what the dataflow did (tasks issued,
groups dropped as stale), for each of ``--repeats`` runs of both modes (alternating) and async's
speed-up per repeat. Run: ``python benchmarks/bench_async_vs_sync.py [--steps 40] [--repeats 3]``.
Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from astraflow.streams.dataflow_state import DataflowState
from astraflow.streams.messages import Heartbeat, TrainerStats, WeightVersion
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.state import DoneRecord, EvalRecord, StateReadError

NODES, CONCURRENCY, GROUP, GROUPS_PER_BATCH, TASKS_PER_PULL = 4, 8, 8, 8, 8
EVAL_EVERY = 5
POLICIES = ("solver", "verifier")


def recipe(mode: str, steps: int) -> dict[str, Any]:
    return {
        "name": f"bench-{mode}",
        "policies": {"solver": {"sft": {"steps": 250}}, "verifier": {"sft": {"steps": 0}}},
        "workflow": "solver_verifier", "reward": "arithmetic",
        "model": {"hidden_size": 64, "intermediate_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
        "data": {"type": "arithmetic", "max_operand": 19, "n_train": 300, "n_eval": 100},
        "sft": {"steps": 250, "lr": 0.003},
        "trainer": {"steps": steps, "lr": 0.0003, "keyframe_every": 10},
        "rollout": {"nodes": NODES, "tasks_per_generate": TASKS_PER_PULL, "max_new_tokens": 4, "temperature": 1.0,
                    "engine": {"type": "scripted", "latency": "lognormal", "latency_median_s": 0.5, "latency_sigma": 1.0,
                               "concurrency": CONCURRENCY}},
        "dataflow": {"mode": mode, "group_size": GROUP, "groups_per_batch": GROUPS_PER_BATCH, "max_tasks_in_flight": 40,
                     "max_staleness": 6, "max_batch_backlog": 2},
        "eval": {"every": EVAL_EVERY, "policy": "solver"},
    }


class Roles:
    """Every role its own ``astraflow worker`` process, as ``astraflow up`` runs them."""

    def __init__(self, url: str, run: str, recipe_file: Path, logs: Path) -> None:
        self.url, self.run, self.recipe_file, self.logs = url, run, recipe_file, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, role: str, name: str, *extra: str) -> None:
        self.spawn(name, [sys.executable, "-m", "astraflow.cli", "worker", role, "--recipe", str(self.recipe_file), "--nats",
                          self.url, "--run", self.run, "--id", name, *extra])

    def spawn(self, name: str, cmd: list[str]) -> None:
        """Any process of the run, logged to ``{name}.log`` beside the roles'."""
        with open(self.logs / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{name} exited with {p.returncode}: {(self.logs / (name + '.log')).read_text()[-3000:]}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def announcements(plane: Plane, policy: str, n: int) -> list[WeightVersion]:
    anns = await plane.history(plane.names.weights(policy), WeightVersion)
    assert len(anns) >= n, f"{policy}: {len(anns)} announcements, expected {n}"
    return sorted(anns, key=lambda a: a.version)


def interpolate(series: list[tuple[float, float]], t: float) -> float:
    """A cumulative counter's value at ``t``, linear between the heartbeats around it."""
    before = [p for p in series if p[0] <= t] or series[:1]
    after = [p for p in series if p[0] >= t] or series[-1:]
    (t0, v0), (t1, v1) = before[-1], after[0]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def step_figures(anns: list[WeightVersion], waits: list[tuple[float, float]]) -> dict[str, float]:
    """Over versions 1 -> N: seconds per step, and the trainer's idle share of that span.

    Idle = growth of the trainer's own cumulative ``wait_s`` (time blocked pulling a batch, from
    its heartbeats) over the span; ``compute_frac`` = its optimizer steps' own time (``step_s``)
    over the span, as a cross-check (the rest is weight publication and bookkeeping).
    """
    first, last = anns[1], anns[-1]
    span = last.created_at - first.created_at
    idle = (interpolate(waits, last.created_at) - interpolate(waits, first.created_at)) / span if len(waits) > 1 else float("nan")
    compute = sum(a.metrics.get("step_s", 0.0) for a in anns[2:]) / span
    return {"s_per_step": span / (last.version - first.version), "idle_frac": idle, "compute_frac": compute, "span_s": span,
            "v0_to_vN_s": last.created_at - anns[0].created_at}


async def run_mode(url: str, mode: str, steps: int, workdir: Path, timeout: float, repeat: int = 0) -> dict[str, Any]:
    run = f"bench{mode}{repeat}x{os.getpid() % 10000}"
    folder = workdir / f"{mode}-{repeat}"
    folder.mkdir(parents=True)
    recipe_file = folder / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe(mode, steps)))
    logs = folder / "logs"
    logs.mkdir()
    roles = Roles(url, run, recipe_file, logs)
    plane = await Plane.connect(NatsOptions(url=url), run, "bench")
    waits: dict[str, list[tuple[float, float]]] = {p: [] for p in POLICIES}

    def on_beat(hb: Heartbeat) -> None:
        if hb.policy in waits and isinstance(hb.stats, TrainerStats):
            waits[hb.policy].append((hb.ts, hb.stats.wait_s))

    await plane.on_heartbeats(on_beat)
    t0 = time.monotonic()
    try:
        for p in POLICIES:
            roles.start("trainer", f"trainer-{p}", "--policy", p)
        roles.start("dataflow", "dataflow")
        roles.start("evaluator", "evaluator", "--set", "rollout.engine=hf")
        for i in range(NODES):
            roles.start("rollout", f"rollout-{i}")
        while True:
            roles.check()
            await asyncio.sleep(1.0)
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{mode}: not done after {timeout:.0f}s")
            try:
                done = [(d.version if (d := await plane.state.get(DoneRecord, p)) else -1) for p in POLICIES]
                evaluated = await plane.state.get(EvalRecord, "solver", steps)
            except StateReadError:  # the run's state bucket is not made yet (the roles are still starting)
                continue
            if min(done) >= steps and evaluated is not None:
                break
        await asyncio.sleep(2.5)  # one more heartbeat from each trainer, past its last version
        figures = {p: step_figures(await announcements(plane, p, steps + 1), waits[p]) for p in POLICIES}
        state = await plane.state.get(DataflowState) or DataflowState()
        acc = state.accounting
        records = {v: await plane.state.get(EvalRecord, "solver", v) for v in sorted({0, steps, *range(EVAL_EVERY, steps, EVAL_EVERY)})}
        evals = {v: (r.avg_at_k if r.k > 1 else r.reward) for v, r in records.items() if r is not None}  # avg@k with eval.k > 1
    finally:
        roles.stop()
        await plane.close()
    history = state.lanes["solver"].history[:steps] if "solver" in state.lanes else []
    return {
        "mode": mode,
        **{f"{p}_{k}": round(v, 3) for p, f in figures.items() for k, v in f.items()},
        "held_out": evals,
        "held_out_v0": evals[0],
        "held_out_final": evals[steps],
        "lag_mean": round(sum(h[4] for h in history) / max(1, len(history)), 2),
        "lag_max": max((h[3] for h in history), default=0),
        "tasks_issued": acc["solver"].total if "solver" in acc else None,
        "dropped_stale": acc["solver"].fates.get("dropped:stale", 0) if "solver" in acc else 0,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def table(rows: list[dict[str, Any]], steps: int) -> Table:
    t = Table(title=f"async vs sync · solver+verifier, {NODES} nodes x {CONCURRENCY} concurrent, lognormal(median 0.5 s, sigma 1.0), "
                    f"groups of {GROUP}, {GROUPS_PER_BATCH} groups/batch/policy, {steps} steps")
    for c in ("repeat", "mode", "s/step solver", "s/step verifier", "trainer idle solver", "trainer idle verifier", "held-out v0 → vN",
              "lag mean/max", "tasks issued", "dropped stale", "speed-up"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["repeat"]), r["mode"], f"{r['solver_s_per_step']:.2f}", f"{r['verifier_s_per_step']:.2f}",
                  f"{r['solver_idle_frac']:.0%}", f"{r['verifier_idle_frac']:.0%}", f"{r['held_out_v0']:.2f} → {r['held_out_final']:.2f}",
                  f"{r['lag_mean']:.1f}/{r['lag_max']}", str(r["tasks_issued"]), str(r["dropped_stale"]),
                  f"{r['speedup']:.2f}x" if "speedup" in r else "")
    return t


async def main(steps: int, timeout: float, modes: list[str], keep: Path | None, repeats: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(keep or Path(d)) as server:
        for k in range(repeats):  # the modes alternate, so drifting machine load falls on both
            pair = [await run_mode(server.url, mode, steps, keep or Path(d), timeout, k) for mode in modes]
            for r in pair:
                r["repeat"] = k + 1
            if len(pair) == 2:  # async over sync: sync's seconds per step over async's
                pair[0]["speedup"] = round(pair[1]["solver_s_per_step"] / pair[0]["solver_s_per_step"], 2)
            rows += pair
            print(json.dumps({"repeat": k + 1, "rows": pair}), file=sys.stderr, flush=True)  # kept if a later repeat fails
    console = Console(width=170)
    console.print(table(rows, steps))
    for r in rows:
        console.print(f"#{r['repeat']} {r['mode']:>5} held-out accuracy (solver) by version: "
                      + " ".join(f"v{v} {a:.2f}" for v, a in r["held_out"].items()))
    speedups = [r["speedup"] for r in rows if "speedup" in r]
    return {"steps": steps, "repeats": repeats, "speedups_per_step": speedups, "rows": rows,
            "workload": {"nodes": NODES, "concurrency": CONCURRENCY, "latency": "lognormal", "median_s": 0.5, "sigma": 1.0,
                         "group_size": GROUP, "groups_per_batch": GROUPS_PER_BATCH, "node_slots": TASKS_PER_PULL}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=1500.0, help="per mode")
    ap.add_argument("--modes", default="async,sync", help="comma-separated; both for the side-by-side figure")
    ap.add_argument("--keep", type=Path, default=None, help="keep logs and recipes in this folder")
    ap.add_argument("--repeats", type=int, default=3, help="runs of every mode, each reported (async over sync per repeat)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.steps, args.timeout, args.modes.split(","), args.keep, args.repeats))))
