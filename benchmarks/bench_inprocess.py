"""``astraflow up`` against the simplest single-process loop, from the same checkpoint, side by side in one run.

The workload is ``recipes/arithmetic/inprocess.yaml``: a+b with a, b in 10..99 (7,900 training / 200 held-out
problems), a 1.03M-parameter Qwen2, 8 prompts x 8 samples per step, PPO-clip with GRPO advantages, lr 1e-4.
Its SFT warm start is taken once and saved; both sides start from that checkpoint (``model.pretrained``,
``sft.steps=0``):

- in-process (``inprocess_loop.py``): generate, reward, advantages, optimizer step, repeat, in one process
  with ``--threads`` torch threads (default 1: on the shared 2-core development machine two threads in one
  process thrash, 20 SFT steps took 81.9 s with 2 against 11.6 s with 1 at load ~11); its clock stops while it
  evaluates;
- ``astraflow up`` as a subprocess with the recipe's defaults (one rollout node, ``trainer.threads: auto``), then
  again with each other node count of ``--nodes``, each stopped (SIGINT) ``--seconds`` after version 0 appeared;
  held-out accuracy and rollouts come from its run directory (``metrics.jsonl``, ``evals.jsonl``, ``pool.jsonl``),
  where its time went from the roles' heartbeats and their CPU seconds (``/proc``) over the same window.

Time is RL time: from version 0 (the checkpoint, evaluated) on. Held-out "at T" is the mean of the last three
evaluations of weights that existed by T (one evaluation of 200 prompts has a standard error of at most 0.035);
"at equal samples" the same at the fewest samples any side trained on. Output: a rich table, the plot
``benchmarks/figures/inprocess.png`` (held-out against RL time and against samples trained) and, as the last
stdout line, JSON. Run: ``python benchmarks/bench_inprocess.py [--seconds 600] [--nodes 1,2] [--quick]``.
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
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inprocess_loop import Curve, Point, run_inprocess, warm_start  # noqa: E402
from stats import at, binomial_se  # noqa: E402

import astraflow  # noqa: E402
from astraflow.config import load_recipe  # noqa: E402
from astraflow.streams.messages import Heartbeat, RolloutStats, TrainerStats  # noqa: E402
from astraflow.streams.plane import NatsOptions, Plane  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "arithmetic" / "inprocess.yaml"
FIGURE = ROOT / "benchmarks" / "figures" / "inprocess.png"
LAST_EVALS = 3  # held-out "at T": the mean of this many evaluations up to T
SMOOTH = 9  # the plot's lines: the mean of this many evaluations up to each (the dots: each evaluation)
console = Console(width=160)


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``root`` and each process under it, by role: the ``--id`` of a worker,
    ``nats-server``, or ``launcher`` for ``root`` itself."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        pid = int(entry.name)
        parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    out: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo += [p for p, pp in parent.items() if pp == pid]
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode() for a in argv]
        name = "launcher" if pid == root else words[words.index("--id") + 1] if "--id" in words else Path(words[0]).name
        out[name] = out.get(name, 0.0) + cpu.get(pid, 0.0)
    return out


def busy_shares(first: dict[str, Heartbeat], last: dict[str, Heartbeat]) -> dict[str, float]:
    """Per worker, over the window between its first and last heartbeat: the share of wall time a trainer waited
    for batches, and a rollout node generated, pulled tasks, published trajectories and refreshed weights."""
    out: dict[str, float] = {}
    for w, end in last.items():
        start = first.get(w)
        span = end.ts - start.ts if start is not None else 0.0
        if start is None or span <= 0:
            continue
        if isinstance(end.stats, TrainerStats) and isinstance(start.stats, TrainerStats):
            out[f"{w}.wait"] = (end.stats.wait_s - start.stats.wait_s) / span
        if isinstance(end.stats, RolloutStats) and isinstance(start.stats, RolloutStats):
            for k in ("gen_s", "pull_s", "publish_s", "refresh_s"):
                out[f"{w}.{k[:-2]}"] = (getattr(end.stats, k) - getattr(start.stats, k)) / span
    return out


async def watch_up(proc: subprocess.Popen[bytes], run_dir: Path, seconds: float, tick: Any) -> dict[str, Any]:
    """Wait for version 0, then watch ``seconds`` of RL: heartbeats and CPU seconds at both ends of the window."""
    deadline = time.monotonic() + 900
    while not rows(run_dir / "metrics.jsonl"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"astraflow up ended or stalled before version 0 (exit {proc.returncode}); see {run_dir}")
        await asyncio.sleep(0.5)
    started = time.monotonic()
    plane = await Plane.connect(NatsOptions.from_credential(str(run_dir / "credentials" / "admin.json")), run_dir.name, "bench")
    first: dict[str, Heartbeat] = {}
    last: dict[str, Heartbeat] = {}

    def on_beat(hb: Heartbeat) -> None:
        first.setdefault(hb.worker_id, hb)
        last[hb.worker_id] = hb

    await plane.on_heartbeats(on_beat)
    cpu0 = cpu_seconds(proc.pid)
    try:
        while (elapsed := time.monotonic() - started) < seconds:
            if proc.poll() is not None:
                raise RuntimeError(f"astraflow up exited with {proc.returncode} during the run; see {run_dir}")
            tick(elapsed)
            await asyncio.sleep(1.0)
        cpu1 = cpu_seconds(proc.pid)
    finally:
        await plane.close()
    window = time.monotonic() - started
    return {"cpu_share": {k: round((v - cpu0.get(k, 0.0)) / window, 3) for k, v in sorted(cpu1.items())},
            "busy": {k: round(v, 3) for k, v in sorted(busy_shares(first, last).items())}}


def run_up(checkpoint: Path, seconds: float, nodes: int, eval_every: int, steps: int, workdir: Path, tick: Any,
           extra: tuple[str, ...] = ()) -> Curve:
    """``astraflow up`` from ``checkpoint`` with ``nodes`` rollout nodes, stopped ``seconds`` after version 0; ``extra``:
    more recipe overrides (``rollout.threads=2``)."""
    run_dir = workdir / f"up-{nodes}n"
    sets = [f"model.pretrained={checkpoint}", "sft.steps=0", f"trainer.steps={steps}", f"rollout.nodes={nodes}",
            f"eval.every={eval_every}", *extra]
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(RECIPE), "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]
    # the roles run the astraflow this process imported (PYTHONPATH=TREE probes TREE): `python -m` would put the working
    # directory first on their path, and a checkout there would shadow the tree
    tree = Path(astraflow.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(workdir / f"up-{nodes}n.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env)
    try:
        seen = asyncio.run(watch_up(proc, run_dir, seconds, tick))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # up stops its roles and writes its summary
        try:
            proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return up_curve(run_dir, seconds, nodes, seen)


def up_curve(run_dir: Path, seconds: float, nodes: int, seen: dict[str, Any]) -> Curve:
    """The run directory's records over the RL window [version 0, version 0 + ``seconds``]."""
    versions = {r["version"]: r for r in rows(run_dir / "metrics.jsonl")}
    t0 = versions[0]["run_s"]
    flow = load_recipe(run_dir / "recipe.yaml").dataflow
    size = flow.group_size * flow.groups_per_batch  # samples trained per version
    inside = {v: r for v, r in versions.items() if r["run_s"] - t0 <= seconds}
    curve = Curve(f"astraflow up, {nodes} node{'s' if nodes > 1 else ''}", seconds=seconds)
    curve.trained = max(inside) * size
    pool = rows(run_dir / "pool.jsonl")
    ts, counts = [p["run_s"] for p in pool], [p["trajectories"] for p in pool]
    start, end = at(ts, counts, t0), at(ts, counts, t0 + seconds)
    curve.generated = int((end if end is not None else counts[-1]) - (start if start is not None else counts[0]))
    for e in rows(run_dir / "evals.jsonl"):
        if e["version"] in inside:
            curve.points.append(Point(e["version"], inside[e["version"]]["run_s"] - t0, e["version"] * size, e["reward"]))
    curve.points.sort(key=lambda p: p.version)
    steps = [r for v, r in inside.items() if v > 0]
    mean = lambda k: sum(r.get(k, 0.0) for r in steps) / max(1, len(steps))  # noqa: E731
    curve.notes = {"versions": max(inside), "s_per_step": seconds / max(1, max(inside)), "step_s": mean("step_s"),
                   "fetch_s": mean("fetch_s"), "v0_at_s": t0, **{f"cpu.{k}": v for k, v in seen["cpu_share"].items()},
                   **{f"busy.{k}": v for k, v in seen["busy"].items()}}
    return curve


