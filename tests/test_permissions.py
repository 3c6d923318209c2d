"""jetstream/accounts.conf: each role can do its job and nothing the design forbids."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from astraflow.streams.codec import encode
from astraflow.streams.messages import Task, Trajectory
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.state import VersionRecord
from astraflow.streams.server import nats_server_binary

ROOT = Path(__file__).resolve().parent.parent
PASSWORDS = {"admin": "pw-a", "rollout": "pw-r", "trainer": "pw-t", "dataflow": "pw-d"}


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acct")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = (ROOT / "jetstream" / "accounts.conf").read_text()
    conf = re.sub(r"listen: 127.0.0.1:\d+", f"listen: 127.0.0.1:{port}", conf).replace('"./nats-store"', f'"{tmp}"')
    path = tmp / "accounts.conf"
    path.write_text(conf)
    env = {**os.environ, **{f"ASTRA_{k.upper()}_PASSWORD": v for k, v in PASSWORDS.items()}}
    proc = subprocess.Popen([nats_server_binary(), "-c", str(path)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            import time

            time.sleep(0.05)
    yield f"nats://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


async def as_role(url: str, role: str, run: str) -> Plane:
    return await Plane.connect(NatsOptions(url=url, user=role, password=PASSWORDS[role]), run, role)


async def refused(plane: Plane, subject: str, payload: bytes) -> bool:
    try:
        await plane._js.publish(subject, payload, timeout=1.0)
    except Exception:  # the server answers a permissions violation: no ack ever comes
        return True
    return False


async def test_roles_do_their_job_and_nothing_more(secured_server):
    run, topo = "secure1", Topology(policies=("solver",))
    dataflow = await as_role(secured_server, "dataflow", run)
    await dataflow.ensure_topology(topo)  # the dataflow may create the run's streams
    task = Task(task_id="t1", workflow="math", policy="solver", prompt_id="p", prompt="1+1", group_size=1)
    await dataflow.publish(dataflow.names.task("math"), task, "t1")
    await dataflow.state.put(VersionRecord(policy="solver", version=0))

    rollout = await as_role(secured_server, "rollout", run)
    await rollout.ensure_topology(topo)  # read-only: everything exists already
    sub = rollout.consumer(rollout.names.task_stream, "raas", Task)
    (d,) = await sub.pull(timeout=2)
    traj = Trajectory(traj_id="t1.solver.0", task_id="t1", prompt_id="p", policy="solver", index=0, group_size=1,
                      prompt_ids=np.arange(3), completion_ids=np.arange(2), logprobs=np.zeros(2), versions=np.zeros(2),
                      loss_mask=np.ones(2), reward=1.0)
    await rollout.publish(rollout.names.traj("solver"), traj, traj.traj_id)
    await d.ack()
    assert (await rollout.state.get(VersionRecord, "solver")).version == 0  # may read the run state
    assert await refused(rollout, rollout.names.weights("solver"), b"x")
    assert await refused(rollout, rollout.names.task("math"), encode(task))
    assert await refused(rollout, rollout.names.batch("solver"), b"x")

    trainer = await as_role(secured_server, "trainer", run)
    assert await refused(trainer, trainer.names.task("math"), encode(task))
    assert await refused(trainer, trainer.names.traj("solver"), encode(traj))
    assert not await refused(trainer, trainer.names.weights("solver"), b"announcement")
    assert await refused(dataflow, dataflow.names.weights("solver"), b"x")

    assert await dataflow.stream_msgs(dataflow.names.traj_stream) == 1
    for p in (dataflow, rollout, trainer):
        await p.close()
    await asyncio.sleep(0)
