"""Warm-start (SFT) time of a recipe on one torch thread against every usable core, side by side in one run.

Under ``astraflow up`` the warm start runs before version 0, while the nodes and the evaluator wait for it, so
``sft.threads: auto`` gives it every usable core (``trainer.threads`` is what the trainer keeps afterwards: one on
2 cores with 2 nodes and the evaluator). This measures what that buys: the recipe's own warm start (its model,
demonstrations, batch size and learning rate, cut to ``--steps``), once per thread count, from the same seed,
alternating the counts over ``--repeats`` rounds. Reports seconds per 100 steps and the last loss of each (the
losses differ only by the order of floating-point sums).

Run: ``python benchmarks/bench_warm_start.py [--recipe recipes/alfworld] [--steps 100] [--repeats 2]``.
Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from astraflow.config import Recipe, load_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.tasks import load_split
from astraflow.train.sft import sft
from astraflow.train.threads import usable_cores


def timed_warm_start(recipe: Recipe, steps: int, threads: int) -> tuple[float, float]:
    """(seconds, last loss) of the recipe's warm start cut to ``steps``, on ``threads`` torch threads."""
    policy = recipe.policies[recipe.primary]
    torch.set_num_threads(threads)
    torch.manual_seed(policy.trainer.seed)
    tokenizer = load_tokenizer(policy.model.tokenizer)
    model = build_model(policy.model, tokenizer)
    train, _ = load_split(recipe.data)
    t0 = time.perf_counter()
    loss = sft(model, tokenizer, train, policy.sft.model_copy(update={"steps": steps}), policy.trainer.seed)
    return time.perf_counter() - t0, loss


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="recipes/alfworld")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    counts = sorted({1, usable_cores()})
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    losses: dict[int, float] = {}
    recipe = load_recipe(args.recipe)
    for _ in range(args.repeats):
        for n in counts:
            s, losses[n] = timed_warm_start(recipe, args.steps, n)
            seconds[n].append(s)
    table = Table(title=f"warm start of {args.recipe}, {args.steps} steps, {args.repeats} rounds")
    for col in ("torch threads", "s per 100 steps (each round)", "speed-up", "last loss"):
        table.add_column(col)
    base = statistics.mean(seconds[1])
    for n in counts:
        per100 = [100 * s / args.steps for s in seconds[n]]
        table.add_row(str(n), ", ".join(f"{x:.1f}" for x in per100), f"{base / statistics.mean(seconds[n]):.2f}x", f"{losses[n]:.4f}")
    Console().print(table)
    out = {"recipe": args.recipe, "steps": args.steps, "seconds": {str(n): [round(s, 2) for s in v] for n, v in seconds.items()},
           "speedup": round(base / statistics.mean(seconds[counts[-1]]), 2), "last_loss": {str(n): round(v, 4) for n, v in losses.items()}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
