"""A hostile rollout node against a live ``astraflow up`` run: it holds a node credential the operator issued it
(``astraflow node add``) and tells well-formed lies.

It pulls real tasks from the pool's durable consumer as any node does and answers every other one (the rest it gives
back to the honest nodes) with trajectories whose values all pass the value checks, stamped with the policy's newest
version, in turn:

* ``logprobs``: claims that hold (the issued prompt; the answer, rewarded 1, for half the group; random letters,
  rewarded 0, for the other half) with made-up behaviour logprobs (-0.01 a token): the dataflow cannot tell, the
  trainer's check of tokens against the model can (``trainer.max_logprob_gap``): it leaves the letters out and names
  them, with the node, in its announcement, and the dataflow counts them against the node;
* ``reward``: random completion tokens, claiming reward 1 for half the group and 0 for the other half;
* ``prompt``: the same, as answers to a prompt of its own choosing under the task's id;
* ``range``: random completion tokens claiming a reward of 1e29.

It lies until the run cuts it off (its credential revoked: the connection closes) or its time is up. :class:`Lies`
records which task got which lie and when it was cut off; :func:`fates_of` reads back what the run did with each.
Used by ``tests/test_hostile_node.py`` and ``benchmarks/bench_hostile_node.py``.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from poison_run import ISSUED, ROOT, newest, until, versions

from astraflow.config import Recipe, load_recipe
from astraflow.launch.access import ServerAccess
from astraflow.models import encode_prompt, load_tokenizer
from astraflow.streams.credentials import Credential
from astraflow.streams.dataflow_state import DataflowState, Quarantine
from astraflow.streams.messages import Task, Trajectory
from astraflow.streams.permissions import Scope
from astraflow.streams.plane import Delivery, NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.state import FateRecord
from astraflow.streams.trajectories import publish_trajectories

KINDS = ("logprobs", "logprobs", "reward", "prompt", "range")  # two that pass the dataflow before the node is cut off
CLAIMS = {"reward": "invalid:reward_claim", "prompt": "invalid:prompt_claim", "range": "invalid:reward_range"}  # kind -> fate
IN_FLIGHT = "in flight"  # a lie with no fate yet: the stopped run's state holds its task out
BATCHED = "batched"  # a lie with no fate yet: the stopped run's state has its group in a batch the trainer has not trained
LETTERS = [i + 3 for i in b"abcdefghijklmnopqrstuvwxyz"]  # ByT5 ids of letters: never a number


@dataclass
class Lies:
    told: dict[str, str] = field(default_factory=dict)  # task id -> the kind of lie its trajectories told
    cut_short: dict[str, str] = field(default_factory=dict)  # likewise, for a lie whose store was cut off: maybe stored
    given_back: int = 0  # real tasks left to the honest nodes
    started: float = 0.0  # time.time() of the first lie
    cut_off: float | None = None  # time.time() the server closed its connection (its credential revoked)
    quarantine: Quarantine | None = None  # the dataflow's, read once the node stopped
    kinds: tuple[str, ...] = KINDS  # the lies it tells, in turn


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


async def hostile_node(credential: Path, recipe: Recipe, seconds: float, lies: Lies, seed: int = 0) -> None:
    """Lie for ``seconds`` (from the first task pulled), or until the run cuts the node off."""
    rng = random.Random(seed)
    plane = await Plane.connect(NatsOptions.from_credential(str(credential)), Credential.read(credential).run, "hostile-0", wait=30)
    tasks = plane.consumer(plane.names.task_stream, plane.names.pool_consumer(recipe.rollout.pool), Task)
    end, k = None, 0
    try:
        while (end is None or time.monotonic() < end) and lies.cut_off is None:
            try:
                pulled = await tasks.pull(batch=4, timeout=1.0)
            except Exception:  # the connection is gone: revoked
                pulled = []
            if not plane.connected:  # (a pull of an empty queue raises too: only a lost connection is a cut-off)
                lies.cut_off = time.time() - plane.disconnected_for()  # when the server closed its connection
                break
            for d in pulled:
                if end is None:
                    end, lies.started = time.monotonic() + seconds, time.time()
                try:
                    await tell(plane, d, k, lies, rng, recipe)
                except Exception:  # a read, publish or ack while the server revokes the credential
                    if not await going(plane):
                        raise
                    lies.cut_off = time.time() - plane.disconnected_for()  # when the server closed its connection
                    break
                k += 1
            await asyncio.sleep(0)
    finally:
        await plane.close()


async def going(plane: Plane, grace: float = 5.0) -> bool:
    """Whether the connection closes within ``grace`` seconds: a request in flight while the server reloads without
    the node's user fails (no responders) a moment before the server closes the connection."""
    end = time.monotonic() + grace
    while plane.connected and time.monotonic() < end:
        await asyncio.sleep(0.05)
    return not plane.connected


