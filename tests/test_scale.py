"""No size limit on RL data, end to end on a real nats-server: a rollout node, the dataflow and a trainer process.

* a batch of 512 trajectories of 8,192 tokens, 4,096 of them generated (64 groups of 8, the GPU
  recipe's shape; 512 x 4,096 generated tokens alone encoded to 13.8 MiB as one batch message):
  about 36 MB of arrays, over the server's 8 MiB ``max_payload`` as one message, travels as a
  manifest of references; the trainer reads the trajectories by sequence and trains them;
* one trajectory of 1,048,576 tokens (a long-context episode: 1,040,384 tokens of context and
  8,192 generated), over ``max_payload`` by itself on a server with NATS's default 1 MiB, travels
  with its arrays in the trajectory bucket; the dataflow checks its values, the trainer trains it.

The episodes come from a labelled test workflow (random tokens with the engine's version and a
uniform behaviour logprob): generating millions of tokens with a model is not what is tested
here. The model is tiny, with a sliding attention window (``model.attention_window``) so a long
row costs time linear in its length on a CPU; ``trainer.micro_batch_tokens`` bounds its memory.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from test_train_support import Announcements, spawn_trainer, wait_exit

from astraflow.config import Recipe, load_recipe
from astraflow.dataflow.service import Dataflow
from astraflow.models import load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.node import RolloutNode
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.streams.codec import decode, encode
from astraflow.streams.messages import Batch, Task, Trajectory
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.state import FateRecord
from astraflow.streams.trajectory_log import TrajectoryLog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
UNIFORM = -math.log(256)  # the behaviour logprob of a token drawn uniformly from the 256 byte ids
TOK = load_tokenizer("byt5")


class LongEpisodes:
    """A test workflow (labelled: random tokens, not a model's): every task gets ``group_size`` episodes of
    ``context`` prompt tokens and ``generated`` completion tokens, each tagged with the engine's version."""

    policies = ("solver",)
    evaluation = "workflow"

    def __init__(self, context: int, generated: int) -> None:
        self.context, self.generated = context, generated

    def run(self, tasks: list[Task], policies: dict[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        version = policies["solver"].engine.version
        out = []
        for task in tasks:
            rng = np.random.default_rng(int(task.task_id[1:]))
            for i in range(task.group_size):
                out.append(Trajectory(
                    traj_id=f"{task.task_id}.solver.{i}", task_id=task.task_id, prompt_id=task.prompt_id, policy="solver", index=i,
                    group_size=task.group_size, prompt_ids=rng.integers(3, 259, self.context, dtype="<i4"),
                    completion_ids=rng.integers(3, 259, self.generated, dtype="<i4"),
                    logprobs=(UNIFORM + rng.uniform(-1e-3, 1e-3, self.generated)).astype("<f4"),  # as sampled: no two alike
                    versions=np.full(self.generated, version, "<i4"),
                    loss_mask=np.ones(self.generated, "<u1"), reward=float(i % 2), node_id=node_id))
        return out


def scale_recipe(tmp_path: Path, group_size: int, groups: int, generated: int, micro_batch_tokens: int,
                 context: int) -> tuple[Path, Recipe]:
    """``context``: prompt tokens of an episode; the model takes rows of ``context + generated`` (the node's task checks
    and the dataflow's length check hold it to that)."""
    data: dict[str, Any] = {
        "name": "scale", "policies": ["solver"],
        "model": {"hidden_size": 16, "intermediate_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "attention_window": 32,
                  "max_positions": context + generated},
        "sft": {"steps": 0}, "eval": {"enabled": False},
        "rollout": {"max_new_tokens": generated, "tasks_per_generate": 8},
        "dataflow": {"mode": "sync", "group_size": group_size, "groups_per_batch": groups, "max_tasks_in_flight": groups,
                     "trust_claims": True},  # LongEpisodes writes its own prompts and rewards: nothing to check them against
        "trainer": {"steps": 1, "micro_batch_tokens": micro_batch_tokens, "threads": 2, "lr": 1e-3},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_recipe(path)


async def train_end_to_end(url: str, run: str, tmp_path: Path, recipe_file: Path, recipe: Recipe, workflow: LongEpisodes,
                           timeout: float) -> tuple[list[Batch], Any, RolloutNode, Plane]:
    """Trainer process, rollout node and dataflow until the trainer has trained one batch and the dataflow knows it."""
    plane = await Plane.connect(NatsOptions(url=url), run, "test")
    await plane.ensure_topology(recipe.topology())
    manifests: list[Batch] = []

    async def on_batch(msg: Any) -> None:
        manifests.append(decode(msg.data, Batch))

    await plane._nc.subscribe(f"af.{run}.batch.>", cb=on_batch)
    anns = await Announcements(plane).start()
    log = tmp_path / "trainer.log"
    trainer = spawn_trainer(recipe_file, url, run, "solver", log)
    df_plane = await Plane.connect(NatsOptions(url=url), run, "dataflow")
    df = Dataflow(recipe, df_plane)
    await df.start()
    consumer = TrajectoryLog(df_plane).reader()
    node_plane = await Plane.connect(NatsOptions(url=url), run, "node-0")
    engine = ScriptEngine(TOK, lambda p: "", version=-1)
    node = RolloutNode(recipe, node_plane, "node-0", workflow=workflow,
                       handles={"solver": PolicyHandle(engine, TOK, SamplingParams(max_new_tokens=8), name="solver")})
    stop = asyncio.Event()
    running = asyncio.create_task(node.run(stop))
    lane = df.lanes["solver"]
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while lane.ledger.fates.get("trained", 0) < recipe.dataflow.groups_per_batch:
            assert loop.time() < deadline, f"not trained in {timeout:.0f}s: {df.accounting()['solver']}\n{log.read_text()[-3000:]}"
            assert trainer.poll() in (None, 0), log.read_text()[-3000:]
            assert not running.done(), running
            await df.step(consumer)
        assert await wait_exit(trainer) == 0, log.read_text()[-3000:]
        record = await anns.settle("solver", 1)
    finally:
        stop.set()
        await asyncio.gather(running, return_exceptions=True)
        if trainer.poll() is None:
            trainer.kill()
        await anns.close()
        await df.watch.stop()
        await df_plane.close()
        await node_plane.close()
    return manifests, record, node, plane


async def test_a_batch_of_512_trajectories_of_8192_tokens_is_trained_end_to_end(nats_server, run_id, tmp_path):
    groups, group_size, context, generated = 64, 8, 4096, 4096
    recipe_file, recipe = scale_recipe(tmp_path, group_size, groups, generated, micro_batch_tokens=4 * (context + generated),
                                       context=context)
    manifests, record, node, plane = await train_end_to_end(nats_server.url, run_id, tmp_path, recipe_file, recipe,
                                                            LongEpisodes(context, generated), timeout=1200)
    try:
        (v1,) = [a for a in record if a.version == 1]
        (manifest,) = [m for m in manifests if m.batch_id in v1.batch_ids]  # the one trained (a next may be out already)
        assert len(manifest.refs) == groups * group_size == 512 and len(manifest.task_ids) == groups
        assert node.stats["tokens"] >= 512 * generated and plane.max_payload == 8 << 20  # (sync mode: the next tasks may be out)
        stored = (await plane._jsm.stream_info(plane.names.traj_stream)).state.bytes
        assert stored > plane.max_payload and len(encode(manifest)) < 64 << 10  # the batch's data as one message would not fit
        assert v1.batch_ids == [manifest.batch_id]
        assert v1.metrics["tokens"] == 512 * generated and v1.metrics["micro_batches"] == 128  # every token trained, 4 rows a pass
        assert math.isfinite(v1.metrics["loss"]) and v1.metrics["skipped"] == 0 and v1.metrics["fetch_s"] > 0
        fate = await plane.state.get(FateRecord, "solver", manifest.task_ids[-1])
        assert fate is not None and (fate.fate, fate.batch, fate.version) == ("trained", manifest.batch_id, 1)
    finally:
        await plane.close()


@pytest.fixture(scope="module")
def small_payload_server(tmp_path_factory: pytest.TempPathFactory):
    """A server with NATS's default max_payload (1 MiB) instead of the shipped 8 MiB."""
    server = EmbeddedServer(tmp_path_factory.mktemp("nats1m"), extra_config="max_payload: 1048576\n").start()
    yield server
    server.stop()


async def test_a_trajectory_of_a_million_tokens_over_max_payload_is_trained_end_to_end(small_payload_server, run_id, tmp_path):
    context, generated = (1 << 20) - 8192, 8192
    recipe_file, recipe = scale_recipe(tmp_path, group_size=1, groups=1, generated=generated, micro_batch_tokens=1 << 16,
                                       context=context)
    manifests, record, _, plane = await train_end_to_end(small_payload_server.url, run_id, tmp_path, recipe_file, recipe,
                                                         LongEpisodes(context, generated), timeout=900)
    try:
        assert plane.max_payload == 1 << 20
        (v1,) = [a for a in record if a.version == 1]
        (manifest,) = [m for m in manifests if m.batch_id in v1.batch_ids]  # the one trained (a next may be out already)
        (stub,) = await plane.stored.get_many(plane.names.traj_stream, [manifest.refs[0].seq], Trajectory)
        assert stub.offloaded and stub.payload_ref is not None and stub.payload_ref.size > plane.max_payload  # by reference
        assert len(stub.payload_ref.digests) >= 2  # in chunks, each with its digest
        assert v1.batch_ids == [manifest.batch_id] and v1.metrics["tokens"] == generated and v1.metrics["skipped"] == 0
        assert math.isfinite(v1.metrics["loss"])
        fate = await plane.state.get(FateRecord, "solver", manifest.task_ids[0])
        assert fate is not None and fate.fate == "trained"
    finally:
        await plane.close()