def held_at(points: list[Point], x: float, key: str) -> float | None:
    """Mean held-out of the last ``LAST_EVALS`` evaluations whose ``key`` (seconds or samples) is at most ``x``."""
    upto = [p.held_out for p in points if getattr(p, key) <= x]
    return sum(upto[-LAST_EVALS:]) / len(upto[-LAST_EVALS:]) if upto else None


def held_over(points: list[Point], start: float, end: float) -> float | None:
    """Mean held-out of every evaluation taken after ``start`` seconds and up to ``end``: less noisy than a few at a
    point (each side evaluates every 20 versions, so a faster side averages more of them)."""
    inside = [p.held_out for p in points if start < p.seconds <= end]
    return sum(inside) / len(inside) if inside else None


def figures(curves: list[Curve], seconds: float) -> list[dict[str, Any]]:
    fewest = min(c.trained for c in curves)
    out = []
    for c in curves:
        fmt = {k: round(v, 4) if isinstance(v, float) else v for k, v in c.notes.items()}
        out.append({"side": c.name, "rl_s": round(c.seconds, 3), "generated": c.generated, "trained": c.trained,
                    "generated_per_s": round(c.generated / c.seconds, 1), "trained_per_s": round(c.trained / c.seconds, 1),
                    "held_out_v0": c.points[0].held_out, "held_out_at_half": held_at(c.points, seconds / 2, "seconds"),
                    "held_out_at_end": held_at(c.points, seconds, "seconds"),
                    "held_out_second_half": held_over(c.points, seconds / 2, seconds), "equal_samples": fewest,
                    "held_out_at_equal_samples": held_at(c.points, fewest, "samples"),
                    "points": [[p.version, round(p.seconds, 3), p.samples, p.held_out] for p in c.points], **fmt})
    return out


