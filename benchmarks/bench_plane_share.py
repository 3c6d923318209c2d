"""The plane's share of ``astraflow up``'s CPU, and the trainer's time outside its step, as the model grows.

The in-process workload (``recipes/arithmetic/inprocess.yaml``: a+b, 8 prompts x 8 samples a step, lr 1e-4, one
rollout node) at several widths of its Qwen2 (``model.hidden_size`` W, ``intermediate_size`` 4W, the recipe's
4 layers and heads). Each width gets its own short SFT warm start (``--sft-steps``), then ``astraflow up`` runs from
it for ``--seconds`` after version 0, as ``bench_trl.py`` runs it. Per width it reports samples/s trained, the CPU
each role kept busy, the plane's share (dataflow, nats-server and launcher over all roles), the plane's CPU per
1,000 samples, the trainer's time outside its step (1 − step / version) and the weight delta's bytes a version.

The dataflow's work is per sample (decode, checks, the claims scored again, a batch's bookkeeping) and per turn, the
server's per message and per byte of the weights; the trainer's step and the node's generation grow with the model.
So the plane's share falls as the width grows: this shows by how much, and what stays. Output: a rich table,
``benchmarks/figures/plane_share.png``, ``benchmarks/results/plane_share.json`` and, as the last stdout line, JSON.

    python benchmarks/bench_plane_share.py [--widths 64 128 256 512] [--seconds 120] [--sft-steps 150] [--set K=V] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import result_files  # noqa: E402
from bench_inprocess import RECIPE, console, rows, run_up  # noqa: E402
from inprocess_loop import warm_start  # noqa: E402

from astraflow.config import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURE = ROOT / "benchmarks" / "figures" / "plane_share.png"
PLANE = ("dataflow", "nats-server", "launcher")  # the roles that carry data between the others; the rest compute


def width_sets(width: int) -> list[str]:
    return [f"model.hidden_size={width}", f"model.intermediate_size={4 * width}"]


def one_width(width: int, seconds: float, sft_steps: int, workdir: Path, progress: Progress, sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """Warm start at ``width``, then ``up`` from it for ``seconds`` with the recipe overrides ``sets``; the figures of that run."""
    workdir.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(RECIPE, [*width_sets(width), f"sft.steps={sft_steps}", *sets])
    checkpoint = workdir / "sft-checkpoint"
    t0 = time.perf_counter()
    warm_start(recipe, checkpoint, threads=2)  # nothing else runs yet: both cores
    sft_s = time.perf_counter() - t0
    bar = progress.add_task(f"width {width}: astraflow up", total=seconds)
    curve = run_up(checkpoint, seconds, 1, recipe.eval.every, int(30 * seconds), workdir, lambda s: progress.update(bar, completed=s), sets)
    notes = curve.notes
    cpu = {k.removeprefix("cpu."): v for k, v in notes.items() if k.startswith("cpu.")}
    plane, total = sum(cpu.get(k, 0.0) for k in PLANE), sum(cpu.values())
    trained_per_s = curve.trained / seconds
    run_dir = workdir / "up-1n"
    versions = [r for r in rows(run_dir / "metrics.jsonl") if r.get("version", 0) > 0 and r.get("bytes")]
    return {"width": width, "parameters": sum(p.numel() for p in _model(checkpoint).parameters()), "sft_steps": sft_steps,
            "sft_s": round(sft_s, 1), "trained_per_s": round(trained_per_s, 1), "versions": notes["versions"],
            "s_per_version": round(notes["s_per_step"], 4), "step_s": round(notes["step_s"], 4),
            "outside_step": round(1 - notes["step_s"] / notes["s_per_step"], 3),
            "trainer_waits": notes.get("busy.trainer-solver.wait"),
            "delta_bytes": round(statistics.mean(r["bytes"] for r in versions)) if versions else None,
            "cpu": cpu, "cores_busy": round(total, 3), "plane_share": round(plane / total, 4),
            "plane_ms_per_1k_samples": round(1e3 * plane / trained_per_s * 1e3, 1),
            "held_out": [curve.points[0].held_out, curve.points[-1].held_out] if curve.points else None}


def _model(checkpoint: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint)


def table(results: list[dict[str, Any]], seconds: float) -> Table:
    t = Table(title=f"The plane's share of astraflow up's CPU by model width ({seconds:.0f} s each, 1 node)")
    for col in ("width", "parameters", "samples/s", "s/version", "trainer outside step", "delta a version", "trainer",
                "node", "dataflow", "nats-server", "launcher", "plane's share", "plane CPU ms / 1k samples"):
        t.add_column(col)
    for r in results:
        c = r["cpu"]
        t.add_row(str(r["width"]), f"{r['parameters'] / 1e6:.2f} M", f"{r['trained_per_s']:.0f}", f"{r['s_per_version']:.3f}",
                  f"{100 * r['outside_step']:.0f} %", f"{(r['delta_bytes'] or 0) / 2**10:,.0f} KiB",
                  *(f"{c.get(k, 0):.3f}" for k in ("trainer-solver", "rollout-0", *PLANE)),
                  f"{100 * r['plane_share']:.1f} %", f"{r['plane_ms_per_1k_samples']:.0f}")
    return t


def plot(results: list[dict[str, Any]], figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["parameters"] / 1e6 for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(x, [100 * r["plane_share"] for r in results], "o-", label="plane (dataflow, server, launcher)")
    a.plot(x, [100 * r["outside_step"] for r in results], "s--", label="trainer outside its step")
    a.axhline(5, color="grey", lw=0.8, ls=":")
    a.set_xscale("log")
    a.set_xlabel("parameters (M)")
    a.set_ylabel("% of CPU / of a version")
    a.legend(fontsize=8)
    b.plot(x, [r["plane_ms_per_1k_samples"] for r in results], "o-", label="plane CPU ms per 1k samples")
    b.plot(x, [r["trained_per_s"] for r in results], "s--", label="samples/s trained")
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("parameters (M)")
    b.legend(fontsize=8)
    fig.suptitle("astraflow up, in-process workload, by model width")
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--seconds", type=float, default=120.0, help="RL wall time of each width")
    ap.add_argument("--sft-steps", type=int, default=150, help="each width's SFT warm start")
    ap.add_argument("--keep", type=Path, default=None, help="keep checkpoints, run directories and logs here")
    ap.add_argument("--figure", type=Path, default=FIGURE)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a recipe override for every width (repeatable)")
    ap.add_argument("--no-record", action="store_true", help="print only; write no result file or figure")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = args.keep or Path(tmp)
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                      TimeElapsedColumn(), console=console) as progress:
            results = [one_width(w, args.seconds, args.sft_steps, base / f"w{w}", progress, tuple(args.sets)) for w in args.widths]
    console.print(table(results, args.seconds))
    figures = {"seconds": args.seconds, "sets": args.sets, "widths": results}
    if not args.no_record:
        plot(results, args.figure)
        result_files.write("plane_share", figures)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
