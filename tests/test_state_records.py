"""Run-state records read back: what ``Record.decode`` accepts, and the reason it gives for what it refuses.

``decode`` parses and validates in one strict pass with pydantic's JSON parser; a value that pass refuses goes through
the checks one by one, so the reason names what is wrong. Both must agree on every record a writer of this build
produces, and such a record must pass the strict pass."""

from __future__ import annotations

import json

import pytest

from astraflow.streams.dataflow_state import BatchPlan, DataflowState, LaneState, LedgerState, Quarantine, TaskState
from astraflow.streams.messages import Task, TrajRef
from astraflow.streams.state import (
    AdmitRecord,
    AutoscaleRecord,
    BatchPlanRecord,
    DoneRecord,
    EvalRecord,
    FateRecord,
    KeyframeRequest,
    Record,
    StateSchemaError,
    VersionRecord,
)

VERSION = {"v": 1, "policy": "solver", "version": 3}


def a_dataflow_state() -> DataflowState:
    """A state as a run writes it: a lane with a plan, history and plug-in state; tasks in flight and written ahead."""
    task = Task(task_id="t00000009", workflow="single_turn", policy="solver", prompt_id="add-71-65", prompt="71+65=", group_size=8,
                meta={"answer": "136"}, min_versions={"solver": 3})
    plan = BatchPlan(batch_id="solver-b000004", tasks=["t00000001"], groups=["t00000001"],
                     refs=[TrajRef(seq=10 + i, traj_id=f"t00000001.solver.{i}", task_id="t00000001") for i in range(8)],
                     advantages=[0.5, -0.5] * 4, created_at=1.5)
    lane = LaneState(batch_seq=4, ledger=LedgerState(issued=9, received=8, samples=64, fates={"trained": 3}),
                     pipeline={"advantage": [{"name": "grpo", "state": {}}]}, plans={plan.batch_id: plan},
                     awaiting={plan.batch_id: ["t00000001"]}, history=[[float(i), 8.0 * i, 9.0 * i, 1.0, 0.5] for i in range(40)],
                     followed=3)
    tasks = TaskState(task_seq=9, cursor=9, in_flight={"t00000009": None, "t00000008": 12.5}, floors=[(1, {"solver": 0})],
                      issuing=[task])
    quarantined = {"node-7": Quarantine(node="node-7", at=12.5, reason="reward 1 claimed, its completion scores 0",
                                        failures={"reward_claim": 3})}
    return DataflowState(tasks=tasks, lanes={"solver": lane}, quarantined=quarantined)


RECORDS: list[Record] = [  # every kind of record the run writes
    VersionRecord(policy="solver", version=7, lineage="abc"),
    DoneRecord(policy="solver", version=400),
    EvalRecord(policy="solver", version=20, reward=0.75, avg_at_k=0.75, pass_at_k=1.0, k=1, n=200),
    AutoscaleRecord(pool="raas", target=2, action="up", reason="the trainer waits", need=None, nodes=1, wait_frac=0.4,
                    produce_rate=310.5, consume_rate=290.0, busy=0.8),
    KeyframeRequest(policy="solver", by="rollout-0", reason="lost its chain"),
    AdmitRecord(node="node-7", quarantined_at=12.5),
    FateRecord(policy="solver", task_id="t00000003", fate="trained", batch="solver-b000004", version=5),
    BatchPlanRecord(policy="solver", batch_id="solver-b000004", digest="d" * 64, trajectories=64),
    a_dataflow_state(),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_a_record_reads_back_as_written(record: Record) -> None:
    data = record.encode()
    assert type(record).decode(record.key, data) == record
    assert type(record).model_validate_json(data, strict=True) == record  # in the one strict pass, not the slow path
    assert type(record)._decode_with_reasons(record.key, data) == record  # the step-by-step checks agree


def test_a_value_of_a_looser_type_is_read_as_before() -> None:
    """A record written by hand with a number as a string is not what this build writes: the strict pass refuses it,
    and the step-by-step checks read it as they always did."""
    assert VersionRecord.decode("version.solver", json.dumps({**VERSION, "version": "3"}).encode()).version == 3


REFUSED = {
    "not JSON": (b"{nope", "not JSON"),
    "not an object": (b"[1, 2]", "not a record"),
    "no schema version": (json.dumps({k: v for k, v in VERSION.items() if k != "v"}).encode(), "schema version None"),
    "another schema version": (json.dumps({**VERSION, "v": 2}).encode(), "schema version 2"),
    "a schema version as a string": (json.dumps({**VERSION, "v": "1"}).encode(), "schema version '1'"),
    "a schema version as a float": (json.dumps({**VERSION, "v": 1.0}).encode(), "schema version 1.0"),
    "a schema version as a boolean": (json.dumps({**VERSION, "v": True}).encode(), "schema version True"),
    "a value out of range": (json.dumps({**VERSION, "version": -1}).encode(), "invalid VersionRecord"),
    "an unknown field": (json.dumps({**VERSION, "extra": 1}).encode(), "invalid VersionRecord"),
    "a field of another type": (json.dumps({**VERSION, "policy": ["solver"]}).encode(), "invalid VersionRecord"),
}


@pytest.mark.parametrize("case", REFUSED, ids=str)
def test_a_value_that_is_not_a_record_is_refused_with_its_reason(case: str) -> None:
    data, reason = REFUSED[case]
    with pytest.raises(StateSchemaError, match=f"^version.solver: {reason}"):
        VersionRecord.decode("version.solver", data)


def test_a_dataflow_state_of_another_schema_version_is_refused() -> None:
    """The largest record: a whole state whose fields all validate is still refused under another schema version."""
    state = json.loads(a_dataflow_state().encode())
    with pytest.raises(StateSchemaError, match="schema version 2"):
        DataflowState.decode("dataflow", json.dumps({**state, "v": 2}).encode())