def curve_of(row: dict[str, Any]) -> Curve:
    """A side's curve again from its row of ``figures``: its points, counts and notes (what ``figures`` did not derive)."""
    derived = figures([Curve("", [Point(0, 0.0, 0, 0.0)], 1.0, 0, 1)], 1.0)[0].keys()
    return Curve(row["side"], [Point(*p) for p in row["points"]], row["rl_s"], row["generated"], row["trained"],
                 {k: v for k, v in row.items() if k not in derived})


def table(results: list[dict[str, Any]], seconds: float, n_eval: int, sides: str = "in-process loop vs astraflow up") -> Table:
    v0 = results[0]["held_out_v0"]
    t = Table(title=f"{sides} · {seconds:.0f} s of RL each, same checkpoint · held-out: mean of the last "
                    f"{LAST_EVALS} evaluations of {n_eval} prompts (s.e. of one at {v0:.2f}: {binomial_se(v0, n_eval):.3f})")
    for c in ("side", "samples/s generated", "samples/s trained", "s/step", "held-out v0", f"at {seconds / 2:.0f} s",
              f"at {seconds:.0f} s", f"mean, {seconds / 2:.0f}-{seconds:.0f} s", f"at {results[0]['equal_samples']} samples"):
        t.add_column(c)
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in results:
        t.add_row(r["side"], f"{r['generated_per_s']:.0f}", f"{r['trained_per_s']:.0f}", f"{r['s_per_step']:.3f}",
                  f(r["held_out_v0"]), f(r["held_out_at_half"]), f(r["held_out_at_end"]), f(r["held_out_second_half"]),
                  f(r["held_out_at_equal_samples"]))
    return t


