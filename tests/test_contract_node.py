"""The wire contract from outside Python: JSON Schema export, and a Node.js rollout node.

The Node.js example (``examples/node/raas.js``, ``nats`` + ``@msgpack/msgpack`` from npm) pulls
real tasks from the pool's durable consumer on a real nats-server and publishes trajectories;
the Python side must decode every one (nothing in the DLQ), assemble them into complete groups
with the dataflow's own assembler, and find them valid against the exported schema.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from node_example import NODE, installed

from astraflow import schema
from astraflow.dataflow.groups import Assembler
from astraflow.rollout.rewards import arithmetic
from astraflow.streams.messages import Heartbeat, Rejected, RolloutStats, Task, Trajectory
from astraflow.streams.plane import Plane


def test_committed_schemas_are_up_to_date(repo_root):
    assert schema.stale(repo_root / "schemas") == [], "run `python -m astraflow.schema`"
    proc = subprocess.run([sys.executable, "-m", "astraflow.schema", "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_schema_marks_packed_arrays_and_field_owners(repo_root):
    traj = json.loads((repo_root / "schemas" / "trajectory.json").read_text())
    assert traj["x-astraflow-kind"] == "trajectory"
    assert traj["properties"]["versions"]["x-astraflow-packed"]["dtype"] == "int32"
    assert traj["properties"]["loss_mask"]["x-astraflow-packed"]["dtype"] == "uint8"
    assert "aligned with completion_ids" in traj["properties"]["logprobs"]["description"]
    assert set(traj["required"]) >= {"traj_id", "task_id", "policy", "completion_ids", "logprobs", "versions", "loss_mask"}


def _validator(repo_root, kind: str):
    """A stock JSON Schema validator for ``kind``; it checks messages in their JSON mapping (msgpack bin as base64)."""
    jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema package (test extra) is not installed")
    body = json.loads((repo_root / "schemas" / f"{kind}.json").read_text())
    jsonschema.Draft202012Validator.check_schema(body)
    return jsonschema.Draft202012Validator(body)


def _errors(validate, fields: dict) -> list[str]:
    return sorted(e.message for e in validate.iter_errors(schema.json_mapping(fields)))


@pytest.fixture(scope="module")
def node_example() -> Path:
    return installed()


async def test_node_runtime_pulls_tasks_and_publishes_valid_trajectories(node_example, repo_root, nats_server, plane: Plane, run_id):
    tasks = [Task(task_id=f"t{i}", workflow="single_turn", policy="solver", prompt_id=f"add-{i}-{i + 1}", prompt=f"{i}+{i + 1}=",
                  group_size=3, meta={"answer": str(2 * i + 1)}) for i in range(4)]
    too_new = Task(task_id="t-future", workflow="single_turn", policy="solver", prompt_id="add-9-9", prompt="9+9=", group_size=2,
                   meta={"answer": "18"}, min_versions={"solver": 5})
    garbage = b"\x01\xc1 not a task"
    await plane._js.publish(plane.names.task("single_turn"), garbage)  # a node dead-letters what it cannot decode
    await plane.publish_many([(plane.names.task(t.workflow), t, t.task_id) for t in [too_new, *tasks]])

    beats: list[Heartbeat] = []
    hb = await plane.on_heartbeats(beats.append)
    proc = subprocess.run([NODE, "raas.js", "--url", nats_server.url, "--run", run_id, "--max-tasks", str(len(tasks)),
                           "--idle-ms", "3000", "--node-id", "js-1"], cwd=node_example, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stats["tasks"] == len(tasks) and stats["trajectories"] == 3 * len(tasks) and stats["naks"] >= 1
    assert stats["rejected"] == 1
    for _ in range(100):  # its last beat, "stopped", was sent before it drained: wait for it to arrive here
        if any(b.worker_id == "js-1" and b.state == "stopped" for b in beats):
            break
        await asyncio.sleep(0.1)
    await hb.stop()
    last = [b for b in beats if b.worker_id == "js-1"][-1]  # decoded strictly, like every heartbeat
    assert last.state == "stopped" and isinstance(last.stats, RolloutStats) and last.stats.tasks == len(tasks)

    sub = plane.consumer(plane.names.traj_stream, plane.names.DATAFLOW_CONSUMER, Trajectory)
    got = []
    while True:
        batch = await sub.pull(batch=64, timeout=1.0)
        if not batch:
            break
        got += batch
    (rejected,) = await plane.history(plane.names.dlq("task"), Rejected, stream=plane.names.dlq_stream)
    assert rejected.payload == garbage and rejected.worker_id == "js-1" and rejected.subject == plane.names.task("single_turn")
    assert await plane.stored.stream_msgs(plane.names.dlq_stream) == 1, "a Node trajectory failed to decode or validate"
    assembler, groups = Assembler(), []
    for d in got:
        held = assembler.add(d.msg, d)
        assert held is not False, f"duplicate {d.msg.traj_id}"
        if held is not None:
            groups.append(held)
        await d.ack()
    assert sorted(g.group.task_id for g in groups) == [t.task_id for t in tasks]  # t-future was refused, not served
    validate = _validator(repo_root, "trajectory")
    for d in got:
        t = d.msg
        assert t.node_id == "js-1" and t.meta == {"runtime": "node"}
        assert len(t.completion()) == len(t.behaviour_logprobs()) == len(t.token_versions()) == len(t.mask())
        assert set(t.token_versions().tolist()) == {0}
        text = bytes(x - 3 for x in t.completion().tolist() if x >= 3).decode()
        assert t.reward == arithmetic(text, {"answer": next(x.meta["answer"] for x in tasks if x.task_id == t.task_id)})
        body = msgpack.unpackb(d.data[1:], raw=False)
        assert body["k"] == "trajectory"
        assert not _errors(validate, body["d"])
    # every served task was acked after its trajectories were stored; the refused one is still in the pool
    assert await plane.stored.stream_msgs(plane.names.task_stream) == 1


