"""Helpers for the process-level trainer tests (no tests here): a tiny recipe, real batches,
trainer processes, and a watcher of weight announcements."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from astraflow.config import Recipe, load_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.streams.messages import Batch, WeightVersion
from astraflow.streams.plane import Follower, NatsOptions, Plane
from astraflow.streams.state import BatchPlanRecord
from astraflow.streams.trajectories import TrainingBatch, grouped, publish_trajectories
from astraflow.tasks import load_split
from astraflow.train.synthetic import sample_batches
from astraflow.train.threads import threads_for
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.delta import state_digest

TINY_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}


def write_recipe(path: Path, policies: tuple[str, ...] = ("solver",), batch_ack_wait: float = 2.0, max_staleness: int = 64,
                 max_batch_backlog: int = 2, **trainer: object) -> tuple[Path, Recipe]:
    """A tiny recipe; ``max_staleness`` is wide by default: the synthetic batches' tokens are all v0."""
    data = {"name": "t", "policies": list(policies), "model": TINY_MODEL, "sft": {"steps": 0},
            "trainer": {"steps": 8, "keyframe_every": 4, "lr": 1e-3, "threads": 1, **trainer},
            "dataflow": {"max_staleness": max_staleness, "max_batch_backlog": max_batch_backlog},
            "plane": {"batch_ack_wait": batch_ack_wait}, "eval": {"enabled": False}}
    path.write_text(yaml.safe_dump(data))
    return path, load_recipe(path)


def make_batches(recipe: Recipe, policy: str, n: int, seed: int = 0) -> list[TrainingBatch]:
    pcfg = recipe.policies[policy]
    tok = load_tokenizer(pcfg.model.tokenizer)
    train, _ = load_split(recipe.data)
    return sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:16]], policy=policy, n_batches=n,
                          groups_per_batch=2, group_size=4, max_new_tokens=4, logprob_noise=0.2, seed=seed)


def plan_of(b: Batch) -> BatchPlanRecord:
    return BatchPlanRecord(policy=b.policy, batch_id=b.batch_id, digest=b.digest(), trajectories=len(b.refs))


def at(b: TrainingBatch, seqs: list[int]) -> TrainingBatch:
    """``b`` with its manifest naming its trajectories at these TRAJ stream sequences."""
    refs = [r.model_copy(update={"seq": s}) for r, s in zip(b.manifest.refs, seqs, strict=True)]
    return TrainingBatch(b.manifest.model_copy(update={"refs": refs}), b.trajectories)


async def on_stream(plane: Plane, b: TrainingBatch) -> TrainingBatch:
    """Publish ``b``'s trajectories as nodes do, a task's group a message (each task settled on its own; one too large
    for a message by reference); ``b`` naming where they are."""
    seqs = []
    for group in grouped(b.trajectories):
        seqs += await publish_trajectories(plane, group)
    return at(b, seqs)


async def publish_batches(plane: Plane, batches: list[TrainingBatch], planned: bool = True) -> list[TrainingBatch]:
    """As nodes and the dataflow publish them: the trajectories, then each manifest's plan record (unless ``planned``
    is False), then the manifests. Returns the batches as published."""
    out = [await on_stream(plane, b) for b in batches]
    if planned:
        await plane.state.put_many([plan_of(b.manifest) for b in out])
    await plane.publish_many([(plane.names.batch(b.policy), b.manifest, b.batch_id) for b in out])
    return out


def spawn_trainer(recipe_file: Path, url: str, run: str, policy: str, log: Path, checkpoint_dir: Path | None = None,
                  crash: str | None = None, metrics_port: int | None = None, fresh_lineage: bool = False) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "astraflow.cli", "worker", "trainer", "--recipe", str(recipe_file), "--nats", url,
           "--run", run, "--id", f"trainer-{policy}", "--policy", policy]
    if checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", str(checkpoint_dir)]
    if fresh_lineage:
        cmd += ["--fresh-lineage"]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_CRASH"}
    if crash:
        env["ASTRAFLOW_CRASH"] = crash
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


async def wait_exit(proc: subprocess.Popen[bytes], timeout: float = 120.0) -> int:
    return await asyncio.to_thread(proc.wait, timeout)


async def planned_run(url: str, run: str, recipe: Recipe, steps: int, seed: int = 0,
                      policy: str = "solver") -> tuple[Plane, Announcements, list[TrainingBatch]]:
    """A run's topology on the server, its announcements watched, and ``steps`` planned batches of ``policy``
    published for a trainer process to take; the caller closes the watcher and the plane."""
    plane = await Plane.connect(NatsOptions(url=url), run, "test")
    await plane.ensure_topology(recipe.topology())
    anns = await Announcements(plane).start()
    batches = make_batches(recipe, policy, steps, seed=seed)
    await publish_batches(plane, batches)
    return plane, anns, batches


class Announcements:
    """Every weight announcement of the run, in stream order, as they arrive.

    A pull consumer from the stream's first message, fetched by a background task: unlike a
    push consumer it cannot stall or reset while the test's event loop is busy."""

    def __init__(self, plane: Plane) -> None:
        self.plane = plane
        self.seen: list[WeightVersion] = []
        self.changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> Announcements:
        follower = self.plane.follower(self.plane.names.all("weights"), WeightVersion, start="all")
        self._task = asyncio.create_task(self._follow(follower))
        return self

    async def _follow(self, follower: Follower[WeightVersion]) -> None:
        while True:
            got = await follower.fetch(1.0)
            async with self.changed:
                self.seen.extend(got)
                self.changed.notify_all()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def of(self, policy: str) -> list[WeightVersion]:
        return [a for a in self.seen if a.policy == policy]

    def version(self, policy: str) -> int:
        return max((a.version for a in self.of(policy)), default=-1)

    async def wait(self, policy: str, version: int, timeout: float = 120.0) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: self.version(policy) >= version), timeout)

    async def settle(self, policy: str, version: int) -> list[WeightVersion]:
        """The policy's announcements once ``version`` has arrived (after the trainer exited)."""
        await self.wait(policy, version, timeout=30.0)
        return self.of(policy)


class VersionHolder:
    """A WeightSync target that only records the version it reached (the sync checks every digest)."""

    version = -1

    def load_state(self, state, version: int) -> None:
        self.version = version


def check_record(anns: list[WeightVersion], batches: list[TrainingBatch], steps: int) -> None:
    versions = [a.version for a in anns]
    assert versions == list(range(steps + 1)), versions  # monotonic, no duplicate, no gap, no reuse
    trained = [b for a in anns for b in a.batch_ids]
    assert sorted(trained) == sorted(b.batch_id for b in batches)  # every batch exactly once


def check_exact(recipe: Recipe, policy: str, anns: list[WeightVersion], batches: list[TrainingBatch]) -> None:
    """Exact: one uninterrupted run from the recipe's initial weights, stepping the announced batches in the announced
    order, gives every announced digest (so no batch was trained twice, or lost, into the weights)."""
    pcfg = recipe.policies[policy]
    tok = load_tokenizer(pcfg.model.tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_for(pcfg.trainer.threads))
    try:
        torch.manual_seed(pcfg.trainer.seed)
        backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
        by_id = {b.batch_id: b for b in batches}
        assert state_digest(backend.state_dict_bf16()) == anns[0].state_digest
        for a in anns[1:]:
            backend.step(by_id[a.batch_ids[0]])
            assert state_digest(backend.state_dict_bf16()) == a.state_digest, f"v{a.version} differs"
    finally:
        torch.set_num_threads(threads)