def plot(curves: list[Curve], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for c in curves:
        held = [p.held_out for p in c.points]
        smooth = [statistics.fmean(held[max(0, i - SMOOTH + 1):i + 1]) for i in range(len(held))]
        for ax, xs in ((a, [p.seconds for p in c.points]), (b, [p.samples for p in c.points])):
            line, = ax.plot(xs, smooth, "-", lw=2, label=f"{c.name} (mean of the last {SMOOTH})")
            ax.plot(xs, held, "o", ms=2, alpha=0.35, color=line.get_color())
    a.set(xlabel="RL wall time (s, from version 0)", ylabel="held-out accuracy (greedy, 200 prompts)", title="against wall time")
    b.set(xlabel="samples trained on", ylabel="held-out accuracy (greedy, 200 prompts)", title="against samples")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    save(fig, (a, b), path, title)


def save(fig: Any, axes: tuple[Any, ...], path: Path, title: str) -> None:
    """Grid the axes, title the figure, write it to ``path`` and let it go."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(seconds: float, nodes: list[int], threads: int, quick: bool, keep: Path | None, figure: Path,
         reuse: Path | None = None) -> dict[str, Any]:
    overrides = ["sft.steps=40", "eval.every=5"] if quick else []
    recipe = load_recipe(RECIPE, overrides)
    eval_every = recipe.eval.every
    with tempfile.TemporaryDirectory() as tmp:
        workdir = keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        checkpoint = reuse or workdir / "sft-checkpoint"
        sft_loss = 0.0
        if reuse is None:
            t0 = time.perf_counter()
            sft_loss = warm_start(recipe, checkpoint, threads)
            console.print(f"SFT warm start: {recipe.policies[recipe.primary].sft.steps} steps in {time.perf_counter() - t0:.0f} s, "
                          f"last loss {sft_loss:.3f}; checkpoint {checkpoint}")
        else:
            console.print(f"SFT warm start: reused from {checkpoint}")
        start_here = load_recipe(RECIPE, [*overrides, f"model.pretrained={checkpoint}", "sft.steps=0"])
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                      TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task("in-process loop", total=seconds)
            curves = [run_inprocess(start_here, seconds, eval_every, threads, lambda s: progress.update(bar, completed=s))]
            curves[0].notes["load_1min"] = os.getloadavg()[0]
            # up's trainer stops at trainer.steps: twice the in-process count keeps it training through the window
            steps = 2 * curves[0].notes["versions"] + eval_every
            for n in nodes:
                bar = progress.add_task(f"astraflow up, {n} node(s)", total=seconds)
                curves.append(run_up(checkpoint, seconds, n, eval_every, int(steps), workdir, lambda s: progress.update(bar, completed=s)))
                curves[-1].notes["load_1min"] = os.getloadavg()[0]
    results = figures(curves, seconds)
    console.print(table(results, seconds, recipe.data.n_eval))
    for r in results[1:]:
        console.print(f"{r['side']}: CPU share by process " + json.dumps({k[4:]: v for k, v in r.items() if k.startswith("cpu.")}))
        console.print(f"{r['side']}: busy share by worker " + json.dumps({k[5:]: v for k, v in r.items() if k.startswith("busy.")}))
    plot(curves, figure, f"{recipe.name}: held-out accuracy, {seconds:.0f} s of RL from one SFT checkpoint")
    console.print(f"plot: {figure}")
    return {"seconds": seconds, "quick": quick, "threads": threads, "sft_steps": recipe.policies[recipe.primary].sft.steps,
            "sft_loss": None if reuse else round(sft_loss, 4), "checkpoint_reused": str(reuse) if reuse else None,
            "load_average": os.getloadavg(), "results": results}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=600.0, help="RL wall time of each side, from version 0")
    ap.add_argument("--nodes", default="1,2", help="rollout nodes of each astraflow up run (the recipe ships 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the SFT and the in-process loop (up's trainer takes "
                                                           "trainer.threads: auto, 1 on 2 cores); see the module docstring")
    ap.add_argument("--quick", action="store_true", help="smoke run: 40 SFT steps, 30 s each side, evaluations every 5 steps")
    ap.add_argument("--keep", type=Path, default=None, help="keep the checkpoint, run directories and logs in this folder")
    ap.add_argument("--checkpoint", type=Path, default=None, help="start every side from this saved warm start (a folder "
                                                                  "`--keep` left, sft-checkpoint) instead of taking the SFT again")
    ap.add_argument("--figure", type=Path, default=None, help=f"where the plot goes (default {FIGURE.relative_to(ROOT)}; "
                                                               "with --quick, the temporary directory)")
    args = ap.parse_args()
    secs = 30.0 if args.quick and args.seconds == 600.0 else args.seconds
    figure = args.figure or (Path(tempfile.gettempdir()) / "inprocess-quick.png" if args.quick else FIGURE)
    print(json.dumps(main(secs, [int(n) for n in args.nodes.split(",")], args.threads, args.quick, args.keep, figure,
                          args.checkpoint)))
