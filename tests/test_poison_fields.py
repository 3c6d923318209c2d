"""The poison sweep, field by field, at service level against a real nats-server: for every message
type a node or a leaked credential can put on the plane, each field set to well-formed but wrong
values (``tests/poison.py``: property-generated from a real message, a bounded seeded sample per
field). Each poisoned message reaches the DLQ with the reason its consumer's check gives (the codec's,
for a value outside the wire's range), its task gets a counted fate, and the consumer keeps serving.
``tests/test_poison.py`` injects the same poisons into a live ``astraflow up`` run."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from poison import (
    Poison,
    RunView,
    draw_each,
    nth,
    plan_record,
    poisoned_announcements,
    poisoned_batches,
    poisoned_heartbeats,
    poisoned_keyframe_requests,
    poisoned_tasks,
    poisoned_trajectories,
    publish_copies,
    published_at,
)
from test_dataflow import Harness, recipe
from test_dataflow_trust import good
from weights_helpers import Trainer, engine_digest, node

from astraflow.config import parse_recipe
from astraflow.dataflow.pool import PoolAdvisor
from astraflow.launch.rundir import RunDir
from astraflow.launch.watcher import RunWatcher
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.evaluator import evaluated
from astraflow.rollout.node import RolloutNode
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.single_turn import SingleTurn
from astraflow.streams.codec import DecodeError, decode, encode
from astraflow.streams.direct import MissingMessages
from astraflow.streams.messages import Batch, BatchRefusal, Rejected, Task, Trajectory
from astraflow.streams.plane import Plane
from astraflow.streams.state import AutoscaleRecord, EvalRecord, FateRecord
from astraflow.streams.trajectories import (
    PayloadUnavailable,
    TrainingBatch,
    carried,
    fetch_trajectories,
    grouped,
    publish_trajectories,
)
from astraflow.streams.trajectory_log import TrajectoryLog
from astraflow.tasks import load_split
from astraflow.train.backend import build_backend
from astraflow.train.synthetic import sample_batches
from astraflow.train.vetting import check_batch, check_manifest, check_plan
from astraflow.weights.publish import WeightPublisher

PER_FIELD = 3  # examples per field: bounded and seeded (the campaign in benchmarks/bench_poison.py draws more)


async def dead_letters(plane: Plane, kind: str) -> dict[bytes, list[str]]:
    """The DLQ entries of ``dlq.{kind}``: original bytes -> the reasons given."""
    out: dict[bytes, list[str]] = {}
    for r in await plane.history(plane.names.dlq(kind), Rejected):
        out.setdefault(r.payload, []).append(r.reason)
    return out


def missed(poisons: list[Poison], dlq: dict[bytes, list[str]]) -> list[str]:
    """Poisons not dead-lettered with the reason their check gives (empty: all were)."""
    return [f"{p.name} ({p.label}): {dlq.get(p.payload)}" for p in poisons
            if not any(p.named_by(r) for r in dlq.get(p.payload, []))]


# ------------------------------------------------------------------------------------------- trajectories
@pytest.fixture
async def harness(nats_server, run_id):
    h = await Harness(nats_server.url, run_id, recipe(max_staleness=40, max_tasks_in_flight=80)).start()
    yield h
    await h.close()


async def test_every_poisoned_trajectory_is_dead_lettered_by_its_check_and_the_dataflow_goes_on(harness: Harness):
    h = harness
    await h.turn(2)
    got = await h.task_sub.pull(batch=80, timeout=1)
    tasks = [d.msg for d in got]
    view = RunView(vocab=384, group_size=2, max_new_tokens=h.recipe.rollout.max_new_tokens, context=64, newest=0)
    n = PER_FIELD * len(poisoned_trajectories(good(tasks[0], "solver", 0, 0), view))
    assert n <= len(tasks)  # one poison per real task (a settled task's later copies are judged only as copies)
    poisons = [nth(poisoned_trajectories(good(t, "solver", 0, 0), view), i, 1, PER_FIELD) for i, t in enumerate(tasks[:n])]
    await h.node.publish_many([(h.node.names.traj(p.msg.policy), p.msg, None) for p in poisons])  # type: ignore[union-attr]
    for d in got:
        await d.ack()
    for _ in range(60):
        await h.turn()
        if sum(h.df.stats[k] for k in h.df.stats if k.startswith("invalid.")) >= len(poisons):
            break
    await h.turn(2)
    dlq = await dead_letters(h.node, "traj")
    assert missed(poisons, dlq) == []
    # every poison claiming a task the dataflow waits on settles it, those the codec turns away (an index or group size
    # outside the wire's range: the consumer dead-letters them undecoded) too: the dataflow reads their ids back from dlq.traj
    settled = {p.msg.task_id for p in poisons if p.expect not in ("invalid task", "invalid policy")}  # type: ignore[union-attr]
    undecoded = {p.msg.task_id for p in poisons if any(r.startswith("invalid trajectory:") for r in dlq[p.payload])}  # type: ignore[union-attr]
    acc = h.acc()
    assert acc.adds_up and sum(v for k, v in acc.fates.items() if k.startswith("invalid:")) == len(settled)
    assert undecoded and acc.fates.get("invalid:schema") == len(undecoded), acc.fates
    checked = await h.plane.state.get(FateRecord, "solver", sorted(settled - undecoded)[0])
    undecodable = await h.plane.state.get(FateRecord, "solver", sorted(undecoded)[0])
    assert checked is not None and checked.fate.startswith("invalid:") and checked.fate != "invalid:schema"
    assert undecodable is not None and undecodable.fate == "invalid:schema"
    for _ in range(3):  # the dataflow keeps issuing, batching and training
        await h.turn(2)
        await h.rollout()
        await h.turn(2)
        await h.train("solver")
    assert len(h.batches["solver"]) >= 2 and h.acc().adds_up
    assert not settled & {t for b in h.batches["solver"] for t in b.task_ids}


# ------------------------------------------------------------------------------------------- tasks
TOK = load_tokenizer("byt5")


async def test_every_poisoned_task_is_dead_lettered_by_the_node_which_serves_the_good_ones(plane: Plane):
    r = parse_recipe({"name": "p", "rollout": {"tasks_per_generate": 4, "max_new_tokens": 4}, "dataflow": {"group_size": 2}})
    await WeightPublisher(plane, "solver").publish({"w": torch.zeros(4)}, 0, force_keyframe=True)
    handles = {"solver": PolicyHandle(ScriptEngine(TOK, lambda p: "4", version=-1), TOK, SamplingParams(max_new_tokens=4), name="solver")}
    node = RolloutNode(r, plane, "n1", handles=handles, workflow=SingleTurn(get_reward("arithmetic")))
    base = Task(task_id="b0", workflow="single_turn", policy="solver", prompt_id="p", prompt="2+2=", group_size=2, meta={"answer": "4"},
                min_versions={"solver": 0})
    fields = poisoned_tasks(base, RunView(384, 2, 4, 64, 0))
    poisons = [nth(poisoned_tasks(base.model_copy(update={"task_id": f"q{i}"}), RunView(384, 2, 4, 64, 0)), i, 2, PER_FIELD)
               for i in range(PER_FIELD * len(fields))]
    goods = [base.model_copy(update={"task_id": f"g{i}"}) for i in range(3)]
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))
    try:
        items = [(plane.names.task(getattr(p.msg, "workflow", "single_turn")), p.msg, None) for p in poisons]
        await plane.publish_many([*items[: len(items) // 2], *((plane.names.task("single_turn"), g, None) for g in goods),
                                  *items[len(items) // 2:]])  # good tasks share pulls with poisoned ones
        sub = TrajectoryLog(plane).reader()
        served: list[Trajectory] = []
        for _ in range(200):
            served += [t for d in await sub.pull(batch=64, timeout=0.2) for t in carried(d.msg)]
            dlq = await dead_letters(plane, "task")
            if len(served) >= 2 * len(goods) and sum(map(len, dlq.values())) >= len(poisons):
                break
    finally:
        stop.set()
        await run
    assert missed(poisons, dlq) == []
    assert sorted({t.task_id for t in served}) == ["g0", "g1", "g2"] and node.stats["failed"] == 0
    assert node.stats["rejected_tasks"] == sum(p.field != "group_size" or "impossible" in p.expect for p in poisons)


# ------------------------------------------------------------------------------------------- batches
async def vetted(plane: Plane, payload: bytes, vocab: int, version: int, max_lag: int) -> tuple[str | None, TrainingBatch | None]:
    """What a trainer makes of a manifest's bytes (``train/worker.py``, in its order): the codec (its consumer
    dead-letters what does not decode), the plan, the manifest, the fetch by sequence, the trajectories fetched."""
    try:
        manifest = decode(payload, Batch)
    except DecodeError as e:
        return str(e), None
    refused = await check_plan(plane, "solver", manifest) or check_manifest(manifest, "solver")
    if refused is not None:
        return refused.reason, None
    try:
        batch = TrainingBatch(manifest, await fetch_trajectories(plane, manifest))
    except (MissingMessages, PayloadUnavailable) as e:
        return f"{BatchRefusal.MISSING.value}: {e}", None
    refused = check_batch(batch, vocab, version, max_lag)
    return (refused.reason if refused else None), batch


async def test_every_poisoned_batch_is_turned_away_by_the_trainers_checks(plane: Plane):
    tiny = {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    r = parse_recipe({"name": "b", "model": tiny, "dataflow": {"group_size": 2, "groups_per_batch": 2, "max_tasks_in_flight": 4}})
    model = build_model(r.policies["solver"].model, TOK)
    prompts = [p.prompt for p in load_split(r.data)[0][:4]]
    (sampled,) = sample_batches(model, TOK, prompts, groups_per_batch=2, group_size=2, max_new_tokens=4, version=10, prefix="base")
    seqs = []  # as two nodes publish them, a task's group each (one node's would be one bundle): the manifest names them there
    for group in grouped(sampled.trajectories):
        seqs += await publish_trajectories(plane, group)
    refs = [ref.model_copy(update={"seq": q}) for ref, q in zip(sampled.manifest.refs, seqs, strict=True)]
    base = TrainingBatch(sampled.manifest.model_copy(update={"refs": refs}), sampled.trajectories)
    backend = build_backend("torch", model, TOK, r.policies["solver"].trainer, temperature=1.0)
    poisons = draw_each(poisoned_batches(base, RunView(384, 2, 4, 64, 10)), PER_FIELD, at=3)
    assert {p.field for p in poisons} == {"batch_id", "advantages", "policy", "refs", "refs.target", "refs.task_id", "refs.seq",
                                          "trajectories"}
    for p in poisons:
        if "trajectories" in p.extra:  # poisoned values: on the TRAJ stream first, as a node's, the manifest naming them
            p = published_at(p, await publish_copies(plane, p.extra["trajectories"]))
        if p.extra.get("plan"):  # a forged plan record: of the base (another content under its id), or one that matches
            await plane.state.put(plan_record(base.manifest if p.extra["plan"] == "base" else p.msg, "solver"))  # type: ignore[arg-type]
        reason, batch = await vetted(plane, p.payload, 384, version=12, max_lag=4)
        if reason is None:  # values it can take: the step itself must refuse (a non-finite loss makes no update)
            assert batch is not None
            before = {k: v.clone() for k, v in model.state_dict().items()}
            step = backend.step(batch)
            reason = f"non_finite: loss {step['loss']}" if step["skipped"] else "trained"
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), p.label
        assert p.named_by(reason), (p.label, reason)
        assert p.expect == "stale" or not reason.startswith("stale"), (p.label, reason)  # the sweep's tokens are fresh: each its own check


# ------------------------------------------------------------------------------------------- announcements
async def test_every_poisoned_announcement_is_dead_lettered_and_the_real_ones_still_flow(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    real = [await pub.publish(trainer.step() if i else trainer.model.state_dict(), i) for i in range(3)]
    sync = node(plane)
    await sync.wait_for(2, timeout=10)
    poisons = draw_each(poisoned_announcements(real[-1]), PER_FIELD, at=4)
    for p in poisons:  # by someone the permissions let through, between two real versions
        await plane.publish(plane.names.weights("solver"), p.msg)  # type: ignore[arg-type]
    await pub.publish(trainer.step(), 3)  # the trainer steps over announcements no trainer could have made
    await sync.wait_for(3, timeout=10)
    for _ in range(50):
        if sync.stats["rejected"] >= len(poisons):
            break
        await sync.refresh(wait=0.2)
    assert sync.version == 3 and engine_digest(sync) == trainer.digest
    assert missed(poisons, await dead_letters(plane, "weights")) == []
    late = node(plane)  # an evaluator stepping to a version reads the history: a foreign copy never stands in for it
    await late.goto(2)
    assert engine_digest(late) == real[2].state_digest


# ------------------------------------------------------------------------------------------- heartbeats, run state
async def test_poisoned_heartbeats_leave_the_autoscale_advice_finite(plane: Plane):
    r = parse_recipe({"name": "h"})
    advisor = PoolAdvisor(plane, "raas", ("solver",), r.dataflow.autoscale)
    clock = 1000.0
    for p in draw_each(poisoned_heartbeats("evil"), 2 * PER_FIELD, at=5):
        advisor.seen(p.msg, clock)  # type: ignore[arg-type]
        clock += 0.5
    advice, obs = await advisor.publish()
    assert all(math.isfinite(x) for x in (obs.wait_frac, obs.busy, obs.produce_rate, obs.consume_rate)), obs
    record = await plane.state.get(AutoscaleRecord, "raas")  # written and read back: a valid record
    assert record is not None and record.target == advice.target


async def test_poisoned_keyframe_requests_only_ever_ask_for_keyframes(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    await pub.publish(trainer.model.state_dict(), 0)
    for i, p in enumerate(draw_each({"value": poisoned_keyframe_requests(("solver",))}, 2 * PER_FIELD, at=6)):
        await plane._js.publish(f"$KV.{plane.names.state_bucket}.{p.key}", p.raw)  # as a rollout credential may
        ann = await pub.publish(trainer.step(), i + 1)
        assert ann.encoding in ("keyframe", "delta") and ann.version == i + 1
    sync = node(plane)
    await sync.wait_for(i + 1, timeout=10)
    assert engine_digest(sync) == trainer.digest


async def test_forged_task_rejections_fail_only_what_they_name_and_the_accounting_adds_up(harness: Harness):
    h = harness
    await h.turn(2)
    (held,) = await h.task_sub.pull(batch=1, timeout=1)  # a task this attacker really pulled
    foreign = held.msg.model_copy(update={"task_id": "t99999999"})
    forged = [b"", b"\x01garbage", encode(foreign), encode(held.msg), b"\x02" + b"\x00" * 64]
    for payload in forged:
        rej = Rejected(subject=h.node.names.task("single_turn"), reason="x" * 5000, worker_id="evil", payload=payload)
        await h.node.publish(h.node.names.dlq("task"), rej)
    await h.until(lambda: h.acc().fates.get("failed:rollout") == 1)
    await h.turn(3)
    acc = h.acc()
    assert acc.adds_up and acc.fates == {"failed:rollout": 1} and acc.in_flight == h.df.ledger.issued - 1


async def test_an_unreadable_evaluation_record_is_evaluated_again_and_never_stops_the_launcher(plane: Plane, tmp_path):
    r = parse_recipe({"name": "e", "eval": {"every": 5}, "trainer": {"steps": 10}})
    rundir = RunDir(tmp_path / "run")
    rundir.prepare()
    watcher = RunWatcher(plane, r, rundir, {0, 5, 10})
    await plane.state.put(EvalRecord(policy="solver", version=10, reward=0.5))
    for v, raw in ((0, b"garbage"), (5, b'{"v": 1, "policy": "solver", "version": 5, "reward": NaN}')):  # as a leaked credential may
        await plane._js.publish(f"$KV.{plane.names.state_bucket}.eval.solver.{v}", raw)
        assert not await evaluated(plane, "solver", v)  # the evaluator does it again, overwriting the value
    assert await evaluated(plane, "solver", 10)
    watcher.live.versions["solver"] = 10  # v10 announced: the evaluations up to it may exist
    await watcher._poll_evals()  # the launcher leaves them out of its figures and goes on
    assert [row["version"] for row in rundir.rows("evals.jsonl")] == [10] and watcher._evals == {
        ("solver", 0),
        ("solver", 5),
        ("solver", 10),
    }
    await watcher.stop()


async def test_an_evaluation_is_recorded_at_the_rollouts_of_its_versions_last_record(plane: Plane, tmp_path):
    """``evals.jsonl``'s ``rollouts`` (the summary's x axis) is what the TRAJ stream held when the evaluated version was
    recorded; a version recorded twice (a trainer restarted before its checkpoint) counts at its last record, also on
    resume, when the records come from the file."""
    r = parse_recipe({"name": "e", "eval": {"every": 5}, "trainer": {"steps": 10}})
    rundir = RunDir(tmp_path / "run")
    rundir.prepare()
    for version, digest, trajectories in ((0, "a", 0), (5, "b", 320), (5, "c", 352), (10, "d", 700)):
        rundir.append("metrics.jsonl", {"policy": "solver", "version": version, "state_digest": digest, "trajectories": trajectories})
    watcher = RunWatcher(plane, r, rundir, {0, 5, 10})
    for v in (0, 5):
        await plane.state.put(EvalRecord(policy="solver", version=v, reward=0.5))
    await watcher._poll_evals()
    assert [(row["version"], row["rollouts"]) for row in rundir.rows("evals.jsonl")] == [(0, 0), (5, 352)]
    await watcher.stop()
