"""The poison suite on a live run: ``astraflow up recipes/arithmetic`` (real roles as processes, an
authenticated server) while two attackers inject property-generated poisons of every message type
(``tests/poison_run.py``): one with the rollout credential any node is given, one with the admin
credential, whose messages only the consumers' own checks can stop. Plus two scenarios: a batch held by
a trainer that dies, redelivered long after (dropped as stale, counted), and a second trainer started
without its checkpoints (it refuses, announcing nothing).

The run must finish with no role restarted, every version announced exactly once, held-out reward
within the noise of clean runs, every poison in the DLQ with the reason its check gives, and the
task accounting adding up. ``benchmarks/bench_poison.py`` runs a longer campaign and prints the table.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from poison_run import (
    Campaign,
    admin_attack,
    connect,
    finite_summary,
    rollout_attack,
    secured_server,
    stale_rejection,
    start_up,
    steal_a_batch,
    until,
    verdict,
    versions,
)

from astraflow.config import load_recipe
from astraflow.streams.messages import Rejected

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 150
PER_FIELD = 2  # poisons per field and attacker (seeded: the same ones every run)
# every poison judged by its own check: a node past dataflow.quarantine_after would have the rest refused as quarantined
# (tests/test_hostile_node.py)
# the stolen batch comes back batch_ack_wait after the theft (at v3 or later): long enough for the trainer to be more than
# allowed_lag (4) versions on at two steps a second, short enough that an unloaded run (about 15 steps a second) is still going
SETS = {"trainer.steps": STEPS, "eval.every": STEPS, "plane.batch_ack_wait": 6, "dataflow.quarantine_after": 0}
# held-out reward (greedy, 100 prompts) at v150 of 9 clean runs of this set-up: 0.64-0.85, mean 0.74, standard deviation
# 0.06 (BENCHMARKS.md, "Poison suite"); 0.35 at v0. The floor sits under the mean less 4 standard deviations (0.52): noise
# does not break it, and a run poisoned into not learning stays near v0's, below it
HELD_OUT_FLOOR = 0.50


def test_a_live_run_under_poison_finishes_learns_and_dead_letters_every_poison(tmp_path: Path):
    run = "poison" + uuid.uuid4().hex[:6]
    run_dir = tmp_path / run
    server, cred_dir = secured_server(tmp_path, run)
    log = tmp_path / "up.log"
    up = start_up(run_dir, server.url, cred_dir, SETS, log)
    camp = Campaign()
    try:
        async def attack() -> None:
            async def training() -> bool:
                return len(versions(run_dir)) >= 3

            await until(training, "training to start", 400)
            recipe = load_recipe(run_dir / "recipe.yaml")
            await steal_a_batch(cred_dir, run, recipe, camp)
            await asyncio.gather(rollout_attack(cred_dir, run, recipe, PER_FIELD, 1, camp),
                                 admin_attack(cred_dir, run, recipe, run_dir, PER_FIELD, 2, camp))

        asyncio.run(attack())
        assert up.wait(timeout=600) == 0, log.read_text()[-4000:]
        judged = asyncio.run(verdict(cred_dir, run, camp))

        async def dlq_batches() -> list[Rejected]:
            plane = await connect(cred_dir, "admin", run)
            try:
                return await plane.history(plane.names.dlq("batch"), Rejected)
            finally:
                await plane.close()

        rejected_batches = asyncio.run(dlq_batches())
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        server.stop()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["restarts"] == {}, summary

    # every poison dead-lettered by its consumer's check, with the reason it gives
    assert judged.missed == [], "\n".join(judged.missed)
    assert sum(judged.tried.values()) >= 40 and judged.caught == judged.tried
    assert camp.denied and all(camp.denied.values()), camp.denied  # what the rollout credential may not do, it cannot
    assert versions(run_dir) == list(range(STEPS + 1))  # each version once: no forged one recorded, none announced twice
    assert finite_summary(summary)

    # the scenarios
    code, out = camp.rogue_trainer
    assert code != 0 and "--fresh-lineage" in out, out
    reason = stale_rejection(rejected_batches, camp.stolen_batch)
    assert reason is not None and reason.startswith("stale: "), (camp.stolen_batch, reason)

    # the accounting adds up and counts what the poison cost
    acc = summary["accounting"]["solver"]
    assert acc["adds_up"] and acc["total"] == acc["in_flight"] + acc["buffered"] + acc["awaiting"] + sum(acc["fates"].values())
    fates = acc["fates"]
    settled = sum(p.kind == "trajectory" and p.field not in ("task_id", "policy") for p in camp.poisons)
    assert sum(v for k, v in fates.items() if k.startswith("invalid:")) == settled, fates
    assert fates.get("failed:rollout", 0) >= camp.gave_up + 1, fates
    assert fates.get("dropped:stale", 0) >= load_recipe(run_dir / "recipe.yaml").dataflow.groups_per_batch, fates

    # and it still learns as a clean run does
    assert summary["final_reward"] >= HELD_OUT_FLOOR, summary["held_out_reward"]
