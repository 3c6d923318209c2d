"""Elastic pool with processes: join, grow, SIGKILL one node, stop one gracefully; every task once.

Real ``astraflow worker rollout`` processes (scripted engine over the recipe's tiny model) on
a real nats-server, pool ``raas``, task ``ack_wait`` 3 s. Tasks are published directly; the
trajectory stream is read through the dataflow's durable consumer and assembled with the
dataflow's own ``Assembler``. A small recipe plugin (written below) makes node B and node C
hold their first tasks until the test decides, so "dies while holding" and "leaves while
holding" happen for certain, not by timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.config import load_recipe
from astraflow.dataflow.groups import Assembler
from astraflow.models import build_model, load_tokenizer
from astraflow.streams.messages import Heartbeat, Task
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.trajectories import carried
from astraflow.streams.trajectory_log import TrajectoryLog
from astraflow.weights.publish import WeightPublisher

PLUGIN = '''
"""Test plugin: a node with a hold-{node} file holds its first tasks until release-{node} appears."""
import json, os, pathlib, time
from astraflow.registry import WORKFLOWS
from astraflow.rollout.workflows.single_turn import SingleTurn


@WORKFLOWS.register("gated_single_turn")
class GatedSingleTurn(SingleTurn):
    def run(self, tasks, policies, node_id):
        gate = pathlib.Path(os.environ["AF_TEST_GATE_DIR"])
        if (gate / f"hold-{node_id}").exists() and not (gate / f"holding-{node_id}").exists():
            (gate / f"holding-{node_id}.tmp").write_text(json.dumps([t.task_id for t in tasks]))
            os.replace(gate / f"holding-{node_id}.tmp", gate / f"holding-{node_id}")
            while not (gate / f"release-{node_id}").exists():
                time.sleep(0.05)
        return super().run(tasks, policies, node_id)
'''

N_TASKS, GROUP = 24, 2


def write_recipe(tmp: Path) -> Path:
    (tmp / "gate_plugin.py").write_text(PLUGIN)
    recipe = {
        "name": "elastic", "workflow": "gated_single_turn", "reward": "arithmetic", "policies": ["solver"],
        "model": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
        "rollout": {"engine": {"type": "scripted", "latency": "constant", "latency_median_s": 0.2, "concurrency": 4},
                    "tasks_per_generate": 2, "max_new_tokens": 3, "drain_timeout": 1.0, "plugins": [str(tmp / "gate_plugin.py")]},
        "plane": {"task_ack_wait": 3.0},
        "dataflow": {"group_size": GROUP},
        "eval": {"enabled": False},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    load_recipe(path)  # a valid recipe
    return path


class Pool:
    """The rollout processes this test started (and only those: ended by handle)."""

    def __init__(self, recipe: Path, url: str, run: str, tmp: Path) -> None:
        self.recipe, self.url, self.run, self.tmp = recipe, url, run, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str) -> None:
        log = open(self.tmp / f"{node}.log", "wb")
        cmd = [sys.executable, "-m", "astraflow.cli", "worker", "rollout", "--recipe", str(self.recipe), "--nats", self.url,
               "--run", self.run, "--id", node, "--region", f"r-{node}", "--hardware", "cpu-test"]
        self.procs[node] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "AF_TEST_GATE_DIR": str(self.tmp)}
        )
        log.close()

    def log(self, node: str) -> str:
        return (self.tmp / f"{node}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


async def wait_for(pred, what: str, timeout: float = 90.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_nodes_join_die_and_leave_and_every_task_is_trained_once(nats_server, run_id, tmp_path):
    recipe_path = write_recipe(tmp_path)
    recipe = load_recipe(recipe_path)
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "test")
    await plane.ensure_topology(recipe.topology())
    tok = load_tokenizer("byt5")
    await WeightPublisher(plane, "solver").publish(build_model(recipe.policies["solver"].model, tok).state_dict(), 0, force_keyframe=True)

    beats: dict[str, Heartbeat] = {}

    def on_beat(hb: Heartbeat) -> None:
        beats[hb.worker_id] = hb

    await plane.on_heartbeats(on_beat)
    assembler, trained, duplicates, seen, served_by = Assembler(), {}, [], [], {}
    sub = TrajectoryLog(plane).reader()

    async def collect() -> None:
        while True:
            for d in await sub.pull(batch=64, timeout=0.5):
                for t in carried(d.msg):  # a task's group comes as one message
                    seen.append(t.traj_id)
                    held = assembler.add(t, d.position)
                    if held is False:
                        duplicates.append(t.traj_id)
                        continue
                    served_by.setdefault(t.task_id, set()).add(t.node_id)  # the nodes whose samples make up the group
                    if held is not None:
                        if held.task_id in trained:
                            duplicates.append(held.task_id)
                        trained[held.task_id] = held
                await d.ack()

    tasks = [Task(task_id=f"e{i:03d}", workflow="gated_single_turn", policy="solver", prompt_id=f"p{i}", prompt=f"{i % 10}+1=",
                  group_size=GROUP, meta={"answer": str(i % 10 + 1)}) for i in range(N_TASKS)]
    pool = Pool(recipe_path, nats_server.url, run_id, tmp_path)
    collector = asyncio.create_task(collect())
    try:
        # 1. one node joins and serves the first tasks; two more are added (they boot meanwhile)
        pool.start("A")
        await plane.publish_many([(plane.names.task(t.workflow), t, t.task_id) for t in tasks[:4]])
        pool.start("B")
        pool.start("C")
        await wait_for(lambda: len(trained) >= 4, "the first tasks to be served")
        # 2. from now on B and C hold the next tasks they take (the gate plugin), until the test decides
        (tmp_path / "hold-B").touch()
        (tmp_path / "hold-C").touch()
        await wait_for(lambda: all(beats.get(n) and getattr(beats[n].stats, "joined", False) for n in "BC"), "B and C to join the pool")
        assert beats["B"].region == "r-B" and beats["C"].hardware == "cpu-test" and beats["B"].pool == "raas"
        await plane.publish_many([(plane.names.task(t.workflow), t, t.task_id) for t in tasks[4:]])
        await wait_for(lambda: (tmp_path / "holding-B").exists() and (tmp_path / "holding-C").exists(), "B and C to hold tasks")
        held_b = json.loads((tmp_path / "holding-B").read_text())
        held_c = json.loads((tmp_path / "holding-C").read_text())
        # 3. B dies holding its tasks; C is stopped gracefully holding its tasks (drain timeout 1 s: it naks them)
        pool.procs["B"].send_signal(signal.SIGKILL)
        pool.procs["C"].send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(pool.procs["C"].wait, 60) == 0, pool.log("C")[-3000:]
        assert pool.procs["B"].wait(30) == -signal.SIGKILL
        # 4. everything is trained, by A, exactly once
        await wait_for(lambda: len(trained) == N_TASKS, f"all {N_TASKS} tasks to be trained (have {len(trained)})", timeout=120)
        pool.procs["A"].send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(pool.procs["A"].wait, 60) == 0, pool.log("A")[-3000:]
    finally:
        collector.cancel()
        pool.stop_all()
    try:
        assert sorted(trained) == [t.task_id for t in tasks]  # none lost
        assert duplicates == [] and len(seen) == len(set(seen)) == N_TASKS * GROUP  # none trained twice, none stored twice
        assert held_b and held_c and not set(held_b) & set(held_c)
        for task_id in held_b + held_c:  # what B died with and C gave back was served by A
            assert task_id in trained and served_by[task_id] == {"A"}
        assert await plane.stored.stream_msgs(plane.names.task_stream) == 0  # every task acked
        lag = await plane.stored.lag(plane.names.task_stream, plane.names.pool_consumer())
        assert lag.redelivered >= 1 or "drained" in pool.log("C")
        assert "drained_naks" in pool.log("C") and "left" in pool.log("C")
    finally:
        await plane.close()
