"""A live ``astraflow up recipes/arithmetic`` run with a hostile node among its own: it holds the run's rollout credential
and answers real tasks with well-formed lies (``tests/hostile.py``). The run finishes, every lie is refused with the
claim it broke and never trained, no honest trajectory is refused, and the accounting adds up.
``benchmarks/bench_hostile_node.py`` runs it longer and measures held-out against clean runs."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from pathlib import Path

import pytest
from hostile import CLAIMS, Lies, attack
from poison_run import secured_server, start_up, versions

from astraflow.config import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def recipe_group_size(run_dir: Path) -> int:
    return load_recipe(run_dir / "recipe.yaml").dataflow.group_size


def test_a_lying_node_is_refused_and_the_run_goes_on(tmp_path: Path):
    run = "hostile" + uuid.uuid4().hex[:6]
    run_dir = tmp_path / run
    server, cred_dir = secured_server(tmp_path, run)
    steps = 30
    up = start_up(run_dir, server.url, cred_dir, {"trainer.steps": steps, "eval.every": steps}, tmp_path / "up.log", timeout=600)
    lies = Lies()
    try:
        fates = asyncio.run(attack(up, run_dir, cred_dir, run, 12.0, lies, timeout=400))
        assert up.wait(timeout=60) == 0, (tmp_path / "up.log").read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        server.stop()
    kinds = Counter(lies.told.values())
    assert set(kinds) == set(CLAIMS) | {"logprobs"} and lies.given_back, lies
    broken = {t: kind for t, kind in lies.told.items() if kind in CLAIMS}
    assert {t: fates[t] for t in broken} == {t: CLAIMS[kind] for t, kind in broken.items()}  # every claim lie, by its claim
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]["solver"]
    refused = Counter({f: n for f, n in acc["fates"].items() if f.startswith("invalid:")})
    assert refused == Counter(CLAIMS[kind] for kind in broken.values())  # no honest trajectory refused
    assert acc["adds_up"] and versions(run_dir) == list(range(steps + 1))
    # made-up logprobs pass the dataflow; the trainer leaves out the rows whose tokens the model contradicts: at least the
    # random letters (half of each such group), never more than the liar sent
    suspects = sum(r.get("suspect_trajectories", 0) for r in metrics(run_dir))
    trained_lies = sum(1 for t, kind in lies.told.items() if kind == "logprobs" and fates[t] == "trained")
    g = recipe_group_size(run_dir)
    assert trained_lies > 0 and trained_lies * (g // 2) <= suspects <= trained_lies * g, (suspects, trained_lies)
