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
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from astraflow.streams.codec import encode
from astraflow.streams.messages import Batch, Heartbeat, Message, RolloutStats, Task, TrainerStats, Trajectory, WeightVersion

T = TypeVar("T")
HUGE = 300_000  # tokens: a 3.9 MB trajectory, under the 8 MB max_payload
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


@dataclass(frozen=True)
class Poison:
    kind: str  # the message type (task, trajectory, batch, weights, heartbeat, rejected, keyframe_request)
    field: str  # the field that was poisoned
    label: str  # what was done to it
    msg: Message | None = None  # what is published (None: ``raw``)
    expect: str = ""  # a substring of the dead-letter reason the consumer gives it ("" : none expected)
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
    task, pol, g = base.task_id, base.policy, view.group_size

    def mk(fld: str, label: str, expect: str, **update: Any) -> Poison:
        return Poison("trajectory", fld, label, base.model_copy(update=update), expect)

    def ids(i: int, task_id: str = task, policy: str = pol) -> dict[str, Any]:
        return {"index": i, "traj_id": f"{task_id}.{policy}.{i}", "task_id": task_id, "policy": policy}

    out = [
        ("traj_id", st.text("abcxyz.-_0123456789", min_size=1, max_size=40).filter(lambda s: s != base.traj_id).map(
            lambda s: mk("traj_id", f"traj_id {s!r}", "invalid traj_id", traj_id=s))),
        ("task_id", st.integers(1, 10**9).map(lambda k: mk("task_id", f"a task never issued (x{k})", "invalid task", **ids(base.index, f"x{k}")))),
        ("policy", st.sampled_from(["critic", "evil", "x" * 64]).map(lambda p: mk("policy", f"policy {p[:12]!r}", "invalid policy", **ids(base.index, policy=p)))),
        ("index", st.one_of(st.integers(-(2**31), -1), st.integers(g, 2**31 - 1)).map(
            lambda i: mk("index", f"index {i}", "invalid index", **ids(i)))),
        ("group_size", st.integers(-(2**31), 2**31 - 1).filter(lambda k: k != g).map(lambda k: mk("group_size", f"group_size {k}", "invalid group_size",
                                                                                group_size=k))),
        ("prompt_ids", st.just(mk("prompt_ids", "empty prompt", "invalid prompt", prompt_ids=b""))),
        ("prompt_ids", st.one_of(st.integers(view.vocab, 2**31 - 1), st.integers(-(2**31), -1)).map(
            lambda t: mk("prompt_ids", f"prompt token {t}", "invalid token", prompt_ids=_i32([t, *base.prompt_tokens()])))),
        ("completion_ids", st.one_of(st.integers(view.vocab, 2**31 - 1), st.integers(-(2**31), -1)).map(
            lambda t: mk("completion_ids", f"completion token {t}", "invalid token", completion_ids=_i32([t, *base.completion()[1:]])))),
        ("completion_ids", st.integers(view.max_new_tokens + 1, HUGE).map(lambda k: mk("completion_ids", f"{k} completion tokens", "invalid length",
                                                                     **_tokens(base, np.full(k, 5))))),
        ("logprobs", st.one_of(NON_FINITE, st.floats(0.01, 1e30)).map(lambda x: mk("logprobs", f"logprob {x}", "invalid logprob",
                                                                       logprobs=_f32(np.r_[x, base.behaviour_logprobs()[1:]])))),
        ("versions", st.integers(view.newest + 10**6, 2**31 - 1).map(lambda v: mk("versions", f"a token of v{v} (the future)", "invalid version",
                                                                      versions=_i32(np.full(n, v))))),
        ("versions", st.integers(-(2**31), -2).map(lambda v: mk("versions", f"generated tokens of v{v} (the past)", "invalid version",
                                                   versions=_i32(np.full(n, v))))),
        ("loss_mask", st.integers(2, 255).map(lambda m: mk("loss_mask", f"loss_mask {m}", "invalid mask",
                                             loss_mask=np.r_[m, base.mask()[1:]].astype("<u1").tobytes()))),
        ("reward", st.one_of(NON_FINITE, st.floats(1e31, 3e38), st.floats(-3e38, -1e31)).map(
            lambda r: mk("reward", f"reward {r:g}", "invalid reward", reward=r))),
        ("reward", st.sampled_from(["stop", "length"]).map(lambda f: mk("reward", f"no reward, finish {f}", "invalid reward", reward=None,
                                                             finish_reason=f))),
        ("created_at", NON_FINITE.map(lambda x: mk("created_at", f"created_at {x}", "invalid time", created_at=x))),
    ]
    return by_field(out)