async def tell(plane: Plane, d: Delivery[Task], k: int, lies: Lies, rng: random.Random, recipe: Recipe) -> None:
    """The ``k``-th task pulled: every other one given back to the honest nodes, the rest answered with the next lie."""
    if not ISSUED.match(d.msg.task_id) or k % 2:
        await d.nak()
        lies.given_back += 1
        return
    task = d.msg
    kind = lies.kinds[(k // 2) % len(lies.kinds)]
    version = max(await newest(plane, task.policy), task.min_versions.get(task.policy, 0))
    try:
        await publish_trajectories(plane, [lie(task, i, version, kind, rng, recipe.rollout.max_new_tokens) for i in range(task.group_size)])
    except Exception:  # the server may have stored it and closed the connection before its acknowledgement: judged too
        lies.cut_short[task.task_id] = kind
        raise
    lies.told[task.task_id] = kind  # told once stored: the ack may fail as the server cuts the node off, the lie judged all the same
    await d.ack()


async def fates_of(run_dir: Path, policy: str, lies: Lies) -> dict[str, str]:
    """The fate the finished run gave each task the node lied about, or began to as it was cut off (none yet:
    ``BATCHED`` where the stopped run's state has it in a batch, ``IN_FLIGHT`` where it holds it out, its samples unread;
    ``"?"``: none recorded and neither), and the node's quarantine (``lies.quarantine``), read from the run's store: a
    server of our own on it (the run's embedded one stopped with ``up``)."""
    recipe, cred_dir = load_recipe(run_dir / "recipe.yaml"), run_dir / "credentials"
    run = Credential.read(cred_dir / "admin.json").run
    users = ServerAccess(cred_dir, run, recipe.policy_names, Scope(run, recipe.policy_names, (recipe.rollout.pool,))).config()
    server = EmbeddedServer(run_dir, users).start()
    try:
        plane = await Plane.connect(NatsOptions.from_credential(str(cred_dir / "admin.json"), url=server.url), run, "fates")
        state, out = await plane.state.get(DataflowState), {}
        for t in [*lies.told, *lies.cut_short]:
            rec = await plane.state.get(FateRecord, policy, t)
            out[t] = rec.fate if rec is not None else waiting(state, policy, t)
        if state is not None and "hostile" in state.quarantined:  # still quarantined at the end (not admitted again)
            lies.quarantine = state.quarantined["hostile"]
        await plane.close()
        return out
    finally:
        server.stop()


def waiting(state: DataflowState | None, policy: str, task_id: str) -> str:
    """Where a stopped run's state has a task with no fate: in a batch, out, or nowhere (``"?"``)."""
    if state is not None and policy in state.lanes and any(task_id in tasks for tasks in state.lanes[policy].awaiting.values()):
        return BATCHED
    return IN_FLIGHT if state is not None and task_id in state.tasks.in_flight else "?"


def start_up(run_dir: Path, sets: dict[str, Any], log: Path, timeout: float = 900) -> subprocess.Popen[bytes]:
    """``astraflow up recipes/arithmetic`` on its embedded server (the one it can revoke a credential on)."""
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir),
           "--timeout", str(timeout), *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "astraflow.cli", *args], capture_output=True, text=True, timeout=120)


async def add_node(run_dir: Path, name: str, timeout: float = 120) -> Path:
    """``astraflow node add NAME`` once the run's credentials exist: the path of the node's credential."""
    async def secured() -> bool:
        path = run_dir / "credentials" / "admin.json"
        return path.exists() and bool(Credential.read(path).url)

    await until(secured, "the run's credentials", timeout)
    done = await asyncio.to_thread(cli, "node", "add", name, "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip().splitlines()[-1])


async def attack(up: subprocess.Popen[bytes], run_dir: Path, seconds: float, lies: Lies, seed: int = 0, timeout: float = 900,
                 meanwhile: Callable[[Path], Awaitable[None]] | None = None, start_at: int = 10) -> dict[str, str]:
    """Against the run ``up`` drives: a node credential issued, wait for ``start_at`` versions (past the first batches,
    which staleness may drop), lie for ``seconds`` or until cut off, then ``meanwhile`` (the node's credential) while the
    run goes on; wait for the run to end. The fate the run gave each task the node lied about."""
    async def training() -> bool:
        return len(versions(run_dir)) >= start_at

    async def finished() -> bool:
        return up.poll() is not None

    credential = await add_node(run_dir, "hostile", timeout)
    await until(training, "training to start", timeout)
    await hostile_node(credential, load_recipe(run_dir / "recipe.yaml"), seconds, lies, seed)
    if meanwhile is not None:
        await meanwhile(credential)
    await until(finished, "the run to finish", timeout, every=1.0)
    return await fates_of(run_dir, "solver", lies)
