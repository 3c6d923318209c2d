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
from hostile import Lies, fates_of, hostile_node
from poison_run import secured_server, start_up, until, versions

from astraflow.config import load_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REFUSED_AS = {"reward": "invalid:reward_claim", "prompt": "invalid:prompt_claim", "range": "invalid:reward_range"}


def test_a_lying_node_is_refused_and_the_run_goes_on(tmp_path: Path):
    run = "hostile" + uuid.uuid4().hex[:6]
    run_dir = tmp_path / run
    server, cred_dir = secured_server(tmp_path, run)
    steps = 30
    up = start_up(run_dir, server.url, cred_dir, {"trainer.steps": steps, "eval.every": steps}, tmp_path / "up.log", timeout=600)
    lies = Lies()
    try:
        async def attack() -> dict[str, str]:
            async def training() -> bool:
                return len(versions(run_dir)) >= 2

            async def finished() -> bool:
                return up.poll() is not None

            await until(training, "training to start", 300)
            await hostile_node(cred_dir, run, load_recipe(run_dir / "recipe.yaml"), 12.0, lies)
            await until(finished, "the run to finish", 400)
            return await fates_of(cred_dir, run, "solver", list(lies.told))

        fates = asyncio.run(attack())
        assert up.wait(timeout=60) == 0, (tmp_path / "up.log").read_text()[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        server.stop()
    assert set(lies.told.values()) == set(REFUSED_AS) and lies.given_back, lies
    assert {t: fates[t] for t in lies.told} == {t: REFUSED_AS[kind] for t, kind in lies.told.items()}  # every lie, by its claim
    summary = json.loads((run_dir / "summary.json").read_text())
    acc = summary["accounting"]["solver"]
    refused = Counter({f: n for f, n in acc["fates"].items() if f.startswith("invalid:")})
    assert refused == Counter(REFUSED_AS[kind] for kind in lies.told.values())  # no honest trajectory refused
    assert acc["adds_up"] and versions(run_dir) == list(range(steps + 1))
