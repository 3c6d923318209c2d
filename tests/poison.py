"""Poison: well-formed messages with wrong values, each derived from a real one by changing one field.

Hypothesis strategies (``poisoned_*``) take a real message of the run and return a strategy of
:class:`Poison`: the message with one field set to a value no honest writer of the run sends, the
field's name, what was done, and what the consumer must say about it (``expect``: a substring of
the dead-letter reason; ``""`` when nothing is dead-lettered, e.g. heartbeats, which are only
liveness, and run-state records). :func:`draw` takes a bounded, seeded sample of one, so a live
run and a benchmark campaign draw the same poisons for the same seed.

Shared by ``tests/test_poison_fields.py`` (the per-field sweep, service level), ``tests/test_poison.py``
(a live ``astraflow up`` run) and ``benchmarks/bench_poison.py`` (a longer campaign).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from astraflow.streams.codec import encode
from astraflow.streams.messages import Batch, Heartbeat, Message, RolloutStats, Task, TrainerStats, Trajectory, WeightVersion
from astraflow.streams.plane import Plane
from astraflow.streams.state import BatchPlanRecord
from astraflow.streams.trajectories import TrainingBatch

T = TypeVar("T")
HUGE = 300_000  # tokens: a 3.9 MB trajectory, under the 8 MB max_payload
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


@dataclass(frozen=True)
class Poison:
    kind: str  # the message type (task, trajectory, batch, weights, heartbeat, rejected, keyframe_request)
    field: str  # the field that was poisoned
    label: str  # what was done to it
    msg: Message | None = None  # what is published (None: ``raw``)
    expect: str = ""  # a substring of the dead-letter reason the consumer gives it, or alternatives "a|b" ("": none expected)
    raw: bytes = b""  # bytes written as they are (run-state records, forged payloads)
    key: str = ""  # run-state key (``keyframe_request.solver``) or subject suffix
    extra: dict[str, Any] = field(default_factory=dict)  # what the injector needs besides (a plan record to forge, …)

    @property
    def payload(self) -> bytes:
        """The bytes on the wire (what a dead-letter entry keeps as ``payload``)."""
        return encode(self.msg) if self.msg is not None else self.raw

    @property
    def name(self) -> str:
        return f"{self.kind}.{self.field}"

    def named_by(self, reason: str) -> bool:
        """``reason`` is one its consumer's check gives it."""
        return any(e in reason for e in self.expect.split("|"))


@dataclass(frozen=True)
class RunView:
    """What a poisoner knows about the run (all of it readable by any node)."""

    vocab: int
    group_size: int
    max_new_tokens: int
    context: int
    newest: int  # newest announced version
    workflow: str = "single_turn"
    policy: str = "solver"


Fields = dict[str, st.SearchStrategy[Poison]]  # per poisoned field: the strategy of its poisons


def by_field(strategies: list[tuple[str, st.SearchStrategy[Poison]]]) -> Fields:
    out: dict[str, list[st.SearchStrategy[Poison]]] = {}
    for name, strategy in strategies:
        out.setdefault(name, []).append(strategy)
    return {name: st.one_of(group) for name, group in out.items()}


def draw_each(fields: Fields, n: int, at: int = 0) -> list[Poison]:
    """``n`` poisons of every field (seeded per field), field after field."""
    return [p for i, strategy in enumerate(fields.values()) for p in draw(strategy, n, at + i)]


