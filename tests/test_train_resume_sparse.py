"""checkpoint_every > 1 when the replay cannot reproduce the announced versions: the restart falls back to
the announced bf16 weights (on the optimizer state replayed so far), says the resume was approximate, and
still reuses no version, retrains no batch and announces nothing but what it announced."""

from __future__ import annotations

import signal

import pytest
from test_train_support import (
    VersionHolder,
    check_record,
    planned_run,
    spawn_trainer,
    wait_exit,
    write_recipe,
)

from astraflow.weights.sync import WeightSync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]  # real trainer processes


async def test_a_replay_that_differs_resumes_from_the_announced_weights(nats_server, run_id, tmp_path):
    """checkpoint_every: 3, killed after v4 was announced; restarted with another gradient clip, so the replayed
    versions hash to other digests than announced: the restart takes v4 back from the plane, warns, and its next
    delta applies onto v4."""
    steps = 6
    recipe_file, recipe = write_recipe(tmp_path / "recipe.yaml", steps=steps, checkpoint_every=3)
    plane, anns, batches = await planned_run(nats_server.url, run_id, recipe, steps, seed=1)
    ckpt, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    try:
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash="after_publish@4")
        assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        write_recipe(recipe_file, steps=steps, checkpoint_every=3, max_grad_norm=1e-3)  # clipped otherwise: no replay matches
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt)
        assert await wait_exit(proc) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "the resume is approximate" in text and "replayed hashes to" in text
        record = await anns.settle("solver", steps)
        check_record(record, batches, steps)  # no version twice, every batch once
        assert record[5].encoding == "delta" and record[5].base_digest == record[4].state_digest
        holder = VersionHolder()
        await WeightSync(plane, "solver", holder).goto(steps)
        assert holder.version == steps
    finally:
        if proc.poll() is None:
            proc.kill()
        await anns.close()
        await plane.close()
