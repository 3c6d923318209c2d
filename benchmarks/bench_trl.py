"""``astraflow up`` against TRL's ``GRPOTrainer`` on the same cores, one after the other, from the same checkpoint.

The workload is ``recipes/arithmetic/inprocess.yaml`` (a+b with a, b in 10..99, 7,900 training / 200 held-out problems,
a 1.08M-parameter Qwen2, 8 prompts x 8 samples a step, lr 1e-4). Its SFT warm start is taken once and saved; both
sides start from it:

- TRL (``trl_peer.py``, in TRL's own environment: ``bash benchmarks/trl_env.sh``): ``GRPOTrainer`` with the recipe's
  batch shape, sampling, learning rate, gradient clipping and weight decay, TRL's defaults for the rest; one process,
  torch on every core; held-out on a stopped clock;
- ``astraflow up`` with the recipe as shipped (one rollout node, ``max_staleness: 1``), stopped ``--seconds`` after
  version 0; it pays for its evaluator, which runs beside the other roles.

Both report held-out accuracy with the project's evaluator (greedy, the same 200 prompts), samples trained per second,
held-out at equal wall time (at half, at the end, and the mean over the second half) and at equal samples, and the
cores each kept busy (CPU seconds over the RL window: TRL's one process, up's per role). Differences that remain are
listed in BENCHMARKS.md. Output: a rich table, ``benchmarks/figures/trl.png``, ``benchmarks/results/trl.json`` and,
as the last stdout line, JSON.

With ``--seeds N`` both sides run on seeds 0..N-1 (``trainer.seed``: TRL's sampling and data order, the trainer's
seed of ``up``; the checkpoint, the split and up's prompt order stay the same) and the record is the mean and 95 %
t-interval over seeds of each figure, and up − TRL in held-out paired by seed at every tenth of the window
(``benchmarks/results/trl_seeds.json``, ``figures/trl_seeds.png``). ``--cores 0`` runs everything on those CPUs
alone (``trl_seeds_1core``): how each side scales with the cores it has.

    python benchmarks/bench_trl.py [--seconds 600] [--checkpoint DIR | --sft-steps 1175] [--keep DIR] [--venv .venv-trl]
                                   [--seeds 3] [--cores 0] [--record NAME]
    python benchmarks/bench_trl.py --merge NAME [NAME ...] --record NAME

The recipe's own warm start (1,750 SFT steps) solves the task, so both sides would start at the ceiling:
``--sft-steps 1175`` takes a checkpoint that leaves held-out near 0.47, where RL has room to show; ``--sft-steps 1050``
leaves it near 0.23, where both sides climb through the whole 600 s (record it beside the other: ``--record NAME``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import result_files  # noqa: E402
from bench_inprocess import RECIPE, console, curve_of, figures, held_at, plot, run_up, save, table  # noqa: E402
from inprocess_loop import Curve, Point, warm_start  # noqa: E402
from stats import Estimate, over_seeds, paired  # noqa: E402

from astraflow.config import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURE = ROOT / "benchmarks" / "figures" / "trl.png"
GRID = 10  # over seeds, the sides are compared at every tenth of the window


def run_trl(venv: Path, checkpoint: Path, seconds: float, eval_every: int, workdir: Path, tick: Any, seed: int | None = None) -> Curve:
    """TRL's side, in its own environment; ``tick(elapsed)`` while it runs (its own clock excludes evaluations)."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no TRL environment at {venv}: bash benchmarks/trl_env.sh {venv}")
    out = workdir / "trl.json"
    cmd = [str(python), str(ROOT / "benchmarks" / "trl_peer.py"), "--recipe", str(RECIPE), "--checkpoint", str(checkpoint),
           "--seconds", str(seconds), "--eval-every", str(eval_every), "--out", str(out),
           *(["--seed", str(seed)] if seed is not None else [])]
    t0 = time.monotonic()
    with open(workdir / "trl.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            tick(min(seconds, time.monotonic() - t0))
            time.sleep(1.0)
    if proc.returncode != 0:
        raise SystemExit(f"TRL's side failed ({proc.returncode}); see {workdir / 'trl.log'}")
    r = json.loads(out.read_text())
    curve = Curve(r["side"], [Point(*p) for p in r["points"]], r["seconds"], r["generated"], r["trained"])
    curve.notes = {"versions": r["steps"], "s_per_step": r["seconds"] / max(1, r["steps"]), "cores_busy": r["cpu_s"] / r["seconds"],
                   "torch_threads": r["torch_threads"], "loss_type": r["loss_type"], "scale_rewards": r["scale_rewards"]}
    return curve


def one_run(seed: int | None, seconds: float, checkpoint: Path, venv: Path, workdir: Path, eval_every: int,
            up_sets: tuple[str, ...], sides: tuple[str, ...], progress: Progress) -> list[Curve]:
    """Each side in turn from ``checkpoint``, with ``seed`` as both sides' ``trainer.seed`` (None: the recipe's)."""
    curves: list[Curve] = []
    workdir.mkdir(parents=True, exist_ok=True)
    tag = "" if seed is None else f", seed {seed}"
    if "trl" in sides:
        bar = progress.add_task(f"TRL GRPOTrainer{tag}", total=seconds)
        curves.append(run_trl(venv, checkpoint, seconds, eval_every, workdir, lambda s: progress.update(bar, completed=s), seed))
        curves[-1].notes["load_1min"] = os.getloadavg()[0]
    if "up" in sides:
        steps = 2 * curves[0].notes["versions"] + eval_every if curves else 30 * seconds  # room to train through the window
        bar = progress.add_task(f"astraflow up, 1 node{tag}", total=seconds)
        sets = up_sets if seed is None else (*up_sets, f"trainer.seed={seed}")
        curves.append(run_up(checkpoint, seconds, 1, eval_every, int(steps), workdir,
                             lambda s: progress.update(bar, completed=s), sets))
        curves[-1].notes["load_1min"] = os.getloadavg()[0]
        curves[-1].notes["cores_busy"] = sum(v for k, v in curves[-1].notes.items() if k.startswith("cpu."))
    return curves


def main(seconds: float, keep: Path | None, reuse: Path | None, venv: Path, figure: Path, up_sets: tuple[str, ...] = (),
         sides: tuple[str, ...] = ("trl", "up"), seeds: tuple[int, ...] = (), sft_steps: int | None = None,
         record: str | None = None) -> dict[str, Any]:
    # sft_steps changes the checkpoint's warm start only: both sides' RL runs the recipe as shipped
    recipe = load_recipe(RECIPE, [f"sft.steps={sft_steps}"] if sft_steps is not None else None)
    eval_every = recipe.eval.every
    with tempfile.TemporaryDirectory() as tmp:
        workdir = keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        checkpoint = reuse or workdir / "sft-checkpoint"
        taken = None if reuse else recipe.policies[recipe.primary].sft.steps  # the SFT steps of a checkpoint taken here
        if reuse is None:
            t0 = time.perf_counter()
            loss = warm_start(recipe, checkpoint, threads=1)
            console.print(f"SFT warm start: {recipe.policies[recipe.primary].sft.steps} steps in {time.perf_counter() - t0:.0f} s, "
                          f"last loss {loss:.3f}; checkpoint {checkpoint}")
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                      TimeElapsedColumn(), console=console) as progress:
            def run(seed: int | None) -> list[Curve]:
                return one_run(seed, seconds, checkpoint, venv, workdir if seed is None else workdir / f"seed{seed}", eval_every,
                               up_sets, sides, progress)

            runs: dict[int | None, list[Curve]] = {seed: run(seed) for seed in seeds} if seeds else {None: run(None)}
    if seeds:
        return over_the_seeds(runs, seconds, figure, up_sets, recipe.name, taken, record or seeds_name())
    curves = runs[None]
    results = figures(curves, seconds)
    console.print(table(results, seconds, recipe.data.n_eval, "TRL GRPOTrainer vs astraflow up"))
    if len(results) < 2:  # one side alone: a probe (``--sides up --up-set ...``), nothing recorded
        return {"seconds": seconds, "results": results}
    trl, up = results
    ratio = up["trained_per_s"] / trl["trained_per_s"]
    console.print(f"up trains {ratio:.2f}x TRL's samples/s; cores busy: TRL {trl['cores_busy']:.2f}, up {up['cores_busy']:.2f} "
                  "(" + ", ".join(f"{k[4:]} {v:.2f}" for k, v in up.items() if k.startswith("cpu.")) + ")")
    plot(curves, figure, f"{recipe.name}: TRL GRPOTrainer against astraflow up, {seconds:.0f} s of RL from one SFT checkpoint")
    console.print(f"plot: {figure}")
    out = {"seconds": seconds, "checkpoint_reused": reuse is not None, "load_average": os.getloadavg(), "up_sets": list(up_sets),
           "sft_steps": taken,
           "up_over_trl": round(ratio, 3),
           "figure": figure.relative_to(ROOT).as_posix() if figure.is_relative_to(ROOT) else str(figure), "results": results}
    result_files.write("trl", out)
    return out


