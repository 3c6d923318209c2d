"""LoRA against full fine-tuning, on live ``astraflow up recipes/arithmetic`` runs (the embedded server), the same seeds
and steps: held-out reward (the mean of the last five evaluations, and at equal wall time: the last evaluation each
run had made when the faster of the pair finished), bytes per announced version, the trainer's step time and CPU.

LoRA (``trainer.lora``, rank ``--rank`` on the attention projections) trains at ``--lora-lr`` (adapters take a larger
step than full fine-tuning's default 3e-4); every version is still announced as the merged full weights, so the
nodes, the engines and the weight plane do the same work in both. Writes ``benchmarks/results/lora.json``.

    python benchmarks/bench_lora.py [--seeds 3] [--steps 300] [--rank 8] [--lora-lr 1e-3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import write  # noqa: E402
from stats import over_seeds, paired  # noqa: E402

MODES = ("full fine-tuning", "LoRA")


def live_run(base: Path, mode: str, seed: int, steps: int, rank: int, lora_lr: float) -> dict[str, Any]:
    run_dir = base / f"{'lora' if mode == 'LoRA' else 'full'}-{seed}"
    sets = {"trainer.steps": steps, "eval.every": 20, "trainer.seed": seed}
    if mode == "LoRA":
        sets |= {"trainer.lora.rank": rank, "trainer.lora.alpha": 2 * rank, "trainer.lr": lora_lr}
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir),
           *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=3600)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    curve = sorted((int(v), r) for v, r in summary["held_out_reward"].items())
    pol = summary["policies"]["solver"]
    out = {"mode": mode, "seed": seed, "held_out_v0": summary["initial_reward"],
           "held_out_last5": round(statistics.mean(r for _, r in curve[-5:]), 4),
           "curve": [[v, r, summary["eval_at_s"][str(v)]] for v, r in curve], "wall_s": summary["wall_s"],
           "delta_bytes_mean": round(pol["delta_bytes_mean"]), "keyframe_bytes": pol["keyframe_bytes"],
           "step_s_median": round(statistics.median(r["step_s"] for r in rows if "step_s" in r), 4),
           "trainer_cpu_s_per_64": summary["cpu_s_per_64_samples"]["trainer-solver"]}
    print(json.dumps({k: v for k, v in out.items() if k != "curve"}), flush=True)
    return out


def at_time(run: dict[str, Any], t: float) -> float:
    """Held-out at the last evaluation made by ``t`` seconds into the run."""
    return max(((s, r) for _, r, s in run["curve"] if s <= t), default=(0.0, run["held_out_v0"]))[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lora-lr", type=float, default=1e-3)
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        for seed in range(a.seeds):
            pair = [live_run(Path(tmp), mode, seed, a.steps, a.rank, a.lora_lr) for mode in MODES]
            t = min(r["curve"][-1][2] for r in pair)  # when the faster of the two made its last evaluation
            for r in pair:
                r["held_out_equal_time"] = at_time(r, t)
            runs += pair
    summary: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {key: list(vars(over_seeds([r[key] for r in mine])).values()) for key in ("held_out_last5", "held_out_equal_time")}
        summary[mode] |= {key: statistics.mean(r[key] for r in mine) for key in ("delta_bytes_mean", "step_s_median", "wall_s")}
    by = {m: [r for r in runs if r["mode"] == m] for m in MODES}  # LoRA minus full, seed by seed
    diff = {key: list(vars(paired([r[key] for r in by["LoRA"]], [r[key] for r in by[MODES[0]]])).values())
            for key in ("held_out_last5", "held_out_equal_time")}
    t = Table(title=f"LoRA (rank {a.rank}, lr {a.lora_lr:g}) against full fine-tuning, {a.steps} steps, {a.seeds} seeds")
    for c in ("mode", "held-out, last 5", "at equal wall time", "bytes per version", "step", "wall"):
        t.add_column(c)
    for mode, s_ in summary.items():
        t.add_row(mode, f"{s_['held_out_last5'][0]:.3f} ± {s_['held_out_last5'][1]:.3f}",
                  f"{s_['held_out_equal_time'][0]:.3f} ± {s_['held_out_equal_time'][1]:.3f}", f"{s_['delta_bytes_mean'] / 1024:.1f} KiB",
                  f"{1e3 * s_['step_s_median']:.1f} ms", f"{s_['wall_s']:.0f} s")
    t.add_row("LoRA − full, paired", f"{diff['held_out_last5'][0]:+.3f} ± {diff['held_out_last5'][1]:.3f}",
              f"{diff['held_out_equal_time'][0]:+.3f} ± {diff['held_out_equal_time'][1]:.3f}", "", "", "")
    Console().print(t)
    write("lora", {"steps": a.steps, "rank": a.rank, "lora_lr": a.lora_lr, "seeds": a.seeds, "runs": runs, "summary": summary,
                   "lora_minus_full": diff})


if __name__ == "__main__":
    main()