# ---------------------------------------------------------------------------------------------- tasks
def poisoned_tasks(base: Task, view: RunView) -> Fields:
    """One field of a valid task of the run (``base``) set to a value a rollout node turns away
    (``rollout/task_checks.py``, or the codec), with the code it names."""

    def mk(fld: str, label: str, expect: str, **update: Any) -> Poison:
        return Poison("task", fld, label, base.model_copy(update=update), expect)

    out = [
        ("workflow", st.sampled_from(["evil", "multi_turn_tools", "x" * 64]).filter(lambda w: w != view.workflow).map(
            lambda w: mk("workflow", f"workflow {w[:12]!r}", "impossible task workflow", workflow=w))),
        ("policy", st.sampled_from(["verifier", "evil"]).map(lambda p: mk("policy", f"policy {p!r}", "impossible task policy", policy=p))),
        ("min_versions", st.sampled_from(["critic", "evil"]).map(lambda p: mk("min_versions", f"min_versions of policy {p!r}", "impossible task policy",
                                                              min_versions={**base.min_versions, p: 0}))),
        ("group_size", st.integers(1, 10**9).filter(lambda k: k != view.group_size).map(
            lambda k: mk("group_size", f"group_size {k}", "impossible task group_size", group_size=k))),
        ("group_size", st.integers(-(2**31), 0).map(lambda k: Poison("task", "group_size", f"group_size {k}",
                                                      Task.model_construct(**{**dict(base), "group_size": k}), "group_size"))),
        ("min_versions", st.integers(view.newest + 1000, 2**62).map(lambda v: mk("min_versions", f"needs v{v}", "impossible task version",
                                                                min_versions={view.policy: v}))),
        ("created_at", NON_FINITE.map(lambda x: mk("created_at", f"created_at {x}", "impossible task time", created_at=x))),
        ("deadline", st.one_of(NON_FINITE, st.floats(-1e12, -1.0), st.floats(8 * 86400.0, 1e12)).map(
            lambda d: mk("deadline", f"deadline created_at{d:+g}", "impossible task time",
                         deadline=d if not math.isfinite(d) else base.created_at + d))),
        ("prompt", st.integers(view.context - view.max_new_tokens + 1, 32 * view.context).map(
            lambda k: mk("prompt", f"a prompt of {k} characters", "impossible task prompt", prompt="1" * k))),
        ("prompt", st.just(mk("prompt", "a prompt of 2 MB", "impossible task prompt", prompt="7" * 2_000_000))),
        ("meta", st.one_of(st.just({}), st.just({"answer": {"x": 1}}), st.text("abc+-", min_size=1, max_size=8).map(lambda a: {"answer": a}),
                  st.just({"answer": "9" * 5000})).map(lambda m: mk("meta", f"meta {str(m)[:24]}", "impossible task meta", meta=m))),
    ]
    return by_field(out)


def foreign_tasks(base: Task) -> st.SearchStrategy[Poison]:
    """Tasks the run never issued, otherwise valid: a node serves them, the dataflow turns their trajectories away."""
    return st.integers(1, 10**9).map(lambda k: Poison("task", "task_id", f"a task never issued (f{k})",
                                                      base.model_copy(update={"task_id": f"f{k}"}), f"'f{k}'"))


