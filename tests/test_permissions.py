"""Per-role permissions on a real nats-server: every role does its job and nothing more.

The run-scoped table is what ``astraflow up`` gives its embedded server; the shipped
``jetstream/accounts.conf`` is the same table for any run. The expectations below are written
out by hand (who may touch what), not derived from ``permissions.py``, so a loosened rule fails.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import nats
import numpy as np
import pytest

from astraflow.launch.access import ServerAccess
from astraflow.streams.credentials import issue, node_path, server_users
from astraflow.streams.messages import Batch, Task, Trajectory, TrajRef
from astraflow.streams.permissions import Scope, inbox_prefix, render_accounts, shipped_accounts_conf
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import EmbeddedServer, adapt_config
from astraflow.streams.state import BatchPlanRecord, EvalRecord, KeyframeRequest, VersionRecord
from astraflow.streams.subjects import Names
from astraflow.streams.trajectories import fetch_trajectories, offload, resolve_all

ROOT = Path(__file__).resolve().parent.parent
RUN, POLICIES = "sec" + uuid.uuid4().hex[:6], ("solver", "verifier")
USERS = ("admin", "dataflow", "trainer-solver", "trainer-verifier", "node-a", "evaluator", "observer")  # node-a: a rollout node


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """An embedded server with the run's generated credentials and permissions (as ``up`` starts it)."""
    tmp = tmp_path_factory.mktemp("sec")
    creds = issue(tmp / "credentials", RUN, POLICIES, nodes=("a", "b"))
    server = EmbeddedServer(tmp, render_accounts(server_users(creds, POLICIES), Scope(RUN, POLICIES, ("raas",)))).start()
    yield server, creds
    server.stop()


async def as_user(secured, user: str) -> Plane:
    server, creds = secured
    return await Plane.connect(NatsOptions(url=server.url, user=user, password=creds[user].password), RUN, user)


