"""Async vs sync over seeds: ``bench_async_vs_sync.py``'s side-by-side run repeated on seeds 0..N-1, with intervals.

Each seed runs both modes of the pinned workload (see ``bench_async_vs_sync.py``) with ``model.seed`` =
``trainer.seed`` = seed, plus any ``--set a.b=value`` given (``--set data.max_operand=49 --set data.n_eval=500
--set eval.k=4`` for a held-out set that keeps improving and a small evaluation error; with ``--set sft.steps=700
--set policies.solver.sft.steps=700 --set sft.warmup_steps=400``, hard.yaml's warm start, which converges on every
seed measured: the bench's own 250 steps did not on seed 1). Figures, per mode, as
mean ± 95 % t-interval over seeds (benchmarks/stats.py): seconds per training step, held-out accuracy (avg@k when
``eval.k`` > 1, else greedy) at the last step (equal samples trained in both modes), and their paired differences (async - sync, per seed).
Run: ``python benchmarks/bench_async_vs_sync_seeds.py [--seeds 3] [--first-seed 0] [--steps 40]``. Last stdout line: JSON;
each seed's rows are also written to stderr as it finishes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_async_vs_sync as bench
from stats import over_seeds, paired

BASE_RECIPE = bench.recipe


def seeded(seed: int, overrides: list[str]) -> Callable[[str, int], dict[str, Any]]:
    """bench.recipe with the seed and the overrides applied (the bench builds its recipe by that name)."""

    def recipe(mode: str, steps: int) -> dict[str, Any]:
        r = BASE_RECIPE(mode, steps)
        for o in [f"model.seed={seed}", f"trainer.seed={seed}", *overrides]:
            key, sep, value = o.partition("=")
            if not sep:
                raise ValueError(f"--set {o!r}: expected a.b=value")
            *parents, leaf = key.split(".")
            node = r
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = yaml.safe_load(value)
        return r

    return recipe


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first..first+N-1 (split a campaign across processes)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=1500.0, help="per mode")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a.b=value for the recipe (repeatable)")
    args = ap.parse_args()
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        bench.recipe = seeded(seed, args.overrides)  # type: ignore[assignment]
        result = asyncio.run(bench.main(args.steps, args.timeout, ["async", "sync"], None, 1))  # one repeat of both modes
        runs.append({row["mode"]: row for row in result["rows"]})
        print(json.dumps({"seed": seed, "rows": result["rows"]}), file=sys.stderr, flush=True)  # kept if a later seed fails
    col = {m: {k: [r[m][k] for r in runs] for k in ("solver_s_per_step", "held_out_v0", "held_out_final")} for m in ("async", "sync")}
    speedup = over_seeds([s / a for a, s in zip(col["async"]["solver_s_per_step"], col["sync"]["solver_s_per_step"], strict=True)])
    gap = paired(col["async"]["held_out_final"], col["sync"]["held_out_final"]) if args.seeds > 1 else None
    t = Table(title=f"async vs sync, {args.steps} steps, {args.seeds} seeds: mean ± 95 % t-interval over seeds")
    for c in ("mode", "s/step (solver)", "held-out v0", f"held-out v{args.steps}"):
        t.add_column(c)
    for m, v in col.items():
        t.add_row(m, over_seeds(v["solver_s_per_step"]).fmt(2), over_seeds(v["held_out_v0"]).fmt(2), over_seeds(v["held_out_final"]).fmt(2))
    Console(width=150).print(t)
    Console().print(f"speed-up per step: {speedup.fmt(2)}; held-out async - sync (paired): "
                    + (gap.fmt(3) + (" (significant)" if gap.excludes_zero() else " (not significant)") if gap else "—"))
    return {"steps": args.steps, "seeds": args.seeds, "overrides": args.overrides, "per_mode": col,
            "speedup": [speedup.mean, speedup.half_width], "held_out_async_minus_sync": [gap.mean, gap.half_width] if gap else None,
            "runs": runs}


if __name__ == "__main__":
    print(json.dumps(main()))
