"""Exact resume with a checkpoint every version: SIGKILL the trainer process at crash points of its loop
and at an arbitrary moment, restart it from its checkpoint directory, and check what the plane recorded.
Group commit (a checkpoint every K > 1 versions, replay on restart): tests/test_group_commit.py."""

from __future__ import annotations

import signal

import pytest
from test_train_support import (
    VersionHolder,
    check_exact,
    check_record,
    planned_run,
    spawn_trainer,
    wait_exit,
    write_recipe,
)

from astraflow.streams.state import DoneRecord
from astraflow.weights.sync import WeightSync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # real trainer processes


async def test_kill_at_every_crash_point_resumes_exactly(nats_server, run_id, tmp_path):
    steps = 8
    recipe_file, recipe = write_recipe(tmp_path / "recipe.yaml", steps=steps, checkpoint_every=1)
    plane, anns, batches = await planned_run(nats_server.url, run_id, recipe, steps)
    ckpt, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    try:
        # a crash between step and checkpoint, checkpoint and publish, publish and ack (after the ack:
        # tests/test_train_resume_sparse.py), then a kill from outside at whatever point it lands
        for crash in ("after_checkpoint@2", "after_publish@3", "after_step@5"):
            proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash=crash)
            assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt)
        await anns.wait("solver", 6)
        proc.kill()
        await wait_exit(proc)
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt)
        assert await wait_exit(proc) == 0, log.read_text()[-3000:]

        assert (await plane.state.get(DoneRecord, "solver")).version == steps
        record = await anns.settle("solver", steps)
        check_record(record, batches, steps)
        assert "was trained before the restart" in log.read_text()  # the redelivered batches were acked untrained

        check_exact(recipe, "solver", record, batches)  # an uninterrupted run in the announced order gives every digest

        # and a late joiner can follow the whole chain across the restarts (deltas onto exact bases)
        holder = VersionHolder()
        await WeightSync(plane, "solver", holder).goto(steps)
        assert holder.version == steps
    finally:
        if proc.poll() is None:
            proc.kill()
        await anns.close()
        await plane.close()