def grid(seconds: float) -> list[float]:
    """The wall times the seeds are compared at: every tenth of the window."""
    return [seconds * k / GRID for k in range(1, GRID + 1)]


def over_the_seeds(runs: dict[int | None, list[Curve]], seconds: float, figure: Path, up_sets: tuple[str, ...],
                   name: str, sft_steps: int | None = None, record: str = "trl_seeds",
                   provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """Both sides over the seeds: per side the mean and 95 % t-interval of samples/s and held-out (at half, at the end,
    over the second half, at equal samples); paired by seed (the same checkpoint, the same seed), up − TRL in held-out
    at each tenth of the window, and up / TRL in samples/s. ``ahead_throughout``: every paired interval above zero."""
    per_seed = {seed: figures(curves, seconds) for seed, curves in runs.items()}
    if any(len(r) < 2 for r in per_seed.values()):
        raise SystemExit("--seeds compares the two sides: run both (--sides trl,up)")
    keys = ("trained_per_s", "held_out_at_half", "held_out_at_end", "held_out_second_half", "held_out_at_equal_samples", "cores_busy")
    sides = {}
    for i, side in enumerate(("trl", "up")):
        rows = [r[i] for r in per_seed.values()]
        sides[side] = {"side": rows[0]["side"], **{k: est(over_seeds([x[k] for x in rows])) for k in keys}}
    sides["up"]["plane_share"] = est(over_seeds([plane_share(r[1]) for r in per_seed.values()]))
    at_times: list[dict[str, Any]] = []
    for t in grid(seconds):
        held = [(held_at(c[0].points, t, "seconds"), held_at(c[1].points, t, "seconds")) for c in runs.values()]
        trl = [x for x, _ in held if x is not None]
        up = [y for _, y in held if y is not None]
        if len(trl) == len(up) == len(held):
            at_times.append({"seconds": round(t, 1), "trl": est(over_seeds(trl)), "up": est(over_seeds(up)),
                             "up_minus_trl": est(paired(up, trl))})
    ratio = over_seeds([r[1]["trained_per_s"] / r[0]["trained_per_s"] for r in per_seed.values()])
    up_half, trl_half = ([r[i]["held_out_second_half"] for r in per_seed.values()] for i in (1, 0))
    second_half = paired(up_half, trl_half)
    out = {"seconds": seconds, "seeds": list(runs), "up_sets": list(up_sets), "sft_steps": sft_steps,
           "cores": len(os.sched_getaffinity(0)), "sides": sides,
           "up_over_trl": est(ratio),
           "second_half_up_minus_trl": est(second_half), "at_times": at_times,
           "ahead_throughout": bool(at_times) and all(x["up_minus_trl"][0] - x["up_minus_trl"][1] > 0 for x in at_times),
           "figure": figure.relative_to(ROOT).as_posix() if figure.is_relative_to(ROOT) else str(figure),
           "per_seed": {str(seed): r for seed, r in per_seed.items()}}
    plot_seeds(runs, at_times, figure, f"{name}: TRL GRPOTrainer against astraflow up over {len(runs)} seeds, {seconds:.0f} s of RL each")
    result_files.write(record, {**out, **(provenance or {})})  # a merge's provenance is its runs', not its own
    console.print(f"over {len(runs)} seeds: up trains {ratio.fmt()}x TRL's samples/s; held-out over the second half, up - TRL: "
                  f"{second_half.fmt(3)}; ahead at every tenth of the window: {out['ahead_throughout']}; plot: {figure}")
    return out


def merge(names: list[str], figure: Path, record: str) -> dict[str, Any]:
    """One record over the seeds of several runs with ``--seeds`` (each ``results/NAME.json``; the same window, checkpoint
    and overrides, different seeds): every figure and interval taken again over all their seeds. The runs' own
    commands, machines, dates and commits are its provenance, each run's seeds beside them (``runs``). Times are as the
    records hold them: records made before points kept milliseconds hold tenths of a second, so there a tenth of the
    window can take in an evaluation made up to 0.05 s after it."""
    paths = [result_files.RESULTS / f"{n}.json" for n in names]
    if missing := [str(p) for p in paths if not p.exists()]:
        raise SystemExit(f"--merge: no such record: {', '.join(missing)}")
    runs_in = [json.loads(p.read_text()) for p in paths]
    if len({(r["seconds"], r["sft_steps"], tuple(r["up_sets"]), r.get("cores")) for r in runs_in}) != 1:
        raise SystemExit("--merge takes runs of one comparison: the same --seconds, --sft-steps, --up-set and cores")
    starts = {(i, row[i]["held_out_v0"]) for r in runs_in for row in r["per_seed"].values() for i in (0, 1)}
    if len(starts) != 2:  # one held-out v0 per side: a run from another checkpoint (--checkpoint DIR) starts elsewhere
        raise SystemExit(f"--merge takes runs from one checkpoint: the runs start from held-out {sorted(starts)} (side, v0)")
    seeds = [int(s) for r in runs_in for s in r["per_seed"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge takes each seed once: the runs hold seeds {seeds}")
    curves: dict[int | None, list[Curve]] = {int(s): [curve_of(row) for row in rows] for r in runs_in
                                            for s, rows in r["per_seed"].items()}
    first = runs_in[0]
    merged = shlex.join(["python", "benchmarks/bench_trl.py", "--merge", *names, "--record", record])
    provenance = {"command": " && ".join([*(r["command"] for r in runs_in), merged]), "cores": first.get("cores"),
                  **{k: "; ".join(dict.fromkeys(r[k] for r in runs_in)) for k in ("machine", "date", "commit")},
                  "runs": [{k: r[k] for k in ("command", "machine", "date", "commit", "seeds")} for r in runs_in]}
    return over_the_seeds(curves, first["seconds"], figure, tuple(first["up_sets"]), load_recipe(RECIPE).name,
                          first["sft_steps"], record, provenance)


def seeds_name() -> str:
    """The name of a run over seeds (its record and figure): ``trl_seeds``, or ``trl_seeds_<n>core`` on a subset of the CPUs."""
    cores = len(os.sched_getaffinity(0))
    return "trl_seeds" if cores == os.cpu_count() else f"trl_seeds_{cores}core"


def plane_share(up: dict[str, Any]) -> float:
    """The plane's share of up's CPU: the dataflow, the nats-server and the launcher, of every process's CPU seconds."""
    cpu = {k[4:]: v for k, v in up.items() if k.startswith("cpu.")}
    return sum(cpu.get(k, 0.0) for k in ("dataflow", "nats-server", "launcher")) / sum(cpu.values())


def est(e: Estimate) -> list[float]:
    """An estimate as it is recorded: [mean, half-width of its 95 % interval, runs]."""
    return [round(e.mean, 4), round(e.half_width, 4), e.n]


def plot_seeds(runs: dict[int | None, list[Curve]], at_times: list[dict[str, Any]], path: Path, title: str) -> None:
    """Left: each seed's held-out against wall time (thin) and the mean over seeds per side (thick); right: up − TRL
    paired by seed, with its 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ts = [x["seconds"] for x in at_times]
    for i, (side, colour) in enumerate((("trl", "tab:blue"), ("up", "tab:orange"))):
        for curves in runs.values():
            c = curves[i]
            a.plot([p.seconds for p in c.points], [p.held_out for p in c.points], "-", lw=0.6, alpha=0.35, color=colour)
        a.plot(ts, [x[side][0] for x in at_times], "o-", lw=2, color=colour, label=f"{curves[i].name}: mean over seeds")
    diff = [x["up_minus_trl"] for x in at_times]
    b.axhline(0, color="grey", lw=1)
    b.errorbar(ts, [d[0] for d in diff], yerr=[d[1] for d in diff], fmt="o-", capsize=3, color="tab:green")
    a.set(xlabel="RL wall time (s, from version 0)", ylabel="held-out accuracy (greedy, 200 prompts)", title="held-out against wall time")
    b.set(xlabel="RL wall time (s, from version 0)", ylabel="up − TRL, held-out (paired by seed)", title="difference, 95 % interval")
    a.legend(fontsize=8)
    save(fig, (a, b), path, title)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0, help="RL wall time of each side")
    ap.add_argument("--checkpoint", type=Path, default=None, help="start both sides from this saved warm start instead of "
                                                                  "taking the SFT again (a folder --keep left: sft-checkpoint)")
    ap.add_argument("--sft-steps", type=int, default=None, help="SFT steps of the checkpoint taken (the recipe's 1,750 "
                                                                 "solve the task; 1,175 leave held-out near 0.47)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the checkpoint, run directory and logs in this folder")
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-trl", help="TRL's environment (benchmarks/trl_env.sh)")
    ap.add_argument("--figure", type=Path, default=FIGURE)
    ap.add_argument("--up-set", action="append", default=[], help="a recipe override for up's side (repeatable)")
    ap.add_argument("--sides", default="trl,up", help="which sides to run; one alone is a probe and records nothing")
    ap.add_argument("--seeds", type=int, default=0, help="run both sides on this many seeds (trainer.seed) and record the "
                                                          "mean and 95 %% interval over them (results/trl_seeds.json)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--record", default=None, help="over seeds, the name of the record and its figure (results/NAME.json, "
                                                   "figures/NAME.png); default trl_seeds, or trl_seeds_<n>core with --cores")
    ap.add_argument("--cores", default=None, help="run on these CPUs only (taskset's list: 0 or 0,1); a subset records "
                                                  "results/trl_seeds_<n>core.json")
    ap.add_argument("--merge", nargs="+", default=None, metavar="NAME",
                    help="run nothing: one record (--record) over the seeds of these records of --seeds runs")
    args = ap.parse_args()
    if args.merge:
        if not args.record:
            ap.error("--merge writes the record named by --record")
        merge(args.merge, FIGURE.with_name(f"{args.record}.png"), args.record)
        raise SystemExit(0)
    if args.sft_steps is not None and args.checkpoint is not None:
        ap.error("--sft-steps takes a new checkpoint; --checkpoint reuses one")
    if args.cores:
        os.sched_setaffinity(0, {int(c) for c in args.cores.split(",")})  # both sides' processes inherit it
    record = args.record or seeds_name()
    figure = FIGURE.with_name(f"{record}.png") if args.seeds and args.figure == FIGURE else args.figure
    print(json.dumps(main(args.seconds, args.keep, args.checkpoint, args.venv, figure, tuple(args.up_set),
                          tuple(args.sides.split(",")), tuple(range(args.first_seed, args.first_seed + args.seeds)), args.sft_steps,
                          record)))
