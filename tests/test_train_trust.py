"""The trainer at its trust boundary, as a real process on a real nats-server: it trains only
the batches the dataflow planned, fetches the trajectories a manifest names and turns the batch
away when one is gone or is another than named, turns away values it cannot train and batches
gone stale, skips a non-finite step, and never reuses a version number: without its checkpoints it
refuses to start behind the plane, and ``--fresh-lineage`` starts a new lineage after the newest version."""

from __future__ import annotations

import nats
import numpy as np
import pytest
from test_train_support import Announcements, VersionHolder, on_stream, plan_of, publish_batches, spawn_trainer, wait_exit, write_recipe

from astraflow.models import build_model, load_tokenizer
from astraflow.streams.messages import Rejected
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.state import VersionRecord
from astraflow.streams.trajectories import TrainingBatch
from astraflow.tasks import load_split
from astraflow.train.synthetic import sample_batches
from astraflow.weights.sync import WeightSync

pytestmark = pytest.mark.timeout(300)


def batches_of(recipe, prefix: str, version: int, n: int = 1, seed: int = 0) -> list[TrainingBatch]:
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    train, _ = load_split(recipe.data)
    return sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:8]], n_batches=n, groups_per_batch=2,
                          group_size=2, max_new_tokens=4, seed=seed, prefix=prefix, version=version)


def with_advantages(b: TrainingBatch, value: float) -> TrainingBatch:
    return TrainingBatch(b.manifest.model_copy(update={"advantages": np.full(len(b.trajectories), value, "<f4").tobytes()}),
                         b.trajectories)


async def test_only_planned_sound_fresh_batches_are_trained_and_versions_are_never_reused(nats_server, run_id, tmp_path):
    # allowed lag: max_staleness 0 + max_batch_backlog 1 = 1 version
    recipe_file, recipe = write_recipe(tmp_path / "recipe.yaml", steps=3, max_staleness=0, max_batch_backlog=1)
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "test")
    await plane.ensure_topology(recipe.topology())
    anns = await Announcements(plane).start()
    (g1,), (g2,), (g3,) = (batches_of(recipe, f"g{k}", version=k - 1, seed=k) for k in (1, 2, 3))
    (unplanned,), (forged,), (nan_adv,), (oob,), (gone,), (other,), (huge,), (stale,) = (
        batches_of(recipe, p, version=v, seed=10 + i)
        for i, (p, v) in enumerate([("u", 0), ("f", 0), ("n", 0), ("o", 0), ("m", 0), ("x", 0), ("h", 1), ("s", 0)]))
    nan_adv = with_advantages(nan_adv, float("nan"))
    out_of_vocab = oob.trajectories[0].model_copy(update={"completion_ids": np.array([5, 10**6], "<i4").tobytes(),
                                                          "logprobs": np.zeros(2, "<f4").tobytes(),
                                                          "versions": np.zeros(2, "<i4").tobytes(),
                                                          "loss_mask": np.ones(2, "<u1").tobytes()})
    oob = TrainingBatch(oob.manifest, [out_of_vocab, *oob.trajectories[1:]])
    huge = with_advantages(huge, 3e38)  # finite, but the loss overflows: a non-finite step
    await publish_batches(plane, [unplanned], planned=False)
    forged = await on_stream(plane, forged)
    await plane.state.put(plan_of(forged.manifest))
    await plane.publish(plane.names.batch("solver"), with_advantages(forged, 2.0).manifest)  # another content under the planned id
    gone = await on_stream(plane, gone)  # its trajectories are on the stream ...
    nc = await nats.connect(nats_server.url)
    await nc.jsm().delete_msg(plane.names.traj_stream, gone.manifest.refs[1].seq)  # ... but one is gone when it is trained
    await nc.close()
    other = await on_stream(plane, other)  # the planned manifest names sequences holding others
    refs = [r.model_copy(update={"seq": r.seq + 1}) for r in other.manifest.refs]
    mismatch = TrainingBatch(other.manifest.model_copy(update={"refs": refs, "batch_id": "solver-x1"}), other.trajectories)
    await publish_batches(plane, [nan_adv, oob])
    for b in (gone, mismatch):  # planned as they are, published as they are
        await plane.state.put(plan_of(b.manifest))
        await plane.publish(plane.names.batch("solver"), b.manifest, b.batch_id)
    await publish_batches(plane, [g1, huge, g2, stale, g3])
    ckpt, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    try:
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", log, ckpt)
        assert await wait_exit(proc) == 0, log.read_text()[-3000:]
        record = await anns.settle("solver", 3)
        assert [a.version for a in record] == [0, 1, 2, 3]
        assert [a.batch_ids for a in record[1:]] == [[g1.batch_id], [g2.batch_id], [g3.batch_id]]
        lineage = record[0].lineage
        assert lineage and all(a.lineage == lineage for a in record)
        rejected = await plane.history(plane.names.dlq("batch"), Rejected)
        assert [r.code for r in rejected] == ["unplanned", "forged", "invalid", "invalid", "missing", "mismatch",
                                                             "non_finite", "stale"], [r.reason for r in rejected]
        assert "non-finite advantages" in rejected[2].reason and "token ids in [" in rejected[3].reason
        assert f"sequence(s) of {plane.names.traj_stream} are gone: {gone.manifest.refs[1].seq}" in rejected[4].reason
        held = next(t for r, t in zip(other.manifest.refs, other.trajectories, strict=True) if r.seq == refs[0].seq)  # a group's first
        assert f"sequence {refs[0].seq} holds {held.traj_id}" in rejected[5].reason
        assert "oldest token v0, trainer at v2" in rejected[7].reason
        holder = VersionHolder()
        await WeightSync(plane, "solver", holder).goto(3)  # every digest checks out: the skipped step changed nothing it announced
        assert holder.version == 3

        # without its checkpoints, a trainer refuses to start behind the plane
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", tmp_path / "bare.log")
        assert await wait_exit(proc) != 0
        assert "--fresh-lineage" in (tmp_path / "bare.log").read_text()

        # a fresh lineage starts after the newest version, beyond the allowed lag, and counts its steps from there
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", tmp_path / "fresh.log", tmp_path / "ckpt2", fresh_lineage=True)
        await anns.wait("solver", 5)
        await publish_batches(plane, [b for k in range(3) for b in batches_of(recipe, f"l{k}", version=5 + k, seed=20 + k)])
        assert await wait_exit(proc) == 0, (tmp_path / "fresh.log").read_text()[-3000:]
        record = await anns.settle("solver", 8)
        assert [a.version for a in record] == [0, 1, 2, 3, 5, 6, 7, 8]  # 3 + 1 + allowed lag 1: never a number twice
        fresh = record[4].lineage
        assert record[4].encoding == "keyframe" and fresh != lineage and all(a.lineage == fresh for a in record[4:])
        assert (await plane.state.get(VersionRecord, "solver")).lineage == fresh
        await WeightSync(plane, "solver", holder).goto(8)

        # the old lineage's checkpoints no longer resume: the plane moved on to another lineage
        proc = spawn_trainer(recipe_file, nats_server.url, run_id, "solver", tmp_path / "old.log", ckpt)
        assert await wait_exit(proc) != 0
        assert f"lineage {lineage}" in (tmp_path / "old.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        await anns.close()
        await plane.close()
