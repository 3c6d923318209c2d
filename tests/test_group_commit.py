"""Group commit: a checkpoint every K versions written in the background, batch acks held until a durable
checkpoint covers them, and a restart that replays the announced batches after its checkpoint. SIGKILL the
trainer at the group-commit crash points (after the snapshot, in the middle of the background write, between
the held acks, after an announcement past the checkpoint) and check that the resume is exact."""

from __future__ import annotations

import re
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

from astraflow.streams.messages import Batch, WeightVersion
from astraflow.streams.objects import object_stream
from astraflow.streams.state import DoneRecord
from astraflow.weights.sync import WeightSync

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # real trainer processes


@pytest.mark.parametrize("publish", ["inline", "behind"])  # inline: the default on CPU; behind: on an accelerator
async def test_kills_at_the_group_commit_points_resume_exactly(nats_server, run_id, tmp_path, publish):
    steps, every = 14, 3
    recipe_file, recipe = write_recipe(tmp_path / "recipe.yaml", steps=steps, checkpoint_every=every, publish=publish)
    plane, anns, batches = await planned_run(nats_server.url, run_id, recipe, steps, seed=2)
    ckpt, log = tmp_path / "ckpt", tmp_path / "trainer.log"

    async def unannounced_chunks() -> set[str]:
        """Object ids holding chunks that no announcement on the plane names (a payload stored, never announced)."""
        bucket = plane.names.object_bucket
        info = await plane._jsm.stream_info(object_stream(bucket), subjects_filter=f"$O.{bucket}.C.>")
        named = {ref.nuid for a in await plane.history(plane.names.weights("solver"), WeightVersion) for ref in a.objects}
        return {subject.rsplit(".", 1)[-1] for subject in info.state.subjects or {}} - named

    async def unacked() -> set[str]:
        return {b.batch_id for _, b in await plane.stored.held(plane.names.batch_stream, plane.names.batch("solver"), Batch)}

    try:
        # v1, v2 announced, the snapshot of v3 taken, nothing written: v0 is the only checkpoint, and the batches
        # of v1 and v2 are still in the BATCH stream (held, unacked)
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash="after_snapshot@3")
        assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        assert sorted(p.name for p in ckpt.glob("v*")) == ["v00000000"]
        assert {b for a in anns.of("solver")[1:] for b in a.batch_ids} <= await unacked()
        assert [a.version for a in anns.of("solver")] == [0, 1, 2]

        # killed in the middle of writing v6 in the background: the half-written directory is never taken
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash="during_checkpoint_write@6")
        assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        assert (ckpt / ".tmp-v00000006").is_dir() and not (ckpt / "v00000006").exists()
        assert "replayed v1..v2 onto checkpoint v0" in log.read_text()

        # checkpoint v9 durable, killed after acking the batch of v7 and before those of v8, v9
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash="between_acks@7")
        assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        assert not (ckpt / ".tmp-v00000006").exists() and (ckpt / "v00000009").is_dir()
        assert anns.of("solver")[7].batch_ids[0] not in await unacked()  # acked: the durable v9 holds it
        assert {anns.of("solver")[v].batch_ids[0] for v in (8, 9)} <= await unacked()

        # how far that life got depends on when the write of v9 ended (at the latest, the snapshot of v12 waits for it
        # and acks what it made durable): v9, v10 or v11 is the last announced
        last = max(a.version for a in await plane.history(plane.names.weights("solver"), WeightVersion))
        assert 9 <= last <= 11, last

        # killed while the next publish is in flight (its payload stored, not announced; behind: the loop gone on to
        # the next batch): nothing of it is announced, its batch is still in the stream, and the next life trains it again
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash=f"before_announce@{last + 1}")
        assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        on_plane = await plane.history(plane.names.weights("solver"), WeightVersion)
        # (the restart replayed up to v{last} and checkpointed it; v{last + 1}'s own checkpoint may be durable too, if its
        # write ended before the kill: the two newest are kept, so v9 may be gone by now)
        assert [a.version for a in on_plane] == list(range(last + 1)) and max(int(p.name[1:]) for p in ckpt.glob("v*")) >= last
        assert {b.batch_id for b in batches} - {b for a in on_plane for b in a.batch_ids} <= await unacked()  # its too
        assert len(await unannounced_chunks()) == 1  # its payload, stored before the kill

        # announced past the last checkpoint, then killed; the last life replays up to it and finishes. Not at a checkpoint
        # version: its snapshot is taken before its publish, and the write may end before the announcement (nothing to replay)
        killed_at = last + 2 if (last + 2) % every else last + 3
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt, crash=f"after_publish@{killed_at}")
        assert await wait_exit(proc) == -signal.SIGKILL, log.read_text()[-3000:]
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt)
        assert await wait_exit(proc) == 0, log.read_text()[-3000:]

        text = log.read_text()
        assert "approximate" not in text and re.search(rf"replayed v\d+\.\.v{killed_at} onto checkpoint v\d+:", text)
        assert "stored and never announced" in text and await unannounced_chunks() == set()  # swept by the next life
        assert (await plane.state.get(DoneRecord, "solver")).version == steps
        record = await anns.settle("solver", steps)
        check_record(record, batches, steps)  # every version announced once, every batch in exactly one version
        check_exact(recipe, "solver", record, batches)  # the weights are those of one uninterrupted run
        assert record[steps].batch_ids[0] not in await unacked()  # the last life made its end durable and acked it
        holder = VersionHolder()
        await WeightSync(plane, "solver", holder).goto(steps)
        assert holder.version == steps
    finally:
        if proc.poll() is None:
            proc.kill()
        await anns.close()
        await plane.close()
