"""Solver and verifier as LoRA adapters on one base against full fine-tuning of each, on live ``astraflow up`` runs of
``recipes/math-multi-agent`` (``recipe.yaml``: every weight of each policy's own model) and its ``shared-base.yaml``
(``rollout.shared_base``: one base warm-started once for both, each policy's rank-16 adapters on it), the same seeds
(``model.seed`` = ``trainer.seed``) and steps.

Per run and policy: held-out at v0, the mean over the evaluations from the middle on ("late": v20, v30, v40 of 40
steps), the rise; the team's pick (the first sample the verifier accepts); bytes per version; the wall time, the shared
base's warm start included (it runs before the run's own clock starts, so it is added to every evaluation time for the
comparison at equal wall time). Writes ``benchmarks/results/lora_team.json`` and ``benchmarks/figures/lora-team.png``.

    python benchmarks/bench_lora_team.py [--seeds 5] [--steps 40] [--replot]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import write  # noqa: E402
from stats import over_seeds, paired  # noqa: E402

MODES = {"full fine-tuning": "recipe.yaml", "LoRA, shared base": "shared-base.yaml"}
SUBJECTS = ("solver", "verifier", "team")
FIGURE = ROOT / "benchmarks" / "figures" / "lora-team.png"  # the solver's greedy held-out, the verifier's accuracy, the team's pick


def curves(summary: dict[str, Any], offset: float) -> dict[str, list[tuple[int, float, float]]]:
    """(version, held-out, seconds since launch) per subject."""
    at = {int(v): s + offset for v, s in summary["eval_at_s"].items()}
    out = {"solver": [(int(v), r, at[int(v)]) for v, r in summary["held_out_reward"].items()]}
    for subject, rows in summary["held_out_others"].items():
        out[subject] = [(int(v), r["reward"], at[int(v)]) for v, r in rows.items() if int(v) in at]
    return {k: sorted(v) for k, v in out.items()}


def live_run(base: Path, mode: str, seed: int, steps: int) -> dict[str, Any]:
    run_dir = base / f"{mode.split(',')[0].replace(' ', '-')}-{seed}"
    sets = {"trainer.steps": steps, "trainer.seed": seed, "model.seed": seed}
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "math-multi-agent" / MODES[mode]), "--run-dir",
           str(run_dir), *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=3600)
    launch_s = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    warm = summary.get("base_warm_start") or {}
    base_s = float(warm.get("seconds", 0.0))
    c = curves(summary, base_s)
    late = {k: statistics.mean(r for v, r, _ in rows if v >= steps // 2) for k, rows in c.items()}
    out = {"mode": mode, "seed": seed, "curves": c, "v0": {k: rows[0][1] for k, rows in c.items()}, "late": late,
           "rise": {k: late[k] - c[k][0][1] for k in c}, "wall_s": summary["wall_s"] + base_s, "launch_s": round(launch_s, 1),
           "base_warm_start_s": base_s,
           "delta_bytes_mean": {p: round(v["delta_bytes_mean"]) for p, v in summary["policies"].items()}}
    print(json.dumps({k: v for k, v in out.items() if k != "curves"}), flush=True)
    return out


def at_time(rows: list[list[float]], t: float) -> float:
    """Held-out at the last evaluation made by ``t`` seconds after launch (v0's before any)."""
    return max(((s, r) for _, r, s in rows if s <= t), default=(0.0, rows[0][1]))[1]


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Held-out by version, per subject: each mode's mean over seeds, every seed faint behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SUBJECTS), figsize=(12, 3.6), sharey=True)
    for ax, subject in zip(axes, SUBJECTS, strict=True):
        for mode, colour in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
            curves_ = [[(v, r) for v, r, _ in run["curves"][subject]] for run in runs if run["mode"] == mode]
            for c in curves_:
                ax.plot(*zip(*c, strict=True), color=colour, alpha=0.2, lw=1)
            versions = sorted({v for c in curves_ for v, _ in c})
            means = [statistics.mean(r for c in curves_ for v2, r in c if v2 == v) for v in versions]
            ax.plot(versions, means, color=colour, lw=2, marker="o", label=mode)
        ax.set_title({"solver": "solver, greedy", "verifier": "the verifier's accuracy", "team": "team: the verifier's pick"}[subject])
        ax.set_xlabel("version")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Per mode, each figure's mean over seeds and interval; LoRA − full, paired by seed."""
    summary: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {f"{key}.{k}": list(vars(over_seeds([r[key][k] for r in mine])).values())
                         for key in ("v0", "late", "rise", "equal_time") for k in SUBJECTS}
        summary[mode] |= {"wall_s": statistics.mean(r["wall_s"] for r in mine),
                          "base_warm_start_s": statistics.mean(r["base_warm_start_s"] for r in mine),
                          "delta_bytes_mean": {p: statistics.mean(r["delta_bytes_mean"][p] for r in mine) for p in ("solver", "verifier")}}
    full, lora = ([r for r in runs if r["mode"] == m] for m in MODES)
    diff = {f"{key}.{k}": list(vars(paired([r[key][k] for r in lora], [r[key][k] for r in full])).values())
            for key in ("late", "equal_time") for k in SUBJECTS}
    return summary, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--replot", action="store_true", help="only draw the figure again from benchmarks/results/lora_team.json")
    a = ap.parse_args()
    if a.replot:
        plot(json.loads((ROOT / "benchmarks" / "results" / "lora_team.json").read_text())["runs"], FIGURE)
        return
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-team-") as tmp:
        for seed in range(a.seeds):
            pair = [live_run(Path(tmp), mode, seed, a.steps) for mode in MODES]
            t = min(r["curves"]["solver"][-1][2] for r in pair)  # when the faster run of the seed made its last evaluation
            for r in pair:
                r["equal_time"] = {k: at_time(rows, t) for k, rows in r["curves"].items()}
            runs += pair
    summary, diff = summarise(runs)
    table = Table(title=f"math-multi-agent: LoRA on a shared base against full fine-tuning, {a.steps} steps, {a.seeds} seeds")
    for col in ("mode", "subject", "v0", "late (v≥half)", "rise", "at equal wall time"):
        table.add_column(col)
    for mode, s in summary.items():
        for k in SUBJECTS:
            cells = (s[f"{key}.{k}"] for key in ("v0", "late", "rise", "equal_time"))
            table.add_row(mode, k, *(f"{mean:.3f} ± {half:.3f}" for mean, half, _ in cells))
    for k in SUBJECTS:
        table.add_row("LoRA − full, paired", k, "", f"{diff[f'late.{k}'][0]:+.3f} ± {diff[f'late.{k}'][1]:.3f}", "",
                      f"{diff[f'equal_time.{k}'][0]:+.3f} ± {diff[f'equal_time.{k}'][1]:.3f}")
    Console().print(table)
    plot(runs, FIGURE)
    write("lora_team", {"steps": a.steps, "seeds": a.seeds, "recipes": MODES, "runs": runs, "summary": summary, "lora_minus_full": diff})


if __name__ == "__main__":
    main()
