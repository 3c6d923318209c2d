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

    python benchmarks/bench_trl.py [--seconds 600] [--checkpoint DIR] [--keep DIR] [--venv .venv-trl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import result_files  # noqa: E402
from bench_inprocess import RECIPE, console, figures, plot, run_up, table  # noqa: E402
from inprocess_loop import Curve, Point, warm_start  # noqa: E402

from astraflow.config import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURE = ROOT / "benchmarks" / "figures" / "trl.png"


def run_trl(venv: Path, checkpoint: Path, seconds: float, eval_every: int, workdir: Path, tick: Any) -> Curve:
    """TRL's side, in its own environment; ``tick(elapsed)`` while it runs (its own clock excludes evaluations)."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no TRL environment at {venv}: bash benchmarks/trl_env.sh {venv}")
    out = workdir / "trl.json"
    cmd = [str(python), str(ROOT / "benchmarks" / "trl_peer.py"), "--recipe", str(RECIPE), "--checkpoint", str(checkpoint),
           "--seconds", str(seconds), "--eval-every", str(eval_every), "--out", str(out)]
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


def main(seconds: float, keep: Path | None, reuse: Path | None, venv: Path, figure: Path, up_sets: tuple[str, ...] = (),
         sides: tuple[str, ...] = ("trl", "up")) -> dict[str, Any]:
    recipe = load_recipe(RECIPE)
    eval_every = recipe.eval.every
    with tempfile.TemporaryDirectory() as tmp:
        workdir = keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        checkpoint = reuse or workdir / "sft-checkpoint"
        if reuse is None:
            t0 = time.perf_counter()
            loss = warm_start(recipe, checkpoint, threads=1)
            console.print(f"SFT warm start: {recipe.policies[recipe.primary].sft.steps} steps in {time.perf_counter() - t0:.0f} s, "
                          f"last loss {loss:.3f}; checkpoint {checkpoint}")
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                      TimeElapsedColumn(), console=console) as progress:
            curves: list[Curve] = []
            if "trl" in sides:
                bar = progress.add_task("TRL GRPOTrainer", total=seconds)
                curves.append(run_trl(venv, checkpoint, seconds, eval_every, workdir, lambda s: progress.update(bar, completed=s)))
                curves[-1].notes["load_1min"] = os.getloadavg()[0]
            if "up" in sides:
                steps = 2 * curves[0].notes["versions"] + eval_every if curves else 30 * seconds  # room to train through the window
                bar = progress.add_task("astraflow up, 1 node", total=seconds)
                curves.append(run_up(checkpoint, seconds, 1, eval_every, int(steps), workdir,
                                     lambda s: progress.update(bar, completed=s), up_sets))
                curves[-1].notes["load_1min"] = os.getloadavg()[0]
                curves[-1].notes["cores_busy"] = sum(v for k, v in curves[-1].notes.items() if k.startswith("cpu."))
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
           "up_over_trl": round(ratio, 3),
           "figure": figure.relative_to(ROOT).as_posix() if figure.is_relative_to(ROOT) else str(figure), "results": results}
    result_files.write("trl", out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0, help="RL wall time of each side")
    ap.add_argument("--checkpoint", type=Path, default=None, help="start both sides from this saved warm start instead of "
                                                                  "taking the SFT again (a folder --keep left: sft-checkpoint)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the checkpoint, run directory and logs in this folder")
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-trl", help="TRL's environment (benchmarks/trl_env.sh)")
    ap.add_argument("--figure", type=Path, default=FIGURE)
    ap.add_argument("--up-set", action="append", default=[], help="a recipe override for up's side (repeatable)")
    ap.add_argument("--sides", default="trl,up", help="which sides to run; one alone is a probe and records nothing")
    args = ap.parse_args()
    print(json.dumps(main(args.seconds, args.keep, args.checkpoint, args.venv, args.figure, tuple(args.up_set),
                          tuple(args.sides.split(",")))))
