"""kill -9 the dataflow mid-run and restart it: roles as processes on a real nats-server.

The first dataflow kills itself (SIGKILL) at the worst moment: right after publishing a batch,
before it recorded that or acked anything. Its successor must publish that batch again under
the same id (the server keeps one copy) and not batch its groups a second time; then the test
SIGKILLs the successor at an arbitrary point and starts a third. The trainer must train every
batch exactly once, no task may appear in two batches, and the accounting must add up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from astraflow.config import parse_recipe
from astraflow.streams.codec import decode
from astraflow.streams.dataflow_state import Accounting, DataflowState
from astraflow.streams.messages import Batch, WeightVersion
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.state import DoneRecord

STEPS = 8
RECIPE = {
    "name": "durable", "policies": ["solver"], "workflow": "single_turn", "reward": "arithmetic",
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
    "data": {"n_train": 60, "n_eval": 10},
    "trainer": {"steps": STEPS, "keyframe_every": 4},
    "rollout": {"engine": {"type": "scripted", "latency": "constant", "latency_median_s": 0.05}, "tasks_per_generate": 2,
                "max_new_tokens": 3},
    "dataflow": {"group_size": 4, "groups_per_batch": 2, "max_tasks_in_flight": 6, "max_staleness": 2},
    "eval": {"enabled": False},
    "plane": {"task_ack_wait": 5.0, "traj_ack_wait": 3.0},  # redelivery after a death takes seconds
}


class Roles:
    def __init__(self, url: str, run: str, recipe_file: Path, logs: Path) -> None:
        self.url, self.run, self.recipe_file, self.logs = url, run, recipe_file, logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, role: str, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "ab")
        cmd = [sys.executable, "-m", "astraflow.cli", "worker", role, "--recipe", str(self.recipe_file), "--nats", self.url,
               "--run", self.run, "--id", name]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def tail(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(self.logs.glob("*.log")))


async def wait_for(check: Any, what: str, timeout: float, roles: Roles) -> Any:
    """Poll the plane (not the clock) until ``check()`` returns something truthy; the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await check()
        if got:
            return got
        crashed = [p.args[4] for p in roles.procs[:2] if p.poll() not in (None, 0)]  # trainer and rollout must not fail
        assert not crashed, f"{crashed} exited\n{roles.tail()}"
        await asyncio.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n{roles.tail()}")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_dataflow_survives_sigkill_without_losing_or_rebatching(nats_server, run_id, tmp_path):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(RECIPE))
    (tmp_path / "logs").mkdir()
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "test")
    await plane.ensure_topology(parse_recipe(RECIPE).topology())
    published: list[Batch] = []

    async def on_batch(msg: Any) -> None:  # every publication, including a republished copy the stream drops
        published.append(decode(msg.data, Batch))

    await plane._nc.subscribe(f"af.{run_id}.batch.>", cb=on_batch)
    roles = Roles(nats_server.url, run_id, recipe_file, tmp_path / "logs")

    async def state() -> DataflowState:
        return await plane.state.get(DataflowState) or DataflowState()

    try:
        roles.start("trainer", "trainer-solver")
        roles.start("rollout", "rollout-0")
        first = roles.start("dataflow", "dataflow-1", {"ASTRAFLOW_CRASH": "batch_published@2"})

        async def first_died() -> bool:
            return first.poll() is not None

        await wait_for(first_died, "the first dataflow to kill itself after publishing batch 2", 150, roles)
        assert first.returncode == -signal.SIGKILL
        planned = (await state()).lanes["solver"].plans
        assert list(planned) == ["solver-b000002"]  # published, never confirmed

        second = roles.start("dataflow", "dataflow-2")

        async def four_batches() -> bool:
            lane = (await state()).lanes.get("solver")
            return lane is not None and lane.batch_seq >= 4

        await wait_for(four_batches, "four batches", 90, roles)
        second.send_signal(signal.SIGKILL)  # mid-run, wherever it is
        second.wait()
        roles.start("dataflow", "dataflow-3")

        async def trained_all() -> bool:
            done = await plane.state.get(DoneRecord, "solver")
            return done is not None and done.version >= STEPS

        await wait_for(trained_all, f"{STEPS} training steps", 120, roles)

        async def settled() -> Accounting | None:
            acc = (await state()).accounting.get("solver")
            return acc if acc and acc.fates.get("trained") == STEPS * 2 and acc.adds_up else None

        acc = await wait_for(settled, "the accounting of every trained batch", 30, roles)
    finally:
        roles.stop()

    anns = await plane.history(plane.names.weights("solver"), WeightVersion)
    trained = [b for a in anns for b in a.batch_ids]
    assert [a.version for a in anns] == list(range(STEPS + 1))
    assert len(trained) == STEPS and len(set(trained)) == STEPS, trained  # every batch trained exactly once
    copies = [b for b in published if b.batch_id == "solver-b000002"]
    assert len(copies) == 2 and copies[0].task_ids == copies[1].task_ids  # republished under its id, the same batch
    assert copies[0].advantages == copies[1].advantages and copies[0].refs == copies[1].refs and copies[0].digest() == copies[1].digest()
    by_id = {b.batch_id: b.task_ids for b in published}
    tasks = [t for ids in by_id.values() for t in ids]
    assert len(tasks) == len(set(tasks)), by_id  # no group in two batches
    assert acc.total == acc.in_flight + acc.buffered + acc.awaiting + sum(acc.fates.values())
    log = (tmp_path / "logs" / "dataflow-2.log").read_text()
    assert "solver-b000002 was planned before the restart" in log, acc
    await plane.close()
