"""A hostile rollout node against a live run: it holds the run's own rollout credential and tells well-formed lies.

It pulls real tasks from the pool's durable consumer as any node does and answers every other one (the rest it gives
back to the honest nodes) with trajectories whose values all pass the value checks, stamped with the policy's newest
version, in turn:

* ``reward``: random completion tokens, claiming reward 1 for half the group and 0 for the other half;
* ``prompt``: the same, as answers to a prompt of its own choosing under the task's id;
* ``range``: random completion tokens claiming a reward of 1e29;
* ``logprobs``: claims that hold (the issued prompt; the answer, rewarded 1, for half the group; random letters,
  rewarded 0, for the other half) with made-up behaviour logprobs (-0.01 a token): the dataflow cannot tell, the
  trainer's check of tokens against the model can (``trainer.max_logprob_gap``).

:class:`Lies` records which task got which lie; :func:`fates_of` reads back what the run did with each.
Used by ``tests/test_hostile_node.py`` and ``benchmarks/bench_hostile_node.py``.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from poison_run import ISSUED, connect, newest, until, versions

from astraflow.config import Recipe, load_recipe
from astraflow.models import encode_prompt, load_tokenizer
from astraflow.streams.messages import Task, Trajectory
from astraflow.streams.state import FateRecord
from astraflow.streams.trajectories import publish_trajectories

KINDS = ("reward", "prompt", "range", "logprobs")
CLAIMS = {"reward": "invalid:reward_claim", "prompt": "invalid:prompt_claim", "range": "invalid:reward_range"}  # kind -> fate
LETTERS = [i + 3 for i in b"abcdefghijklmnopqrstuvwxyz"]  # ByT5 ids of letters: never a number


@dataclass
class Lies:
    told: dict[str, str] = field(default_factory=dict)  # task id -> the kind of lie its trajectories told
    given_back: int = 0  # real tasks left to the honest nodes
    started: float = 0.0  # time.time() of the first lie


def lie(task: Task, i: int, version: int, kind: str, rng: random.Random, max_new_tokens: int) -> Trajectory:
    """Sample ``i`` of ``task``: values a check of values alone finds nothing wrong with; claims that are false."""
    tok = load_tokenizer("byt5")
    prompt = "1000+1000=" if kind == "prompt" else task.prompt  # no prompt of the run
    n = rng.randint(1, max_new_tokens)
    ids = np.asarray([rng.randrange(3, 259) for _ in range(n)], "<i4")  # random bytes: no answer
    reward = 1e29 if kind == "range" else float(i < task.group_size // 2)
    lp = -0.5
    if kind == "logprobs":
        ids = np.asarray(encode_prompt(tok, str(task.meta["answer"])) if reward else [rng.choice(LETTERS) for _ in range(n)], "<i4")
        n, lp = len(ids), -0.01
    return Trajectory(traj_id=f"{task.task_id}.{task.policy}.{i}", task_id=task.task_id, prompt_id=task.prompt_id, policy=task.policy,
                      index=i, group_size=task.group_size, prompt_ids=np.asarray(encode_prompt(tok, prompt), "<i4").tobytes(),
                      completion_ids=ids.tobytes(), logprobs=np.full(n, lp, "<f4").tobytes(),
                      versions=np.full(n, version, "<i4").tobytes(), loss_mask=np.ones(n, "<u1").tobytes(), reward=reward,
                      node_id="hostile-0")


async def hostile_node(cred_dir: Path, run: str, recipe: Recipe, seconds: float, lies: Lies, seed: int = 0) -> None:
    """Lie for ``seconds`` (from the first task pulled)."""
    rng = random.Random(seed)
    plane = await connect(cred_dir, "rollout", run)
    tasks = plane.consumer(plane.names.task_stream, plane.names.pool_consumer(recipe.rollout.pool), Task)
    end, k = None, 0
    try:
        while end is None or time.monotonic() < end:
            for d in await tasks.pull(batch=4, timeout=1.0):
                if end is None:
                    end, lies.started = time.monotonic() + seconds, time.time()
                if not ISSUED.match(d.msg.task_id) or k % 2:
                    await d.nak()  # the honest nodes take it
                    lies.given_back += 1
                else:
                    task = d.msg
                    kind = KINDS[(k // 2) % len(KINDS)]
                    version = max(await newest(plane, task.policy), task.min_versions.get(task.policy, 0))
                    await publish_trajectories(plane, [lie(task, i, version, kind, rng, recipe.rollout.max_new_tokens)
                                                       for i in range(task.group_size)])
                    await d.ack()
                    lies.told[task.task_id] = kind
                k += 1
            await asyncio.sleep(0)
    finally:
        await plane.close()


async def fates_of(cred_dir: Path, run: str, policy: str, task_ids: list[str]) -> dict[str, str]:
    """The fate the run gave each task (``"?"``: none recorded)."""
    plane = await connect(cred_dir, "admin", run)
    try:
        out = {}
        for t in task_ids:
            rec = await plane.state.get(FateRecord, policy, t)
            out[t] = rec.fate if rec is not None else "?"
        return out
    finally:
        await plane.close()


async def attack(up: subprocess.Popen[bytes], run_dir: Path, cred_dir: Path, run: str, seconds: float, lies: Lies, seed: int = 0,
                 timeout: float = 900) -> dict[str, str]:
    """Against the run ``up`` drives: wait for training to start, lie for ``seconds``, wait for the run to end; the fate
    the run gave each task the node lied about."""
    async def training() -> bool:
        return len(versions(run_dir)) >= 2

    async def finished() -> bool:
        return up.poll() is not None

    await until(training, "training to start", timeout)
    await hostile_node(cred_dir, run, load_recipe(run_dir / "recipe.yaml"), seconds, lies, seed)
    await until(finished, "the run to finish", timeout, every=1.0)
    return await fates_of(cred_dir, run, "solver", list(lies.told))