class Probe:
    """A raw connection as ``user`` that records the server's permission violations."""

    def __init__(self, url: str, user: str, password: str) -> None:
        self.url, self.user, self.password = url, user, password
        self.errors: list[str] = []

    async def __aenter__(self) -> Probe:
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        self.nc = await nats.connect(self.url, user=self.user, password=self.password, inbox_prefix=inbox_prefix(self.user),
                                     error_cb=on_error, max_reconnect_attempts=0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def denied(self, op: str, subject: str) -> bool:
        before = len(self.errors)
        if op == "pub":
            await self.nc.publish(subject, b"probe")
        else:
            sub = await self.nc.subscribe(subject)
        await self.nc.flush(timeout=5)
        await asyncio.sleep(0.05)  # the -ERR comes before the PONG; give the callback a turn
        if op == "sub":
            await sub.unsubscribe()
        return any(subject.lower() in e.lower() for e in self.errors[before:])  # nats-py lowercases -ERR texts


R = RUN
API = "$JS.API"
# operation -> the users allowed to do it (everything else must be refused)
EXPECT: dict[tuple[str, str], set[str]] = {
    ("pub", f"af.{R}.task.single_turn"): {"admin", "dataflow"},
    ("pub", f"af.{R}.traj.solver"): {"admin"},  # a node publishes under its own name only: the server vouches for the sender
    ("pub", f"af.{R}.traj.solver.a"): {"admin", "node-a"},
    ("pub", f"af.{R}.traj.solver.b"): {"admin"},
    ("pub", f"af.{R}.batch.solver"): {"admin", "dataflow"},
    ("pub", f"af.{R}.weights.solver"): {"admin", "trainer-solver"},
    ("pub", f"af.{R}.weights.verifier"): {"admin", "trainer-verifier"},
    ("pub", f"af.{R}.dlq.batch"): {"admin", "trainer-solver", "trainer-verifier"},
    ("pub", f"af.{R}.dlq.task"): {"admin", "node-a"},
    ("pub", f"af.{R}.dlq.traj"): {"admin", "dataflow"},
    ("pub", f"af.{R}.hb.trainer.x"): {"admin", "trainer-solver", "trainer-verifier"},
    ("pub", f"af.{R}.hb.dataflow.x"): {"admin", "dataflow"},
    ("pub", f"$KV.af_{R}_state.version.solver"): {"admin", "trainer-solver"},
    ("pub", f"$KV.af_{R}_state.done.verifier"): {"admin", "trainer-verifier"},
    ("pub", f"$KV.af_{R}_state.dataflow"): {"admin", "dataflow"},
    ("pub", f"$KV.af_{R}_state.eval.solver.3"): {"admin", "evaluator"},
    ("pub", f"$KV.af_{R}_state.keyframe_request.solver"): {"admin", "node-a", "evaluator"},
    ("pub", f"$KV.af_{R}_fates.fate.solver.t1"): {"admin", "dataflow"},
    ("pub", f"$KV.af_{R}_fates.plan.solver.solver-b000001"): {"admin", "dataflow"},  # only the dataflow plans batches
    ("pub", f"$KV.af_{R}_state.plan.solver.solver-b000001"): {"admin"},
    ("pub", f"$O.af_{R}_weights.C.abc"): {"admin", "trainer-solver", "trainer-verifier"},
    ("pub", f"$O.af_{R}_weights.M.abc"): {"admin", "trainer-solver", "trainer-verifier"},
    # the arrays of trajectories too large for a message: nodes write them in their own bucket, and delete nothing
    ("pub", f"$O.af_{R}_traj_objects.C.abc"): {"admin", "node-a"},
    ("pub", f"$O.af_{R}_traj_objects.M.abc"): {"admin", "node-a"},
    ("pub", f"{API}.STREAM.PURGE.OBJ_af_{R}_traj_objects"): {"admin"},
    ("pub", f"{API}.STREAM.CREATE.OBJ_af_{R}_traj_objects"): {"admin", "dataflow"},
    # the trainers' and the pool's durable consumers: only their own role pulls, acks or inspects them
    ("pub", f"{API}.CONSUMER.MSG.NEXT.AF_{R}_BATCH.trainer-solver"): {"admin", "trainer-solver"},
    ("pub", f"$JS.ACK.AF_{R}_BATCH.trainer-solver.1.1.1.1.1"): {"admin", "trainer-solver"},
    ("pub", f"{API}.CONSUMER.MSG.NEXT.AF_{R}_TASK.raas"): {"admin", "node-a"},
    ("pub", f"$JS.ACK.AF_{R}_TASK.raas.1.1.1.1.1"): {"admin", "node-a"},
    ("pub", f"{API}.CONSUMER.MSG.NEXT.AF_{R}_TRAJ.dataflow"): {"admin", "dataflow"},
    # nobody but admin deletes consumers or streams; only the dataflow makes durables
    ("pub", f"{API}.CONSUMER.DELETE.AF_{R}_BATCH.trainer-solver"): {"admin"},
    ("pub", f"{API}.CONSUMER.DELETE.AF_{R}_TASK.raas"): {"admin"},
    ("pub", f"{API}.CONSUMER.DELETE.AF_{R}_TRAJ.dataflow"): {"admin"},
    ("pub", f"{API}.STREAM.DELETE.AF_{R}_TASK"): {"admin"},
    ("pub", f"{API}.STREAM.MSG.DELETE.AF_{R}_TASK"): {"admin", "dataflow"},  # a task the server gave up on
    ("pub", f"{API}.STREAM.MSG.DELETE.AF_{R}_TRAJ"): {"admin"},
    ("pub", f"{API}.STREAM.PURGE.AF_{R}_BATCH"): {"admin"},
    ("pub", f"{API}.STREAM.PURGE.OBJ_af_{R}_weights"): {"admin", "trainer-solver", "trainer-verifier"},
    # a payload's metadata, read by the trainer's orphan sweep and retention (refused, each read waited out a timeout)
    ("pub", f"{API}.STREAM.MSG.GET.OBJ_af_{R}_weights"): {"admin", "trainer-solver", "trainer-verifier"},
    ("pub", f"{API}.CONSUMER.CREATE.AF_{R}_BATCH.evil"): {"admin", "dataflow"},
    ("pub", f"{API}.CONSUMER.DURABLE.CREATE.AF_{R}_TASK.evil"): {"admin", "dataflow"},
    ("pub", f"{API}.CONSUMER.CREATE.AF_{R}_BATCH"): {"admin"},  # an ephemeral over the trainers' work queue
    ("pub", f"{API}.STREAM.CREATE.AF_{R}_TASK"): {"admin", "dataflow"},
    # reads
    ("pub", f"{API}.CONSUMER.CREATE.AF_{R}_WEIGHTS"): set(USERS) - {"observer"} | {"observer"},
    ("pub", f"{API}.STREAM.MSG.GET.AF_{R}_BATCH"): {"admin", "trainer-solver", "trainer-verifier"},  # replay after a restart
    ("pub", f"{API}.STREAM.MSG.GET.AF_{R}_TRAJ"): {"admin"},  # trainers read batches' trajectories with direct gets
    ("pub", f"{API}.DIRECT.GET.AF_{R}_TRAJ"): {"admin", "trainer-solver", "trainer-verifier"},
    ("pub", f"{API}.CONSUMER.CREATE.OBJ_af_{R}_traj_objects"): {"admin", "dataflow", "trainer-solver", "trainer-verifier"},
    ("sub", f"af.{R}.hb.>"): {"admin", "dataflow", "observer"},
    ("sub", f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.AF_{R}_TASK.raas"): {"admin"},  # kept in DLQ, followed from there
    ("pub", f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.AF_{R}_TASK.raas"): {"admin"},  # a forged one would fail a live task
    ("sub", "_INBOX_dataflow.x"): {"admin", "dataflow"},
    ("sub", "_INBOX.x"): {"admin"},
}


async def test_every_role_is_refused_what_it_must_not_touch(secured):
    server, creds = secured
    wrong: list[str] = []
    for user in USERS:
        async with Probe(server.url, user, creds[user].password) as probe:
            for (op, subject), allowed in EXPECT.items():
                denied = await probe.denied(op, subject)
                if denied == (user in allowed):
                    wrong.append(f"{user} {op} {subject}: {'refused' if denied else 'allowed'}, expected the opposite")
    assert not wrong, "\n".join(wrong)


async def test_no_credentials_no_access(secured):
    server, _ = secured
    with pytest.raises(Exception):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2)
    with pytest.raises(Exception):
        await nats.connect(server.url, user="node-a", password="guess", allow_reconnect=False, connect_timeout=2)
    with pytest.raises(PermissionError, match="refused node-a: authorization violation"):  # a role fails at once, and says why
        await Plane.connect(NatsOptions(url=server.url, user="node-a", password="guess"), RUN, "node-a")


async def test_roles_do_their_job(secured):
    topo = Topology(policies=POLICIES)
    admin = await as_user(secured, "admin")
    await admin.ensure_topology(topo)
    dataflow = await as_user(secured, "dataflow")
    await dataflow.ensure_topology(topo)  # everything exists: read-only
    task = Task(task_id="t1", workflow="math", policy="solver", prompt_id="p", prompt="1+1", group_size=1)
    await dataflow.publish(dataflow.names.task("math"), task, "t1")
    dead = await dataflow.publish(dataflow.names.task("math"), task.model_copy(update={"task_id": "t0"}), "t0")
    assert await dataflow.stored.delete(dataflow.names.task_stream, dead)  # given up on: out of the work queue
    assert not await dataflow.stored.delete(dataflow.names.task_stream, dead)  # gone already
    plan = BatchPlanRecord(policy="solver", batch_id="solver-b000001", digest="d" * 64, trajectories=4)
    await dataflow.state.put(plan)

    trainer = await as_user(secured, "trainer-solver")
    await trainer.ensure_topology(topo)
    assert (await trainer.state.get(BatchPlanRecord, "solver", "solver-b000001")).digest == plan.digest  # the trainer checks batches
    await trainer.state.put(VersionRecord(policy="solver", version=0))
    ref = await trainer.objects().put("solver/v0", b"weights" * 1000)

    rollout = await as_user(secured, "node-a")
    await rollout.ensure_topology(topo)
    (d,) = await rollout.consumer(rollout.names.task_stream, "raas", Task).pull(timeout=2)
    traj = Trajectory(traj_id="t1.solver.0", task_id="t1", prompt_id="p", policy="solver", index=0, group_size=1,
                      prompt_ids=np.arange(3), completion_ids=np.arange(2), logprobs=np.zeros(2), versions=np.zeros(2),
                      loss_mask=np.ones(2), reward=1.0)
    big = traj.model_copy(update={"traj_id": "t1.solver.1", "index": 1})
    stub = await offload(rollout.trajectory_objects(), big)  # arrays in the trajectory bucket (as for one over max_payload)
    seqs = await rollout.publish_many([(rollout.names.traj("solver", rollout.node), t, t.traj_id) for t in (traj, stub)])
    await d.ack()
    assert (await rollout.state.get(VersionRecord, "solver")).version == 0
    assert bytes(await rollout.objects().get(ref)) == b"weights" * 1000  # an ordered consumer on the object stream
    await rollout.state.put(KeyframeRequest(policy="solver", by="rollout", reason="probe"))
    assert await rollout.history(rollout.names.weights("solver"), Trajectory) == []

    evaluator = await as_user(secured, "evaluator")
    await evaluator.state.put(EvalRecord(policy="solver", version=0, reward=0.5))
    got = await dataflow.consumer(dataflow.names.traj_stream, "dataflow", Trajectory).pull(batch=2, timeout=2)
    assert [Names.sender(g.subject) for g in got] == ["a", "a"]  # who sent them, as the server let them in
    assert await resolve_all(dataflow.trajectory_objects(), [g.msg for g in got]) == [traj, big]  # the dataflow checks values
    for g in got:
        await g.ack()
    manifest = Batch(batch_id="solver-b000001", policy="solver", advantages=np.ones(2), task_ids=["t1"],
                     refs=[TrajRef(seq=s, traj_id=t.traj_id, task_id="t1") for s, t in zip(seqs, (traj, big), strict=True)])
    assert await fetch_trajectories(trainer, manifest) == [traj, big]  # direct gets on TRAJ, the arrays from the bucket
    await dataflow.state.delete(BatchPlanRecord, "solver", "solver-b000001")  # its fate is known: the dataflow deletes it
    assert await trainer.state.get(BatchPlanRecord, "solver", "solver-b000001") is None
    observer = await as_user(secured, "observer")
    assert (await observer.stored.lag(observer.names.task_stream, "raas")).pending == 0
    assert (await observer.state.get(EvalRecord, "solver", 0)).reward == 0.5
    for p in (admin, dataflow, trainer, rollout, evaluator, observer):
        await p.close()


def test_shipped_accounts_conf_is_current():
    assert (ROOT / "jetstream" / "accounts.conf").read_text() == shipped_accounts_conf(), \
        "regenerate it: python -m astraflow.streams.permissions"


async def test_shipped_accounts_conf_runs_a_pool_and_keeps_rollout_off_the_trainer(tmp_path, monkeypatch):
    users = ("admin", "dataflow", "trainer-solver", "trainer-verifier", "rollout", "evaluator", "observer")
    for u in users:  # the server reads the passwords from its environment
        monkeypatch.setenv(f"ASTRA_{u.upper().replace('-', '_')}_PASSWORD", f"pw-{u}")
    conf = adapt_config((ROOT / "jetstream" / "accounts.conf").read_text(), tmp_path / "store", {4222: -1})
    server = EmbeddedServer(tmp_path, config_text=conf).start()
    try:
        run = "shipped1"
        dataflow = await Plane.connect(NatsOptions(url=server.url, user="dataflow", password="pw-dataflow"), run, "dataflow")
        await dataflow.ensure_topology(Topology(policies=("solver",)))
        async with Probe(server.url, "rollout", "pw-rollout") as probe:
            for subject in (
                f"{API}.CONSUMER.MSG.NEXT.AF_{run}_BATCH.trainer-solver",
                f"{API}.CONSUMER.DELETE.AF_{run}_BATCH.trainer-solver",
                f"$JS.ACK.AF_{run}_BATCH.trainer-solver.1.1.1.1.1",
                f"af.{run}.batch.solver",
                f"af.{run}.weights.solver",
            ):
                assert await probe.denied("pub", subject), subject
            assert not await probe.denied("pub", f"{API}.CONSUMER.MSG.NEXT.AF_{run}_TASK.raas")
        await dataflow.close()
    finally:
        server.stop()


async def test_a_node_is_cut_off_on_the_running_server_and_let_back_in(tmp_path):
    """What ``up`` does with a quarantine (``launch/access.py``): the node's credential is revoked on the running
    server, which closes its connection and refuses it; the other nodes stay connected; let back in, it connects."""
    cred_dir = tmp_path / "credentials"
    issue(cred_dir, RUN, POLICIES, nodes=("honest", "liar"))
    access = ServerAccess(cred_dir, RUN, POLICIES, Scope(RUN, POLICIES, ("raas",)))
    server = EmbeddedServer(tmp_path, access.config()).start()
    access.servers = [server]
    try:
        def opts(name: str) -> NatsOptions:
            return NatsOptions.from_credential(str(node_path(cred_dir, name)), url=server.url)

        honest, liar = [await Plane.connect(opts(n), RUN, n) for n in ("honest", "liar")]
        assert access.sync(set()) == []  # nothing changed: no reload
        assert access.sync({"liar", "unknown"}) == ["node liar revoked (quarantined)"]
        for _ in range(100):
            if not liar.connected:
                break
            await asyncio.sleep(0.05)
        assert not liar.connected and honest.connected
        with pytest.raises(PermissionError, match="refused node-liar"):
            await Plane.connect(opts("liar"), RUN, "liar")
        await honest._nc.flush(timeout=2)  # the others go on, connected
        assert access.sync(set()) == ["node liar let back in"]
        again = await Plane.connect(opts("liar"), RUN, "liar")
        access.let_in("late")  # an added node: known to the server before let_in returns
        late = await Plane.connect(opts("late"), RUN, "late")
        node_path(cred_dir, "late").unlink()  # `astraflow node revoke late`
        assert access.sync(set()) == ["node late removed"]
        for p in (honest, liar, again, late):
            await p.close()
    finally:
        server.stop()
