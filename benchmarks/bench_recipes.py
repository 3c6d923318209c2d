"""Wall time and final held-out reward of every CPU recipe, as shipped (or with --steps N).

Runs ``astraflow up recipes/NAME`` for each recipe (embedded server, every role a process) and
reads its summary. Run: ``python benchmarks/bench_recipes.py [--only math,code] [--steps N]``.
Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ["arithmetic", "math", "math-multi-agent", "math-efficient-data", "code", "code-multi-agent", "search", "alfworld", "webshop"]


def run(name: str, steps: int | None, base: Path) -> dict[str, object]:
    run_dir = base / name
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / name), "--run-dir", str(run_dir)]
    if steps:
        cmd += ["--set", f"trainer.steps={steps}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        return {"recipe": name, "ok": False, "wall_s": round(wall, 1), "error": proc.stderr[-300:]}
    s = json.loads((run_dir / "summary.json").read_text())
    return {"recipe": name, "ok": True, "wall_s": round(wall, 1), "policies": list(s["policies"]), "eval_policy": s["eval_policy"],
            "steps": s["policies"][s["eval_policy"]]["steps"], "held_out_initial": s["initial_reward"], "held_out_final": s["final_reward"]}


def main() -> list[dict[str, object]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        results = [run(n, args.steps, Path(d)) for n in args.only.split(",")]
    t = Table(title="CPU recipes: wall time and held-out reward (greedy)")
    for c in ("recipe", "steps", "wall s", "held-out v0", "held-out final"):
        t.add_column(c)
    for r in results:
        t.add_row(str(r["recipe"]), str(r.get("steps", "—")), str(r["wall_s"]), str(r.get("held_out_initial", "failed")), str(r.get("held_out_final", "—")))
    Console().print(t)
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
