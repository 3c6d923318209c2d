"""The exported JSON Schemas and Python's wire decoder agree: each rejects what the other rejects.

A stock JSON Schema validator checks a decoded message in its JSON mapping (msgpack bin as
base64); Python decodes the same bytes with ``codec.decode`` (strict). What JSON Schema cannot
say is listed in the schema's ``x-astraflow-rules``, and Python rejects those cases too.
"""

from __future__ import annotations

import json
from typing import ClassVar

import msgpack
import numpy as np
import pytest
from factories import a_trajectory
from pydantic import model_validator

from astraflow import schema
from astraflow.streams.codec import DecodeError, decode, encode
from astraflow.streams.messages import (
    KINDS,
    MAX_GROUP,
    Batch,
    DataflowStats,
    EvaluatorStats,
    Heartbeat,
    Message,
    ObjectRef,
    Rejected,
    RolloutStats,
    Task,
    TrainerStats,
    Trajectory,
    TrajectoryBundle,
    TrajectoryGroup,
    TrajRef,
    WeightVersion,
)

jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema package (test extra) is not installed")


def validator(repo_root, kind: str):
    body = json.loads((repo_root / "schemas" / f"{kind}.json").read_text())
    jsonschema.Draft202012Validator.check_schema(body)
    return jsonschema.Draft202012Validator(body)


def traj(**kw) -> Trajectory:
    base = dict(prompt_ids=[1, 2], completion_ids=[3, 4, 1], logprobs=[-0.5, -0.1, -0.2], versions=[0, 0, 1], loss_mask=[1, 0, 1])
    return a_trajectory(kw.pop("task_id", "t"), kw.pop("index", 0), **{"traj_id": "t.solver.0", **base, **kw})


def samples() -> list:
    ref = ObjectRef(name="w/v1", nuid="n", size=3, chunk_size=3, digests=["a" * 64], digest="b" * 64)
    stats = [RolloutStats(tasks=2, joined=True, counters={"stale_naks": 1.0}), TrainerStats(wait_s=1.5, step={"loss": 0.1}),
             DataflowStats(issued=3), EvaluatorStats(evaluated=1)]
    return [
        Task(task_id="t", workflow="single_turn", policy="solver", prompt_id="p", prompt="1+1=", group_size=2, meta={"answer": "2"},
             min_versions={"solver": 3}),
        traj(),
        TrajectoryGroup(task_id="t", policy="solver", trajectories=[traj(), traj(traj_id="t.solver.1", index=1, reward=0.0)]),
        Batch(batch_id="b", policy="solver", refs=[TrajRef(seq=7, traj_id="t.solver.0", task_id="t"),
                                                   TrajRef(seq=9, traj_id="t.solver.1", task_id="t")],
              advantages=np.array([0.5, -0.5], np.float32), task_ids=["t"]),
        WeightVersion(policy="solver", version=1, encoding="delta", base_version=0, base_digest="d0", state_digest="d1",
                      keyframe_version=0, objects=[ref]),
        *(Heartbeat(worker_id="w", stats=s) for s in stats),
        Rejected(subject="af.r.task.x", reason="bad", worker_id="w", payload=b"\x01\xc1"),
        TrajectoryBundle(policy="solver", groups=[
            TrajectoryGroup(task_id="t", policy="solver", trajectories=[traj(), traj(traj_id="t.solver.1", index=1)]),
            TrajectoryGroup(task_id="u", policy="solver", trajectories=[traj(task_id="u", traj_id="u.solver.0")])]),
    ]


def fields_of(msg) -> dict:
    return msgpack.unpackb(encode(msg)[1:], raw=False)["d"]


def wire(kind: str, fields: dict) -> bytes:
    return b"\x01" + msgpack.packb({"k": kind, "d": fields}, use_bin_type=True)


def test_every_python_message_is_valid_against_its_schema(repo_root):
    for msg in samples():
        errors = list(validator(repo_root, msg.kind).iter_errors(schema.json_mapping(fields_of(msg))))
        assert not errors, (msg.kind, errors[0].message)
        assert decode(encode(msg), type(msg)) == msg
    assert {m.kind for m in samples()} == set(KINDS)


