"""Two source trees measured side by side: each run in a child process that imports astraflow from its tree, the trees
taking turns (the order flipped every round, so neither always runs first on a machine that warms up or drifts)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

T = TypeVar("T")


def run_child(script: str, tree: Path, *args: str, env: Mapping[str, str] | None = None, cwd: str | None = None) -> Any:
    """``script --child *args`` with ``PYTHONPATH`` = ``tree``; its last stdout line, parsed as JSON. A result that names
    the tree it imported astraflow from (``{"tree": {"path": ...}}``) is checked against ``tree`` and the entry dropped."""
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, script, "--child", *args], env=child_env, capture_output=True, text=True,
                          check=True, cwd=cwd)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(got, dict) and "tree" in got and Path(str(got.pop("tree")["path"])) != tree.resolve():
        raise SystemExit(f"the child did not import astraflow from {tree}")
    return got


def take_turns(trees: Mapping[str, Path], rounds: int, run: Callable[[Path], T]) -> dict[str, list[T]]:
    """``run(tree)`` for each tree, ``rounds`` times, the order flipped every round; each side's results in round order."""
    runs: dict[str, list[T]] = {side: [] for side in trees}
    for r in range(rounds):
        for side in (list(trees) if r % 2 == 0 else list(reversed(list(trees)))):
            runs[side].append(run(trees[side]))
    return runs


def medians_side_by_side(script: str, before: Path, after: Path, rounds: int, repeats: int, cases: Iterable[str],
                         same: str, title: str, label: str, size: str | None = None) -> dict[str, object]:
    """``script``'s child (``--child --repeats N``: per case a median ``ms``, the ``same`` value every tree must give, and
    optionally a ``size``) in both trees taking turns; per case the median over rounds, and each round's, in a table
    (stderr) and a record under ``label``."""
    runs: dict[str, list[dict[str, dict[str, Any]]]] = take_turns(
        {"before": before, "after": after}, rounds, lambda tree: run_child(script, tree, "--repeats", str(repeats)))
    record: dict[str, dict[str, object]] = {}
    table = Table(title=title)
    for col in (label, *([size] if size else []), "before", "after", "by round (before / after)"):
        table.add_column(col)
    for case in cases:
        if len({run[case][same] for side in runs.values() for run in side}) != 1:
            raise SystemExit(f"{case}: the trees differ in {same}")
        ms = {side: [float(run[case]["ms"]) for run in runs[side]] for side in runs}
        med = {side: statistics.median(v) for side, v in ms.items()}
        record[case] = {**({size: runs["after"][0][case][size]} if size else {}), "before_ms": round(med["before"], 3),
                        "after_ms": round(med["after"], 3), "by_round": {k: [round(x, 3) for x in v] for k, v in ms.items()}}
        table.add_row(case, *([str(runs["after"][0][case][size])] if size else []), f"{med['before']:.2f}", f"{med['after']:.2f}",
                      " ".join(f"{x:.2f}" for x in ms["before"]) + " / " + " ".join(f"{x:.2f}" for x in ms["after"]))
    Console(stderr=True).print(table)
    return {"rounds": rounds, "repeats": repeats, label: record}


def cli(doc: str, child: Callable[[int], object], compare: Callable[[Path, int, int], object]) -> None:
    """The command line of a benchmark built on :func:`medians_side_by_side`: ``--before TREE [--rounds] [--repeats]``;
    the last stdout line is its JSON record."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="the source tree to compare with (git archive COMMIT | tar -x -C TREE)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.repeats)))
    elif args.before is None:
        ap.error("--before TREE is required")
    else:
        print(json.dumps(compare(args.before, args.rounds, args.repeats)))