# ---------------------------------------------------------------------------------------------- batches
def poisoned_batches(base: Batch, view: RunView) -> Fields:
    """Batches a trainer turns away (``train/vetting.py``): unplanned, forged under a planned id, and, with a forged
    plan record that matches them (``extra['plan']``: a writer the permissions let through), values it cannot train."""
    k = len(base.trajectories)

    def mk(fld: str, label: str, expect: str, plan: bool, **update: Any) -> Poison:
        return Poison("batch", fld, label, base.model_copy(update=update), expect, extra={"plan": plan})

    def traj0(**update: Any) -> list[Trajectory]:
        return [base.trajectories[0].model_copy(update=update), *base.trajectories[1:]]

    out = [
        ("batch_id", st.integers(1, 10**9).map(lambda i: mk("batch_id", f"batch f{i}, never planned", "unplanned", False, batch_id=f"f{i}"))),
        ("advantages", st.floats(-10, 10).map(lambda a: Poison("batch", "advantages", f"other advantages ({a:.2f}) under a planned id",
                                                base.model_copy(update={"advantages": _f32(np.full(k, a))}), "forged",
                                                extra={"plan": "base"}))),
        ("advantages", st.one_of(NON_FINITE.map(lambda x: _f32(np.r_[x, np.zeros(k - 1)])), st.integers(0, 3 * k).filter(lambda m: m != k).map(
            lambda m: _f32(np.zeros(m)))).map(lambda a: mk("advantages", f"{len(a) // 4} advantages, or non-finite", "invalid", True,
                                                           advantages=a))),
        ("policy", st.sampled_from(["verifier", "critic"]).map(lambda p: mk("policy", f"policy {p!r}", "invalid", True, policy=p))),
        ("trajectories", st.integers(view.vocab, 2**31 - 1).map(lambda t: mk("trajectories", f"token {t}", "invalid", True, trajectories=traj0(
            completion_ids=_i32([t, *base.trajectories[0].completion()[1:]]))))),
        ("trajectories", st.integers(-(2**31), -(10**6)).map(lambda v: mk("trajectories", f"tokens of v{v}", "stale", True,
                                                         trajectories=[t.model_copy(update={"versions": _i32(np.full(len(t.versions) // 4, v))})
                                                                       for t in base.trajectories]))),
        ("advantages", st.floats(1e38, 3e38).map(lambda a: mk("advantages", f"advantages {a:.1e}", "non_finite", True, advantages=_f32(np.full(k, a))))),
    ]
    return by_field(out)


# ---------------------------------------------------------------------------------------------- weights
SHA = "ab" * 32


def poisoned_announcements(base: WeightVersion) -> Fields:
    """Announcements impossible on their face, or from the past (``weights/checks.py``), derived from a real one."""
    v, ref = base.version, base.objects[0]

    def mk(fld: str, label: str, expect: str, **update: Any) -> Poison:
        return Poison("weights", fld, label, base.model_copy(update=update), expect)

    future = st.integers(v + 10**6, 2**62)
    ahead = {"version": v + 10**6, "encoding": "keyframe", "base_version": None, "base_digest": None, "keyframe_version": v + 10**6}
    out = [
        ("version", st.integers(-(2**62), -1).map(lambda x: mk("version", f"version {x}", "< 0", version=x))),
        ("version", st.integers(0, v).map(lambda x: mk("version", f"v{x} again, another state (the past)", "announced", version=x,
                                                       encoding="keyframe", base_version=None, base_digest=None, keyframe_version=x,
                                                       state_digest=SHA))),
        ("base_version", future.map(lambda x: mk("base_version", f"delta v{x} onto v{x}", "not an earlier version", version=x, encoding="delta",
                                base_version=x, base_digest=SHA, keyframe_version=0))),
        ("base_version", future.map(lambda x: mk("base_version", f"delta v{x} without a base", "without a base", version=x, encoding="delta",
                                base_version=None, base_digest=None))),
        ("base_version", future.map(lambda x: mk("base_version", f"keyframe v{x} with a base", "names a base", version=x, encoding="keyframe",
                                base_version=x - 1, base_digest=SHA, keyframe_version=x))),
        ("keyframe_version", future.map(lambda x: mk("keyframe_version", f"keyframe v{x} naming keyframe v{x + 1}", "names keyframe_version", version=x,
                                encoding="keyframe", base_version=None, base_digest=None, keyframe_version=x + 1))),
        ("state_digest", st.text("xyz!", min_size=1, max_size=70).map(lambda d: mk("state_digest", f"state_digest {d[:10]!r}", "not a sha256",
                                                                  **ahead, state_digest=d))),
        ("objects", st.integers(0, 3).filter(lambda k: k != 1).map(lambda k: mk("objects", f"{k} objects", "objects", **ahead,
                                                                    objects=[ref] * k))),
        ("objects", st.integers(1, 50).map(lambda k: mk("objects", f"{len(ref.digests) + k} chunk digests", "chunk digests", **ahead,
                                            objects=[ref.model_copy(update={"digests": ref.digests + [SHA] * k})]))),
        ("objects", st.sampled_from(["a.b", "x y", "*", ">", ""]).map(lambda s: mk("objects", f"object id {s!r}", "subject token", **ahead,
                                                                       objects=[ref.model_copy(update={"nuid": s})]))),
        ("policy", st.sampled_from(["critic", "verifier"]).map(lambda p: mk("policy", f"policy {p!r} on solver's subject", "of policy", policy=p,
                                                                 **ahead))),
    ]
    return by_field(out)


# ---------------------------------------------------------------------------------------------- heartbeats
def poisoned_heartbeats(worker: str, pool: str = "raas") -> Fields:
    """Heartbeats a rollout credential may publish (``hb.rollout.*``) with values no role sends: non-finite or
    absurd stats, another role's stats, a time from another age. Heartbeats are only liveness: nothing is
    dead-lettered; the consumers (dataflow's autoscale, the launcher) must stay up and finite."""
    bad = st.one_of(NON_FINITE, st.sampled_from([-1e308, 1e308, -1.0]))

    def mk(fld: str, label: str, **kw: Any) -> Poison:
        return Poison("heartbeat", fld, label, Heartbeat(**{"worker_id": worker, "pool": pool, "stats": RolloutStats(joined=True), **kw}))

    out = [
        ("stats", bad.map(lambda x: mk("stats", f"gen_s {x}", stats=RolloutStats(joined=True, gen_s=x)))),
        ("stats", bad.map(lambda x: mk("stats", f"a trainer's wait_s {x} on a rollout subject", policy="solver", stats=TrainerStats(wait_s=x,
                                                                                                                  wait_frac=x)))),
        ("ts", bad.map(lambda x: mk("ts", f"ts {x}", ts=x))),
        ("version", st.integers(-(2**62), 2**62).map(lambda v: mk("version", f"version {v}", version=v))),
        ("worker_id", st.integers(1, 200).map(lambda k: mk("worker_id", f"{k} node ids", worker_id=f"{worker}-{k}"))),
    ]
    return by_field(out)


# ---------------------------------------------------------------------------------------------- run state
def poisoned_keyframe_requests(policies: tuple[str, ...]) -> st.SearchStrategy[Poison]:
    """``keyframe_request.*`` values a rollout credential may write: garbage, another schema, another policy."""
    values = st.sampled_from([b"", b"garbage", b"{}", b'{"v": 1}', b'{"v": 99, "policy": "solver"}', b"\xff" * 1000,
                              b'{"v": 1, "policy": "critic", "by": "x"}', b"[" * 10000])
    keys = st.sampled_from([*policies, "critic"])
    return st.tuples(keys, values).map(lambda kv: Poison("keyframe_request", "value", f"{kv[1][:16]!r} at {kv[0]}", raw=kv[1],
                                                         key=f"keyframe_request.{kv[0]}"))
