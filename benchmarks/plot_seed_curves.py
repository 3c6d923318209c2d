"""Held-out reward against version for several runs of one recipe (one per seed), with their mean and 95 % interval.

Reads each run directory's ``evals.jsonl`` (what ``bench_recipes.py --keep DIR`` leaves), plots every seed's curve
and, at the versions every run evaluated, the mean over seeds with its Student-t interval (``stats.over_seeds``).

    python benchmarks/plot_seed_curves.py RUN_DIR... --out benchmarks/figures/terminal-seeds.png --title terminal
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from astraflow.launch.rundir import RunDir  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import over_seeds  # noqa: E402


def curve(run_dir: Path, policy: str | None) -> dict[int, float]:
    """Version -> held-out reward of ``policy`` (default: the first policy evaluated)."""
    rows = list(RunDir(run_dir).rows("evals.jsonl"))  # the launcher's own reader: a torn last line is skipped
    policy = policy or rows[0]["policy"]
    return {int(r["version"]): float(r["reward"]) for r in rows if r["policy"] == policy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--policy", default=None)
    args = ap.parse_args()
    curves = {run.name: curve(run, args.policy) for run in args.runs}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in curves.items():
        vs = sorted(c)
        ax.plot(vs, [c[v] for v in vs], marker=".", alpha=0.45, label=name)
    common = sorted(set.intersection(*(set(c) for c in curves.values())))
    means = [over_seeds([c[v] for c in curves.values()]) for v in common]
    ax.plot(common, [m.mean for m in means], color="black", linewidth=2, label=f"mean of {len(curves)}")
    ax.fill_between(common, [m.low for m in means], [m.high for m in means], color="black", alpha=0.12, label="95 % t-interval")
    ax.set(xlabel="policy version (optimizer steps)", ylabel="held-out reward (greedy)", ylim=(0, 1), title=args.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"{args.out}: " + ", ".join(f"v{v} {m.fmt(2)}" for v, m in zip(common, means, strict=True)))


if __name__ == "__main__":
    main()