def nth(fields: Fields, i: int, at: int, per_field: int) -> Poison:
    """The ``i``-th poison of a campaign of ``per_field`` per field, each derived from its own base message: field
    after field, from one seeded draw of ``per_field`` per field (so the same ``i`` and ``at`` give the same poison)."""
    names = sorted(fields)
    k = i % len(names)
    drawn = draw(fields[names[k]], per_field, at * 1009 + k)  # fewer when the field has fewer distinct poisons
    return drawn[(i // len(names)) % len(drawn)]


def plan_record(b: Batch, policy: str) -> BatchPlanRecord:
    """The plan record the dataflow writes for manifest ``b`` for ``policy``'s trainer (forged here: a writer the
    permissions let through)."""
    return BatchPlanRecord(policy=policy, batch_id=b.batch_id, digest=b.digest(), trajectories=len(b.refs))


def draw(strategy: st.SearchStrategy[T], n: int, at: int = 0) -> list[T]:
    """``n`` examples of ``strategy``, the same ones for the same ``at`` seed (hypothesis, generate phase only)."""
    out: list[T] = []

    @seed(at)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x: T) -> None:
        out.append(x)

    collect()
    return out[:n]


def _i32(values: Any) -> bytes:
    return np.asarray(values, "<i4").tobytes()


def _f32(values: Any) -> bytes:
    return np.asarray(values, "<f4").tobytes()


def _tokens(base: Trajectory, ids: np.ndarray, version: int | None = None) -> dict[str, Any]:
    """Completion ``ids`` with aligned per-token arrays (``base``'s first values repeated)."""
    n = len(ids)
    v = int(base.token_versions()[0]) if len(base.completion_ids) and version is None else (version or 0)
    return {"completion_ids": _i32(ids), "logprobs": _f32(np.full(n, -0.5)), "versions": _i32(np.full(n, v)),
            "loss_mask": np.ones(n, "<u1").tobytes()}


# ---------------------------------------------------------------------------------------------- trajectories
def poisoned_trajectories(base: Trajectory, view: RunView) -> Fields:
    """One field of a valid trajectory (``base``, a sample of a task the run issued) set to a value the dataflow's
    checks (``dataflow/validate.py``, ingest) turn away, with the code they name it by."""
    n = len(base.completion_ids) // 4
    assert n > 0, "derive poisons from a trajectory with completion tokens"
    g = view.group_size

    def poison(name: str, values: st.SearchStrategy[Any], expect: str, update: Callable[[Any], dict[str, Any]],
               label: str = "{name} {v!r}") -> tuple[str, st.SearchStrategy[Poison]]:
        return name, values.map(lambda v: Poison("trajectory", name, label.format(name=name, v=v), base.model_copy(update=update(v)),
                                                 expect))

    def ids(i: int = base.index, task_id: str = base.task_id, policy: str = base.policy) -> dict[str, Any]:
        return {"index": i, "traj_id": f"{task_id}.{policy}.{i}", "task_id": task_id, "policy": policy}

    bad_token = st.one_of(st.integers(view.vocab, 2**31 - 1), st.integers(-(2**31), -1))
    return by_field([
        poison("traj_id", st.text("abcxyz.-_0123456789", min_size=1, max_size=40).filter(lambda s: s != base.traj_id),
               "invalid traj_id", lambda s: {"traj_id": s}),
        poison("task_id", st.integers(1, 10**9).map(lambda k: f"x{k}"), "invalid task", lambda t: ids(task_id=t),
               "a task never issued ({v})"),
        poison("policy", st.sampled_from(["critic", "evil", "x" * 64]), "invalid policy", lambda p: ids(policy=p)),
        poison("index", st.one_of(st.integers(-(2**31), -1), st.integers(g, 2**31 - 1)), "invalid index|('index',)", lambda i: ids(i)),
        poison("group_size", st.integers(-(2**31), 2**31 - 1).filter(lambda k: k != g), "invalid group_size|('group_size',)",
               lambda k: {"group_size": k}),
        poison("prompt_ids", st.just(b""), "invalid prompt", lambda e: {"prompt_ids": e}, "an empty prompt"),
        poison("prompt_ids", bad_token, "invalid token", lambda t: {"prompt_ids": _i32([t, *base.prompt_tokens()])}, "prompt token {v}"),
        poison("completion_ids", bad_token, "invalid token", lambda t: {"completion_ids": _i32([t, *base.completion()[1:]])},
               "completion token {v}"),
        poison("completion_ids", st.integers(view.max_new_tokens + 1, HUGE), "invalid length", lambda k: _tokens(base, np.full(k, 5)),
               "{v} completion tokens"),
        poison("logprobs", st.one_of(NON_FINITE, st.floats(0.01, 1e30)), "invalid logprob",
               lambda x: {"logprobs": _f32(np.r_[x, base.behaviour_logprobs()[1:]])}, "logprob {v}"),
        poison("versions", st.integers(view.newest + 10**6, 2**31 - 1), "invalid version", lambda v: {"versions": _i32(np.full(n, v))},
               "tokens of v{v} (the future)"),
        poison("versions", st.integers(-(2**31), -2), "invalid version", lambda v: {"versions": _i32(np.full(n, v))},
               "generated tokens of v{v} (the past)"),
        poison("loss_mask", st.integers(2, 255), "invalid mask", lambda m: {"loss_mask": np.r_[m, base.mask()[1:]].astype("<u1").tobytes()},
               "loss_mask {v}"),
        poison("reward", st.one_of(NON_FINITE, st.floats(1e31, 3e38), st.floats(-3e38, -1e31)), "invalid reward",
               lambda r: {"reward": r}, "reward {v:g}"),
        poison("reward", st.sampled_from(["stop", "length"]), "invalid reward", lambda f: {"reward": None, "finish_reason": f},
               "no reward, finish {v}"),
        poison("created_at", NON_FINITE, "invalid time", lambda x: {"created_at": x}),
    ])


# ---------------------------------------------------------------------------------------------- tasks
def poisoned_tasks(base: Task, view: RunView) -> Fields:
    """One field of a valid task of the run (``base``) set to a value a rollout node turns away
    (``rollout/task_checks.py``, or the codec), with the code it names."""

    def poison(name: str, values: st.SearchStrategy[Any], code: str, update: Callable[[Any], dict[str, Any]],
               label: str = "{name} {v!r}") -> tuple[str, st.SearchStrategy[Poison]]:
        return name, values.map(lambda v: Poison("task", name, label.format(name=name, v=v)[:80], base.model_copy(update=update(v)),
                                                 f"impossible task {code}"))

    def constructed(k: int) -> Poison:  # a value the model refuses: built without validation, refused by the codec
        return Poison("task", "group_size", f"group_size {k}", Task.model_construct(**{**dict(base), "group_size": k}), "group_size")

    far = st.one_of(NON_FINITE, st.floats(-1e12, -1.0), st.floats(8 * 86400.0, 1e12))
    metas = st.one_of(st.just({}), st.just({"answer": {"x": 1}}), st.text("abc+-", min_size=1, max_size=8).map(lambda a: {"answer": a}),
                      st.just({"answer": "9" * 5000}))
    return by_field([
        poison("workflow", st.sampled_from(["evil", "multi_turn_tools", "x" * 64]).filter(lambda w: w != view.workflow), "workflow",
               lambda w: {"workflow": w}),
        poison("policy", st.sampled_from(["verifier", "evil"]), "policy", lambda p: {"policy": p}),
        poison("min_versions", st.sampled_from(["critic", "evil"]), "policy", lambda p: {"min_versions": {**base.min_versions, p: 0}},
               "min_versions of policy {v!r}"),
        poison("min_versions", st.integers(view.newest + 1000, 2**62), "version", lambda v: {"min_versions": {view.policy: v}},
               "needs v{v}"),
        poison("group_size", st.integers(1, 10**9).filter(lambda k: k != view.group_size), "group_size", lambda k: {"group_size": k}),
        ("group_size", st.integers(-(2**31), 0).map(constructed)),
        poison("created_at", NON_FINITE, "time", lambda x: {"created_at": x}),
        poison("deadline", far, "time", lambda d: {"deadline": base.created_at + d}, "deadline created_at{v:+g}"),
        poison("prompt", st.integers(view.context - view.max_new_tokens + 1, 32 * view.context), "prompt", lambda k: {"prompt": "1" * k},
               "a prompt of {v} characters"),
        poison("prompt", st.just(2_000_000), "prompt", lambda k: {"prompt": "7" * k}, "a prompt of {v} characters"),
        poison("meta", metas, "meta", lambda m: {"meta": m}),
    ])


def foreign_tasks(base: Task) -> st.SearchStrategy[Poison]:
    """Tasks the run never issued, otherwise valid: a node serves them, the dataflow turns their trajectories away."""
    return st.integers(1, 10**9).map(lambda k: Poison("task", "task_id", f"a task never issued (f{k})",
                                                      base.model_copy(update={"task_id": f"f{k}"}), f"'f{k}'"))


# ---------------------------------------------------------------------------------------------- batches
def poisoned_batches(base: TrainingBatch, view: RunView) -> Fields:
    """Batches a trainer turns away (``train/vetting.py``, ``train/worker.py``): manifests unplanned or forged under a
    planned id; and, with a forged plan record that matches them (``extra['plan']``: a writer the permissions let
    through), manifests it cannot train or whose references name what the TRAJ stream does not hold there, and
    trajectories whose values it cannot train. ``base``'s manifest names its trajectories where they lie on the
    TRAJ stream. A poison of the trajectories' values carries them (``extra['trajectories']``, in manifest order):
    they are published first, as a rollout node's, and the manifest pointed at them (:func:`published_at`)."""
    m, trajs = base.manifest, base.trajectories
    k = len(m.refs)
    others = [j for j in range(1, k) if m.refs[j].seq != m.refs[0].seq] or list(range(1, k))  # in another message than ref 0

    def poison(name: str, values: st.SearchStrategy[Any], expect: str, update: Callable[[Any], dict[str, Any]], label: str,
               plan: bool | str = True) -> tuple[str, st.SearchStrategy[Poison]]:
        return name, values.map(lambda v: Poison("batch", name, label.format(v=v), m.model_copy(update=update(v)), expect,
                                                 extra={"plan": plan}))

    def carried(name: str, values: st.SearchStrategy[Any], expect: str, poisoned: Callable[[Any], list[Trajectory]],
                label: str) -> tuple[str, st.SearchStrategy[Poison]]:
        return name, values.map(lambda v: Poison("batch", name, label.format(v=v), m, expect,
                                                 extra={"plan": True, "trajectories": poisoned(v)}))

    def ref0(**update: Any) -> dict[str, Any]:
        return {"refs": [m.refs[0].model_copy(update=update), *m.refs[1:]]}

    def first(**update: Any) -> list[Trajectory]:
        return [trajs[0].model_copy(update=update), *trajs[1:]]

    def aged(v: int) -> list[Trajectory]:
        return [t.model_copy(update={"versions": _i32(np.full(len(t.versions) // 4, v))}) for t in trajs]

    wrong = st.one_of(NON_FINITE.map(lambda x: _f32(np.r_[x, np.zeros(k - 1)])),
                      st.integers(0, 3 * k).filter(lambda n: n != k).map(lambda n: _f32(np.zeros(n))))
    return by_field([
        poison("batch_id", st.integers(1, 10**9), "unplanned", lambda i: {"batch_id": f"f{i}"}, "batch f{v}, never planned", plan=False),
        poison("advantages", st.floats(-10, 10), "forged", lambda a: {"advantages": _f32(np.full(k, a))},
               "other advantages ({v:.2f}) under a planned id", plan="base"),
        # a count that is not one per reference: the codec refuses the manifest ("invalid batch"); a non-finite one the trainer
        poison("advantages", wrong, "invalid", lambda a: {"advantages": a}, "advantages {v!r:.40}"),
        # a step on them overflows: no update (or stale, when the trainer moved on past the allowed lag before pulling it)
        poison("advantages", st.floats(1e38, 3e38), "non_finite|stale", lambda a: {"advantages": _f32(np.full(k, a))},
               "advantages {v:.1e}"),
        poison("policy", st.sampled_from(["verifier", "critic"]), "invalid", lambda p: {"policy": p}, "policy {v!r}"),
        # one field each, so that every campaign draws each: a reference to another trajectory, another task, nothing
        # (a message that holds another trajectory: not one of ref 0's group, which the message at ref 0's sequence carries too)
        poison("refs.target", st.sampled_from(others), "mismatch", lambda j: ref0(seq=m.refs[j].seq), "ref 0 at trajectory {v}'s sequence"),
        poison("refs.task_id", st.integers(1, 10**9), "mismatch", lambda i: ref0(task_id=f"x{i}"), "ref 0 naming task x{v}"),
        poison("refs.seq", st.integers(2**40, 2**62), "missing", lambda q: ref0(seq=q), "ref 0 at sequence {v}, never written"),
        poison("refs", st.integers(1, k - 1), "invalid", lambda j: {"refs": m.refs[:-j]},
               "{v} refs fewer than advantages (misaligned)"),
        carried("trajectories", st.integers(view.vocab, 2**31 - 1), "invalid",
                lambda t: first(completion_ids=_i32([t, *trajs[0].completion()[1:]])), "token {v}"),
        carried("trajectories", st.integers(-(2**31), -(10**6)), "stale", aged, "tokens of v{v}"),
    ])


def published_at(p: Poison, seqs: list[int]) -> Poison:
    """``p`` with its manifest naming, in order, the trajectories it carries (``extra['trajectories']``) published
    at ``seqs``."""
    assert isinstance(p.msg, Batch)
    refs = [r.model_copy(update={"seq": s}) for r, s in zip(p.msg.refs, seqs, strict=True)]
    return replace(p, msg=p.msg.model_copy(update={"refs": refs}))


async def publish_copies(plane: Plane, trajs: list[Trajectory]) -> list[int]:
    """Publish ``trajs`` on the TRAJ stream as a node may (rollout credential); their stream sequences. Without
    ``Nats-Msg-Id``: a copy under the id of a published trajectory must not be deduplicated away."""
    return await plane.publish_many([(plane.names.traj(t.policy, plane.node), t, None) for t in trajs])


# ---------------------------------------------------------------------------------------------- weights
SHA = "ab" * 32


def poisoned_announcements(base: WeightVersion) -> Fields:
    """Announcements impossible on their face, or from the past (``weights/checks.py``), derived from a real one."""
    v, ref = base.version, base.objects[0]

    def poison(name: str, values: st.SearchStrategy[Any], expect: str, update: Callable[[Any], dict[str, Any]],
               label: str) -> tuple[str, st.SearchStrategy[Poison]]:
        return name, values.map(lambda x: Poison("weights", name, label.format(v=x), base.model_copy(update=update(x)), expect))

    def keyframe(x: int, **update: Any) -> dict[str, Any]:  # a version x that is otherwise possible
        return {"version": x, "encoding": "keyframe", "base_version": None, "base_digest": None, "keyframe_version": x, **update}

    def delta(x: int, **update: Any) -> dict[str, Any]:
        return {"version": x, "encoding": "delta", "base_version": x - 1, "base_digest": SHA, "keyframe_version": 0, **update}

    future, ahead = st.integers(v + 10**6, 2**62), v + 10**6
    return by_field([
        poison("version", st.integers(-(2**62), -1), "< 0", lambda x: keyframe(x), "version {v}"),
        poison("version", st.integers(0, v), "announced", lambda x: keyframe(x, state_digest=SHA), "v{v} again, another state (the past)"),
        poison("base_version", future, "not an earlier version", lambda x: delta(x, base_version=x), "delta v{v} onto itself"),
        poison("base_version", future, "without a base", lambda x: delta(x, base_version=None, base_digest=None),
               "delta v{v} without a base"),
        poison("base_version", future, "names a base", lambda x: keyframe(x, base_version=x - 1, base_digest=SHA),
               "keyframe v{v} with a base"),
        poison("keyframe_version", future, "names keyframe_version", lambda x: keyframe(x, keyframe_version=x + 1),
               "keyframe v{v} naming a later keyframe"),
        poison("state_digest", st.text("xyz!", min_size=1, max_size=70), "not a sha256", lambda d: keyframe(ahead, state_digest=d),
               "state_digest {v!r:.12}"),
        poison("objects", st.integers(0, 3).filter(lambda k: k != 1), "objects", lambda k: keyframe(ahead, objects=[ref] * k),
               "{v} objects"),
        poison("objects", st.integers(1, 50), "chunk digests",
               lambda k: keyframe(ahead, objects=[ref.model_copy(update={"digests": ref.digests + [SHA] * k})]),
               "{v} chunk digests too many"),
        poison("objects", st.sampled_from(["a.b", "x y", "*", ">", ""]), "subject token",
               lambda s: keyframe(ahead, objects=[ref.model_copy(update={"nuid": s})]), "object id {v!r}"),
        poison("policy", st.sampled_from(["critic", "verifier"]), "of policy", lambda p: keyframe(ahead, policy=p),
               "policy {v!r} on solver's subject"),
    ])


# ---------------------------------------------------------------------------------------------- heartbeats
def poisoned_heartbeats(worker: str, pool: str = "raas") -> Fields:
    """Heartbeats a rollout credential may publish (``hb.rollout.*``) with values no role sends: non-finite or
    absurd stats, another role's stats, a time from another age. Heartbeats are only liveness: nothing is
    dead-lettered; the consumers (dataflow's autoscale, the launcher) must stay up and finite."""
    bad = st.one_of(NON_FINITE, st.sampled_from([-1e308, 1e308, -1.0]))

    def poison(name: str, values: st.SearchStrategy[Any], fields: Callable[[Any], dict[str, Any]],
               label: str) -> tuple[str, st.SearchStrategy[Poison]]:
        base = {"worker_id": worker, "pool": pool, "stats": RolloutStats(joined=True)}
        return name, values.map(lambda x: Poison("heartbeat", name, label.format(v=x), Heartbeat(**{**base, **fields(x)})))

    return by_field([
        poison("stats", bad, lambda x: {"stats": RolloutStats(joined=True, gen_s=x)}, "gen_s {v}"),
        poison("stats", bad, lambda x: {"policy": "solver", "stats": TrainerStats(wait_s=x, wait_frac=x)},
               "a trainer's wait_s {v} on a rollout subject"),
        poison("ts", bad, lambda x: {"ts": x}, "ts {v}"),
        poison("version", st.integers(-(2**62), 2**62), lambda x: {"version": x}, "version {v}"),
        poison("worker_id", st.integers(1, 200), lambda k: {"worker_id": f"{worker}-{k}"}, "node id {v}"),
    ])


# ---------------------------------------------------------------------------------------------- run state
def poisoned_keyframe_requests(policies: tuple[str, ...]) -> st.SearchStrategy[Poison]:
    """``keyframe_request.*`` values a rollout credential may write: garbage, another schema, another policy."""
    values = st.sampled_from([b"", b"garbage", b"{}", b'{"v": 1}', b'{"v": 99, "policy": "solver"}', b"\xff" * 1000,
                              b'{"v": 1, "policy": "critic", "by": "x"}', b"[" * 10000])
    keys = st.sampled_from([*policies, "critic"])
    return st.tuples(keys, values).map(lambda kv: Poison("keyframe_request", "value", f"{kv[1][:16]!r} at {kv[0]}", raw=kv[1],
                                                         key=f"keyframe_request.{kv[0]}"))
