"""Two source trees measured side by side: each run in a child process that imports astraflow from its tree, the trees
taking turns (the order flipped every round, so neither always runs first on a machine that warms up or drifts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

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
