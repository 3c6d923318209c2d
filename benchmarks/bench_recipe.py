"""Wall time of the CPU recipe to its learning bar, and held-out reward before / after.

Runs ``astraflow up recipes/arithmetic`` (embedded server, every role a process) and reads the
run's summary. The learning bar: held-out greedy reward at least ``--bar`` above version 0's.
Run: ``python benchmarks/bench_recipe.py [--steps 40]``. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--bar", type=float, default=0.15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "bench-arith"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir),
                        "--set", f"trainer.steps={args.steps}"], check=True)
        wall = time.perf_counter() - t0
        s = json.loads((run_dir / "summary.json").read_text())
    evals = {int(k): v for k, v in s["held_out_reward"].items()}
    at = {int(k): v for k, v in s["eval_at_s"].items()}
    bar = evals[0] + args.bar
    reached = [v for v in sorted(evals) if evals[v] >= bar]
    return {"steps": args.steps, "wall_s": round(wall, 1), "held_out_before": evals[0], "held_out_after": evals[args.steps],
            "bar": round(bar, 3), "bar_version": reached[0] if reached else None, "bar_wall_s": at[reached[0]] if reached else None,
            "v0_ready_s": at[0], "held_out": evals}


if __name__ == "__main__":
    print(json.dumps(main()))
