"""A live ``astraflow up`` run under attack: the poisons of ``tests/poison.py`` injected as an attacker would.

The run uses an authenticated nats-server the caller started with the run's credentials (``up --nats
URL --credentials DIR``), so the store outlives the run and its dead-letter stream can be read
afterwards. Two attackers:

* **rollout** (``credentials/nodes/attacker.json``, a node credential as any node is given): pulls real tasks and answers
  each with one poisoned trajectory; forges task rejections (``dlq.task``); beats poisoned
  heartbeats on ``hb.rollout.*``; writes poisoned ``keyframe_request.*`` records; and tries what the
  permissions refuse it (tasks, batches, announcements, batch rejections, trainer state), which must
  not land;
* **admin** (the permissions let everything through, so only the consumers' own checks stand):
  poisoned tasks derived from the run's prompts and tasks it never issued, poisoned batch manifests
  naming real trajectories by their TRAJ stream sequences (with plan records forged to match where that
  gets them past the plan check; references to another trajectory, to a sequence never written, fewer
  than the advantages; trajectories with poisoned values, published first with the rollout credential
  as a node's are: the permissions let no other role but admin publish trajectories),
  impossible and past announcements derived from the real ones; and two scenarios: a batch
  taken from the trainers' consumer and held until it is redelivered long after (dropped as stale), and
  a second trainer started without its checkpoints (it must refuse, announcing nothing).

:func:`verdict` reads the dead-letter stream and says, per poison, whether its consumer named it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from poison import (
    Poison,
    RunView,
    draw,
    foreign_tasks,
    nth,
    plan_record,
    poisoned_announcements,
    poisoned_batches,
    poisoned_heartbeats,
    poisoned_keyframe_requests,
    poisoned_tasks,
    poisoned_trajectories,
    publish_copies,
    published_at,
)

from astraflow.config import Recipe
from astraflow.models import encode_prompt, load_tokenizer, model_limits
from astraflow.streams.codec import decode, encode
from astraflow.streams.credentials import issue, server_users
from astraflow.streams.messages import Batch, Rejected, Task, Trajectory, TrajRef, WeightVersion
from astraflow.streams.permissions import Scope, render_accounts
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.state import BatchPlanRecord, DoneRecord, VersionRecord
from astraflow.streams.trajectories import TrainingBatch, decode_carried
from astraflow.tasks import load_split

ROOT = Path(__file__).resolve().parent.parent
ISSUED = re.compile(r"^t\d{8}$")  # the ids the run's dataflow gives its tasks
ATTACKER = "attacker"  # the node credential the attackers hold (``credentials/nodes/attacker.json``): what any node is given


# ------------------------------------------------------------------------------------------- the run
NODES = (*(f"rollout-{i}" for i in range(4)), ATTACKER)  # the run's own nodes, and the attacker's node credential


def secured_server(tmp: Path, run: str, policies: tuple[str, ...] = ("solver",)) -> tuple[EmbeddedServer, Path]:
    """A nats-server with the run's per-role and per-node users and permissions (what ``up`` embeds), and the credentials'
    folder."""
    cred_dir = tmp / "credentials"
    creds = issue(cred_dir, run, policies, nodes=NODES)
    server = EmbeddedServer(tmp / "nats", render_accounts(server_users(creds, policies), Scope(run, policies, ("raas",)))).start()
    issue(cred_dir, run, policies, url=server.url)
    return server, cred_dir


def start_up(run_dir: Path, url: str, cred_dir: Path, sets: dict[str, Any], log: Path, timeout: float = 900) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "astraflow.cli", "up", str(ROOT / "recipes" / "arithmetic"), "--run-dir", str(run_dir), "--nats", url,
           "--credentials", str(cred_dir), "--timeout", str(timeout)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)


def versions(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x)["version"] for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


async def connect(cred_dir: Path, user: str, run: str) -> Plane:
    """Connect as ``user``: a role (``admin``), or a node (``nodes/NAME``)."""
    return await Plane.connect(NatsOptions.from_credential(str(cred_dir / f"{user}.json")), run, f"attacker-{Path(user).name}", wait=30)


async def until(cond: Any, what: str, timeout: float, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)


# ------------------------------------------------------------------------------------------- what was tried
@dataclass
class Campaign:
    poisons: list[Poison] = field(default_factory=list)  # injected; judged from the DLQ
    unjudged: list[Poison] = field(default_factory=list)  # injected; nothing to dead-letter (liveness, state): judged by the run
    denied: dict[str, bool] = field(default_factory=dict)  # what the permissions must refuse -> refused
    stolen_batch: str = ""  # the batch held until its redelivery went stale
    rogue_trainer: tuple[int, str] = (0, "")  # exit status and log tail of the trainer started without checkpoints
    held_failed: str = ""  # a task the rollout attacker held and dead-lettered with a forged rejection
    gave_up: int = 0  # real tasks the rollout attacker pulled, poisoned elsewhere, then dead-lettered


def view_of(recipe: Recipe, newest: int) -> RunView:
    limits = model_limits(recipe.policies[recipe.primary].model)
    return RunView(vocab=limits.vocab, group_size=recipe.dataflow.group_size, max_new_tokens=recipe.rollout.max_new_tokens,
                   context=limits.context, newest=newest, workflow=recipe.workflow, policy=recipe.primary)


async def first_trajectories(plane: Plane, n: int) -> list[Trajectory]:
    """The first ``n`` trajectories of the TRAJ stream (a message may carry a task's group)."""
    found: list[Trajectory] = []
    seq = 1
    while len(found) < n:
        found += decode_carried((await plane.stored.read_many(plane.names.traj_stream, [seq]))[seq])
        seq += 1
    return found[:n]


async def newest(plane: Plane, policy: str) -> int:
    record = await plane.state.get(VersionRecord, policy)
    return record.version if record is not None else 0


def honest_sample(task: Task, i: int, version: int) -> Trajectory:
    """What an honest node could send for ``task``: its prompt, the answer, plausible logprobs, current weights."""
    tok = load_tokenizer("byt5")
    answer = [*encode_prompt(tok, str(task.meta.get("answer", "0"))), tok.eos_token_id][:4]
    n = len(answer)
    return Trajectory(traj_id=f"{task.task_id}.{task.policy}.{i}", task_id=task.task_id, prompt_id=task.prompt_id, policy=task.policy,
                      index=i, group_size=task.group_size, prompt_ids=np.asarray(encode_prompt(tok, task.prompt), "<i4").tobytes(),
                      completion_ids=np.asarray(answer, "<i4").tobytes(), logprobs=np.full(n, -0.7, "<f4").tobytes(),
                      versions=np.full(n, version, "<i4").tobytes(), loss_mask=np.ones(n, "<u1").tobytes(), reward=1.0)


# ------------------------------------------------------------------------------------------- the rollout attacker
async def rollout_attack(cred_dir: Path, run: str, recipe: Recipe, per_field: int, at: int, camp: Campaign, within: float = 300) -> None:
    """``within``: seconds to find the real tasks to poison (the run may end first: then fewer are tried)."""
    plane = await connect(cred_dir, f"nodes/{ATTACKER}", run)
    deadline = time.monotonic() + within
    n = plane.names
    try:
        # trajectories: one poisoned answer per real task pulled from the pool, field after field
        template = poisoned_trajectories(honest_sample(Task(task_id="t", workflow="w", policy="solver", prompt_id="p", prompt="1+1=",
                                                            group_size=recipe.dataflow.group_size, meta={"answer": "2"}), 0, 0),
                                         view_of(recipe, 0))
        wanted = per_field * len(template)
        tasks = plane.consumer(n.task_stream, n.pool_consumer(recipe.rollout.pool), Task)
        done, held = 0, None
        while held is None and time.monotonic() < deadline:  # each task answered as soon as pulled: held ones hold the budget
            for d in await tasks.pull(batch=4, timeout=2.0):
                if not ISSUED.match(d.msg.task_id) or held is not None:  # not the dataflow's (another attacker's): for the nodes
                    await d.nak(delay=0.5)
                    continue
                if done == wanted:
                    held = d
                    continue
                version = await newest(plane, recipe.primary)
                base = honest_sample(d.msg, done % recipe.dataflow.group_size, max(version, d.msg.min_versions.get(recipe.primary, 0)))
                p = nth(poisoned_trajectories(base, view_of(recipe, version)), done, at, per_field)
                t = p.msg
                assert isinstance(t, Trajectory)
                await plane.publish(n.traj(t.policy, plane.node), t)
                if t.task_id == d.msg.task_id and t.policy == d.msg.policy:
                    await d.ack()  # the poison claims this task: the dataflow settles it invalid
                else:  # it claims another: give this one up, as a node may (a task acked and never answered would hold
                    await d.reject("gave up")  # a slot of the dataflow's budget for good)
                    camp.gave_up += 1
                camp.poisons.append(p)
                done += 1
        if held is not None:
            camp.held_failed = held.msg.task_id
            await held.reject("forged: this node gives up on a task it holds")  # within a node's rights: the task fails, counted

        # forged task rejections: garbage, a task never issued
        never = Task(task_id=f"t9{at:07d}", workflow=recipe.workflow, policy=recipe.primary, prompt_id="p", prompt="1+1=",
                     group_size=recipe.dataflow.group_size)
        for k, payload in enumerate([b"", b"\x01garbage", encode(never)]):
            rej = Rejected(subject=n.task(recipe.workflow), reason="forged " * 500, worker_id=f"evil-{k}", payload=payload)
            await plane.publish(n.dlq("task"), rej)
            camp.unjudged.append(Poison("rejected", "payload", f"forged rejection {k}", rej))

        # heartbeats on the rollout subjects, and keyframe requests: nothing to dead-letter, the run must not mind
        for i in range(per_field * 5):
            p = nth(poisoned_heartbeats("evil"), i, at, per_field)
            await plane._nc.publish(n.hb("rollout", f"evil-{i}"), encode(p.msg))  # type: ignore[arg-type]
            camp.unjudged.append(p)
        for p in draw(poisoned_keyframe_requests(recipe.policy_names), per_field * 2, at):
            await plane._js.publish(f"$KV.{n.state_bucket}.{p.key}", p.raw)
            camp.unjudged.append(p)

        # what the permissions refuse a node: each must fail without being stored
        tries = {"task": (n.task(recipe.workflow), never), "batch": (n.batch(recipe.primary), Batch(
                     batch_id="x", policy=recipe.primary, refs=[], advantages=b"", task_ids=[])),
                 "weights": (n.weights(recipe.primary), WeightVersion(policy=recipe.primary, version=10**6, encoding="keyframe",
                                                                      state_digest="a" * 64, keyframe_version=10**6, objects=[])),
                 "dlq.batch": (n.dlq("batch"), Rejected(subject=n.batch(recipe.primary), reason="stale: x", worker_id="e", payload=b""))}

        async def refused(subject: str, msg: Any) -> bool:
            try:
                await asyncio.wait_for(plane.publish(subject, msg), 4)
            except Exception:  # a permissions violation: the server never stores it, so never acks it
                return True
            return False

        async def refused_state(record: Any) -> bool:
            try:
                await asyncio.wait_for(plane.state.put(record), 4)
            except Exception:
                return True
            return False

        results = await asyncio.gather(*(refused(s, m) for s, m in tries.values()),
                                       refused_state(VersionRecord(policy=recipe.primary, version=10**6)),
                                       refused_state(DoneRecord(policy=recipe.primary, version=10**6)),
                                       refused_state(BatchPlanRecord(policy=recipe.primary, batch_id="x", digest="d", trajectories=0)))
        camp.denied = dict(zip([*tries, "state version", "state done", "state plan"], results, strict=True))
    finally:
        await plane.close()


# ------------------------------------------------------------------------------------------- the admin attacker
async def steal_a_batch(cred_dir: Path, run: str, recipe: Recipe, camp: Campaign) -> None:
    """The stale redelivery: take a batch as a trainer would and die holding it; it comes back after the batch
    ack_wait, long after the trainer moved on. Done before the attacks start, so their poison generation (CPU work
    on this event loop) cannot hold the theft back until the run is nearly over and the batch comes back too late."""
    thief = await Plane.connect(NatsOptions.from_credential(str(cred_dir / "admin.json")), run, "attacker-dead-trainer")
    batches = thief.consumer(thief.names.batch_stream, thief.names.trainer_consumer(recipe.primary), Batch)
    got = []
    while not got:
        got = await batches.pull(batch=1, timeout=2.0)
    camp.stolen_batch = got[0].msg.batch_id
    await thief._nc.close()  # gone without a word: nothing acked


async def admin_attack(cred_dir: Path, run: str, recipe: Recipe, run_dir: Path, per_field: int, at: int, camp: Campaign) -> None:
    plane = await connect(cred_dir, "admin", run)
    n, policy = plane.names, recipe.primary
    rogue: asyncio.subprocess.Process | None = None
    try:
        # a second trainer without its checkpoints, on the live run: it must refuse
        rogue = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "astraflow.cli", "worker", "trainer", "--recipe", str(run_dir / "recipe.yaml"), "--credential",
            str(cred_dir / f"trainer-{policy}.json"), "--policy", policy, "--id", "trainer-rogue", "--set", "sft.steps=0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)

        version = await newest(plane, policy)
        view = view_of(recipe, version)
        train, _ = load_split(recipe.data)
        for i in range(per_field * len(poisoned_tasks(_task(train[0], recipe, 0, version), view))):
            base = _task(train[i % len(train)], recipe, i, version)
            p = nth(poisoned_tasks(base, view), i, at, per_field)
            await plane.publish(n.task(getattr(p.msg, "workflow", recipe.workflow)), p.msg)  # type: ignore[arg-type]
            camp.poisons.append(p)
        for p in draw(foreign_tasks(_task(train[1], recipe, -1, version)), per_field, at):
            await plane.publish(n.task(recipe.workflow), p.msg)  # type: ignore[arg-type]
            camp.poisons.append(Poison("task", "task_id", p.label, p.msg, p.expect, extra={"dlq": "traj"}))

        # batches: manifests over 16 real trajectories at their sequences (tokens of the current weights: only the poisoned
        # field turns a batch away); poisoned trajectory values published first by a rollout credential, as a node's
        now = await newest(plane, policy)
        real = await first_trajectories(plane, 16)
        fresh = [t.model_copy(update={"versions": np.full(len(t.completion_ids) // 4, now, "<i4").tobytes()}) for t in real]
        node = await connect(cred_dir, f"nodes/{ATTACKER}", run)
        try:
            seqs = await publish_copies(node, fresh)
            rng = np.random.default_rng(at)
            manifest = Batch(batch_id=f"x{at}", policy=policy, refs=[TrajRef(seq=q, traj_id=t.traj_id, task_id=t.task_id)
                                                                     for q, t in zip(seqs, fresh, strict=True)],
                             advantages=rng.standard_normal(len(fresh)).astype("<f4").tobytes(),
                             task_ids=sorted({t.task_id for t in fresh}))
            fields = poisoned_batches(TrainingBatch(manifest, fresh), view)
            for i in range(per_field * len(fields)):
                p = nth(fields, i, at, per_field)
                if "trajectories" in p.extra:
                    p = published_at(p, await publish_copies(node, p.extra["trajectories"]))
                b = p.msg
                assert isinstance(b, Batch)
                if p.extra.get("plan") == "base":
                    await plane.state.put(plan_record(manifest, policy))
                elif p.extra.get("plan"):  # one plan record per forged batch: ids of their own
                    b = b.model_copy(update={"batch_id": f"{b.batch_id}-{i}"})
                    await plane.state.put(plan_record(b, policy))
                    p = replace(p, msg=b)
                await plane.publish(n.batch(policy), b)
                camp.poisons.append(p)
        finally:
            await node.close()

        last = await plane.stored.last(n.weights_stream, n.weights(policy), WeightVersion)
        assert last is not None
        fields = poisoned_announcements(last)
        for i in range(per_field * len(fields)):
            p = nth(fields, i, at, per_field)
            await plane.publish(n.weights(policy), p.msg)  # type: ignore[arg-type]
            camp.poisons.append(p)

        out, _ = await asyncio.wait_for(rogue.communicate(), 300)
        camp.rogue_trainer = (rogue.returncode or 0, out.decode(errors="replace")[-3000:])
    finally:
        if rogue is not None and rogue.returncode is None:  # a campaign cut short must not leave it training
            rogue.kill()
            await rogue.wait()
        await plane.close()


def _task(problem: Any, recipe: Recipe, i: int, version: int) -> Task:
    """A task as the dataflow issues it (under an id the dataflow never uses)."""
    floor = max(0, version - recipe.dataflow.max_staleness)
    return Task(task_id=f"p{i:06d}", workflow=recipe.workflow, policy=recipe.primary, prompt_id=problem.prompt_id, prompt=problem.prompt,
                group_size=recipe.dataflow.group_size, meta=problem.meta, min_versions={recipe.primary: floor})


# ------------------------------------------------------------------------------------------- the verdict
@dataclass
class Verdict:
    tried: Counter[str]  # per "kind.field"
    caught: Counter[str]  # dead-lettered with the reason its check gives
    missed: list[str]  # poisons not caught, with what the DLQ held for them
    dlq: dict[str, int]  # dead-letter entries per kind


async def verdict(cred_dir: Path, run: str, camp: Campaign) -> Verdict:
    plane = await connect(cred_dir, "admin", run)
    try:
        entries: dict[bytes, list[str]] = {}
        reasons_by_kind: dict[str, list[str]] = {}
        for kind in ("traj", "task", "batch", "weights"):
            for r in await plane.history(plane.names.dlq(kind), Rejected):
                entries.setdefault(r.payload, []).append(r.reason)
                reasons_by_kind.setdefault(kind, []).append(r.reason)
    finally:
        await plane.close()
    tried, caught, missed = Counter[str](), Counter[str](), []
    for p in camp.poisons:
        tried[p.name] += 1
        if p.extra.get("dlq") == "traj":  # a task never issued: served, its trajectories turned away by the dataflow
            ok = any("invalid task" in r and p.expect in r for r in reasons_by_kind.get("traj", []))
        else:
            ok = any(p.named_by(r) for r in entries.get(p.payload, []))
        if ok:
            caught[p.name] += 1
        else:
            missed.append(f"{p.name} ({p.label}): {entries.get(p.payload)}")
    return Verdict(tried, caught, missed, {k: len(v) for k, v in reasons_by_kind.items()})


def finite_summary(summary: dict[str, Any]) -> bool:
    """Every number in the summary is finite (no poison leaked into what the run reports)."""
    def walk(x: Any) -> bool:
        if isinstance(x, float):
            return math.isfinite(x)
        if isinstance(x, dict):
            return all(walk(v) for v in x.values())
        if isinstance(x, list):
            return all(walk(v) for v in x)
        return True
    return walk(summary)


def stale_rejection(dlq_batches: list[Rejected], batch_id: str) -> str | None:
    for r in dlq_batches:
        try:
            if decode(r.payload, Batch).batch_id == batch_id:
                return r.reason
        except Exception:  # a forged payload
            continue
    return None

