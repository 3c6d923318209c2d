"""checkpoint_every > 1: a trainer killed after announcing versions past its last checkpoint
resumes from the announced weights, reusing no version and retraining no batch."""

from __future__ import annotations

import signal

import pytest
from test_train_support import (
    Announcements,
    VersionHolder,
    check_record,
    make_batches,
    publish_batches,
    spawn_trainer,
    wait_exit,
    write_recipe,
)

from astraflow.streams.plane import NatsOptions, Plane
from astraflow.weights.sync import WeightSync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]  # real trainer processes


async def test_sparse_checkpoints_resume_from_the_announced_weights(nats_server, run_id, tmp_path):
    """checkpoint_every: 3, killed after v4 was announced and acked: the restart takes v4 back from
    the plane (no version reused, no batch retrained) and its next delta applies onto v4."""
    steps = 5
    recipe_file, recipe = write_recipe(tmp_path / "recipe.yaml", steps=steps, checkpoint_every=3)
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "test")
    await plane.ensure_topology(recipe.topology())
    anns = await Announcements(plane).start()
    batches = make_batches(recipe, "solver", steps, seed=1)
    await publish_batches(plane, batches)
    ckpt, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    try:
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash="after_ack@4")
        assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        assert sorted(p.name for p in ckpt.glob("v*")) == ["v00000000", "v00000003"]
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt)
        assert await wait_exit(proc) == 0, log.read_text()[-3000:]
        record = await anns.settle("solver", steps)
        check_record(record, batches, steps)
        assert record[5].encoding == "delta" and record[5].base_digest == record[4].state_digest
        holder = VersionHolder()
        await WeightSync(plane, "solver", holder).goto(steps)
        assert holder.version == steps
    finally:
        if proc.poll() is None:
            proc.kill()
        await anns.close()
        await plane.close()