BROKEN = {  # a change to a valid trajectory's wire fields -> a word the schema's complaint contains
    "wrong schema version": ({"v": 2}, "1 was expected"),
    "list for a packed array": ({"completion_ids": [3, 4, 1]}, "is not of type 'string'"),
    "a partial int32": ({"versions": b"\x00" * 13}, "does not match"),
    "string for a number": ({"index": "0"}, "is not of type 'integer'"),
    "string for a float": ({"reward": "1.0"}, "is not valid under any of the given schemas"),
    "policy that is no subject token": ({"policy": "solver.x"}, "does not match"),
    "negative index": ({"index": -1}, "less than the minimum"),
    "unknown field": ({"surprise": 1}, "Additional properties"),
    "unknown finish reason": ({"finish_reason": "maybe"}, "is not one of"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_schema_and_python_both_reject(repo_root, case: str):
    change, complaint = BROKEN[case]
    fields = {**fields_of(traj()), **change}
    assert complaint in " ".join(e.message for e in validator(repo_root, "trajectory").iter_errors(schema.json_mapping(fields)))
    with pytest.raises(DecodeError):
        decode(wire("trajectory", fields), Trajectory)


CROSS_FIELD = {  # what JSON Schema cannot say: listed in x-astraflow-rules, checked by Python
    "arrays of different lengths": ({"logprobs": np.zeros(2, "<f4").tobytes()}, "same number of items"),
}


@pytest.mark.parametrize("case", sorted(CROSS_FIELD))
def test_cross_field_rules_are_listed_and_python_checks_them(repo_root, case: str):
    change, rule = CROSS_FIELD[case]
    body = json.loads((repo_root / "schemas" / "trajectory.json").read_text())
    assert any(rule in r for r in body["x-astraflow-rules"])
    fields = {**fields_of(traj()), **change}
    assert not list(validator(repo_root, "trajectory").iter_errors(schema.json_mapping(fields)))  # beyond JSON Schema
    with pytest.raises(DecodeError):
        decode(wire("trajectory", fields), Trajectory)


GROUP_RULES = {  # a trajectory group's cross-field rules: listed in x-astraflow-rules, checked by Python
    "another task": (1, {"task_id": "u", "traj_id": "u.solver.1"}, "group's task_id and policy"),
    "another policy": (1, {"policy": "verifier", "traj_id": "t.verifier.1"}, "group's task_id and policy"),
    "a traj_id twice": (1, {"index": 0, "traj_id": "t.solver.0"}, "distinct traj_id"),
    "by reference": (1, {**dict.fromkeys(("prompt_ids", "completion_ids", "logprobs", "versions", "loss_mask"), b""),
                         "payload_ref": {"name": "traj/x", "nuid": "n", "size": 1, "chunk_size": 1, "digests": ["a"], "digest": "b"}},
                     "no payload_ref"),
    "a member's arrays of different lengths": (0, {"logprobs": np.zeros(2, "<f4").tobytes()}, "obeys the `trajectory` rules"),
}


@pytest.mark.parametrize("case", sorted(GROUP_RULES))
def test_a_trajectory_groups_rules_are_listed_and_python_checks_them(repo_root, case: str):
    at, change, rule = GROUP_RULES[case]
    rules = json.loads((repo_root / "schemas" / "trajectory_group.json").read_text())["x-astraflow-rules"]
    assert any(rule.replace("`", "") in r for r in rules)
    fields = fields_of(samples()[2])
    fields["trajectories"][at] = {**fields["trajectories"][at], **change}
    assert not list(validator(repo_root, "trajectory_group").iter_errors(schema.json_mapping(fields)))  # beyond JSON Schema
    with pytest.raises(DecodeError):
        decode(wire("trajectory_group", fields), TrajectoryGroup)


BUNDLE_RULES = {  # case -> (a change to the second group's fields, the rule it breaks, what Python says)
    "the same task twice": ({"task_id": "t", "trajectories": "first"}, "no task_id has two groups", "a task_id has two groups"),
    "a traj_id in two groups": ({"trajectories": "first's traj_id"}, "no traj_id appears twice", "a traj_id appears twice"),
    "another policy": ({"policy": "verifier", "trajectories": "verifier's"}, "has the bundle's policy", "a group of policy verifier"),
    "a group that breaks its own rules": ({"task_id": "v"}, "obeys the trajectory_group rules", "in a group of v/solver"),
}


@pytest.mark.parametrize("case", sorted(BUNDLE_RULES))
def test_a_trajectory_bundles_rules_are_listed_and_python_checks_them(repo_root, case: str):
    change, rule, says = BUNDLE_RULES[case]
    rules = json.loads((repo_root / "schemas" / "trajectory_bundle.json").read_text())["x-astraflow-rules"]
    assert any(rule in r for r in rules)
    fields = fields_of(samples()[-1])
    first, second = fields["groups"]
    if change.get("trajectories") == "first":  # the first group's samples again, under the same task
        second.update(task_id="t", trajectories=[{**t, "traj_id": f"t.solver.{i + 5}", "index": i + 5}
                                                 for i, t in enumerate(first["trajectories"])])
    elif change.get("trajectories") == "first's traj_id":
        second["trajectories"][0]["traj_id"] = first["trajectories"][0]["traj_id"]
    elif change.get("trajectories") == "verifier's":  # a well-formed group of another policy
        second.update(policy="verifier",
                      trajectories=[{**t, "policy": "verifier", "traj_id": "u.verifier.0"} for t in second["trajectories"]])
    else:
        second.update(change)
    assert not list(validator(repo_root, "trajectory_bundle").iter_errors(schema.json_mapping(fields)))  # beyond JSON Schema
    with pytest.raises(DecodeError, match=says):
        decode(wire("trajectory_bundle", fields), TrajectoryBundle)


def test_a_bundle_carries_no_more_trajectories_than_a_group_may(repo_root):
    rules = json.loads((repo_root / "schemas" / "trajectory_bundle.json").read_text())["x-astraflow-rules"]
    assert any(f"at most {MAX_GROUP} trajectories in all" in r for r in rules)
    fields = fields_of(samples()[-1])
    one = fields["groups"][0]["trajectories"][0]
    for g, task in zip(fields["groups"], "tu", strict=True):  # two groups of 2,049: each a valid group, too many in all
        g["trajectories"] = [{**one, "task_id": task, "traj_id": f"{task}.solver.{i}", "index": i} for i in range(MAX_GROUP // 2 + 1)]
    with pytest.raises(DecodeError, match=f"{MAX_GROUP + 2} trajectories in one bundle"):
        decode(wire("trajectory_bundle", fields), TrajectoryBundle)
    for odd in (5, "x" * 5000, {"a": 1}, None):  # not a list where the trajectories belong: refused as any bad field
        fields["groups"][1]["trajectories"] = odd
        with pytest.raises(DecodeError):
            decode(wire("trajectory_bundle", fields), TrajectoryBundle)
    fields["groups"] = [5, "x"]
    with pytest.raises(DecodeError):
        decode(wire("trajectory_bundle", fields), TrajectoryBundle)


class Fragile(Message):
    """A message whose validator fails on a value it did not expect with an error pydantic does not wrap."""

    kind: ClassVar[str] = "fragile"
    x: int

    @model_validator(mode="after")
    def _divide(self) -> Fragile:
        1 / self.x  # ZeroDivisionError at 0
        return self


def test_a_validator_that_breaks_on_a_value_refuses_the_message_and_raises_nothing_else():
    assert decode(wire("fragile", {"x": 2}), Fragile).x == 2
    with pytest.raises(DecodeError, match="invalid fragile: ZeroDivisionError"):
        decode(wire("fragile", {"x": 0}), Fragile)


def test_batch_advantages_align_with_its_references(repo_root):
    good = fields_of(samples()[3])
    short = {**good, "advantages": good["advantages"][:4]}
    with pytest.raises(DecodeError, match="one value per trajectory"):
        decode(wire("batch", short), Batch)
    assert any("advantages" in r for r in json.loads((repo_root / "schemas" / "batch.json").read_text())["x-astraflow-rules"])


def test_python_callers_still_construct_from_lists_and_numpy():
    a = traj(created_at=1.0)
    b = traj(created_at=1.0, completion_ids=np.array([3, 4, 1]), logprobs=np.array([-0.5, -0.1, -0.2]), versions=(0, 0, 1))
    assert a == b and a.completion().tolist() == [3, 4, 1]


def test_heartbeat_stats_are_told_apart_by_role(repo_root):
    hb = fields_of(Heartbeat(worker_id="w", stats=RolloutStats(tasks=1)))
    wrong = {**hb, "stats": {**hb["stats"], "role": "trainer"}}  # a rollout stat under the trainer's role
    assert list(validator(repo_root, "heartbeat").iter_errors(schema.json_mapping(wrong)))
    with pytest.raises(DecodeError):
        decode(wire("heartbeat", wrong), Heartbeat)


def test_base64_pattern_admits_whole_items_only():
    import base64
    import re

    for size in (1, 2, 4, 8):
        pattern = re.compile(schema.base64_pattern(size))
        for n in range(40):
            assert bool(pattern.match(base64.b64encode(bytes(n)).decode())) == (n % size == 0), (size, n)
