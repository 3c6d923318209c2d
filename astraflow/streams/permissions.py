"""Who may do what on the plane: per-role subject permissions, rendered as a nats-server ``accounts`` block.

One table for every deployment: ``astraflow up`` renders it for its run (subjects scoped to the
run id, one trainer user per policy), and ``jetstream/accounts.conf`` is the same table rendered
for any run (``*``) with the passwords taken from the server's environment
(``python -m astraflow.streams.permissions`` writes it; a test keeps it current).

Least privilege, by what each role does and nothing more:

| role | publishes | pulls and acks | reads |
|---|---|---|---|
| ``dataflow`` | tasks, batch manifests, ``dlq.traj``, state ``dataflow``/``autoscale.*``, fates and batch plans (``plan.*``) | durable ``dataflow`` on TRAJ | weights, DLQ, KV, TASK by sequence (and deletes a task the server gave up on), trajectory objects, lags, heartbeats (the server's max-delivery advisories: kept in DLQ) |
| ``trainer-{p}`` | ``weights.{p}`` and its payload chunks, ``dlq.batch``, state ``version.{p}``/``done.{p}`` | durable ``trainer-{p}`` on BATCH | TRAJ by sequence (direct gets), trajectory objects, weights, objects, KV, batch plans |
| ``rollout`` | trajectories (a node's own credential, ``node-NAME``: only under its name, ``traj.*.NAME``) and the chunks of their arrays (trajectory bucket only), ``dlq.task``, ``dlq.weights``, state ``keyframe_request.*`` | durable ``{pool}`` on TASK | weights, objects, KV |
| ``evaluator`` | ``dlq.weights``, state ``eval.*`` and ``keyframe_request.*`` | nothing | weights, objects, KV |
| ``observer`` | nothing | nothing | stream and consumer info, KV, heartbeats (``astraflow status``) |
| ``admin`` | everything (the launcher, operators) | | |

Trajectory arrays too large for a message go to their own bucket (``af_{run}_traj_objects``), the
only object bucket a rollout node may write, so a node can never overwrite weight payloads; it
may not purge or delete anything there (objects expire with the TRAJ stream's max age). In the
any-run table (``*``) buckets are not told apart by name either (a subject token cannot be half a
wildcard), so there a node may write chunks into any bucket; readers check every chunk against the
digests they were announced with, so a stray chunk is never applied, but render the table for one
run for the tightest scoping.

Every role publishes heartbeats only under its own role (``hb.{role}.*``) and subscribes only to
its own inbox prefix (``_INBOX_{user}``), so no role reads another's replies. Durable consumers
(TASK, TRAJ, BATCH) can be pulled, acked and inspected only by their own role, and created or
deleted only by the dataflow and admin; ephemeral consumers (followers of weights, objects, the
DLQ) can be made on the Limits streams only, where they take nothing from anyone.
"""  # noqa: E501 (the table's rows)

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

API = "$JS.API"
FAMILIES = ("task", "traj", "batch", "weights", "dlq")
NODE_PREFIX = "node-"  # user name of a rollout node's own credential: ``node-{name}``


def node_of(user: str | None) -> str | None:
    """The node a user name is the credential of (``node-NAME`` -> ``NAME``), None for a role's."""
    return user[len(NODE_PREFIX):] if user and user.startswith(NODE_PREFIX) else None

ROLES = ("dataflow", "trainer", "rollout", "evaluator", "observer", "admin")  # trainers are users ``trainer-{policy}``


@dataclass(frozen=True)
class Scope:
    """What the subjects are scoped to: one run (``up``), or any (``*``: the shipped accounts.conf)."""

    run: str = "*"
    policies: tuple[str, ...] = ("*",)
    pools: tuple[str, ...] = ("*",)

    def stream(self, family: str) -> str:
        return "*" if self.run == "*" else f"AF_{self.run}_{family.upper()}"

    def kv_stream(self, bucket: str) -> str:
        return "*" if self.run == "*" else f"KV_af_{self.run}_{bucket}"

    @property
    def obj_bucket(self) -> str:
        return "*" if self.run == "*" else f"af_{self.run}_weights"

    @property
    def obj_stream(self) -> str:
        return "*" if self.run == "*" else f"OBJ_af_{self.run}_weights"

    @property
    def traj_obj_bucket(self) -> str:
        return "*" if self.run == "*" else f"af_{self.run}_traj_objects"

    @property
    def traj_obj_stream(self) -> str:
        return "*" if self.run == "*" else f"OBJ_af_{self.run}_traj_objects"

    def kv(self, bucket: str, key: str) -> str:
        return f"$KV.{'*' if self.run == '*' else f'af_{self.run}_{bucket}'}.{key}"

    def subject(self, family: str, rest: str = ">") -> str:
        return f"af.{self.run}.{family}.{rest}"


@dataclass
class Permissions:
    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)

    def add(self, pub: Iterable[str] = (), sub: Iterable[str] = ()) -> Permissions:
        self.publish = list(dict.fromkeys([*self.publish, *pub]))
        self.subscribe = list(dict.fromkeys([*self.subscribe, *sub]))
        return self


def inbox_prefix(user: str) -> str:
    """Each user's own reply subjects: nobody else may subscribe to them."""
    return f"_INBOX_{user}"


def _reads_state(s: Scope) -> list[str]:
    """Read the run state (KV), see that the run's streams and consumers exist (and their lag)."""
    state = s.kv_stream("state")
    streams = [s.stream(f) for f in FAMILIES] + [state, s.kv_stream("fates"), s.obj_stream, s.traj_obj_stream]
    return [f"{API}.INFO", *(f"{API}.STREAM.INFO.{st}" for st in dict.fromkeys(streams)),
            *(f"{API}.CONSUMER.INFO.{s.stream(f)}.>" for f in dict.fromkeys(("task", "traj", "batch"))),
            f"{API}.DIRECT.GET.{state}", f"{API}.DIRECT.GET.{state}.>", f"{API}.STREAM.MSG.GET.{state}"]


def _follows(*streams: str) -> list[str]:
    """Ordered push consumers: create unnamed ephemerals (the server refuses a durable name on this
    endpoint, so nobody can make or change a durable through it) and answer their flow control."""
    return [x for st in streams for x in (f"{API}.CONSUMER.CREATE.{st}", f"$JS.FC.{st}.>")]


def _pulls(stream: str, durable: str) -> list[str]:
    """Pull, ack (and in_progress / nak / term, which are acks) and inspect one durable consumer."""
    return [f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}", f"$JS.ACK.{stream}.{durable}.>", f"{API}.CONSUMER.INFO.{stream}.{durable}"]


def _reads_weights(s: Scope) -> list[str]:
    """Follow announcements and read payloads (hub streams, or a region's mirrors of them)."""
    return [*_follows(s.stream("weights"), s.obj_stream), f"{API}.STREAM.MSG.GET.{s.stream('weights')}",
            f"{API}.DIRECT.GET.{s.obj_stream}"]  # a small payload in one batched direct get


def _reads_trajectory_objects(s: Scope) -> list[str]:
    """Read the arrays of trajectories too large for a message (their chunks are counted with ``STREAM.INFO``)."""
    return _follows(s.traj_obj_stream)


def _creates_topology(s: Scope) -> list[str]:
    names = [s.stream(f) for f in FAMILIES] + [s.kv_stream("state"), s.kv_stream("fates"), s.obj_stream, s.traj_obj_stream]
    out = [f"{API}.STREAM.NAMES", f"{API}.STREAM.LIST"]
    for n in dict.fromkeys(names):
        out += [f"{API}.STREAM.CREATE.{n}", f"{API}.STREAM.UPDATE.{n}"]
    for st in dict.fromkeys(s.stream(f) for f in ("task", "traj", "batch")):
        out += [f"{API}.CONSUMER.CREATE.{st}.>", f"{API}.CONSUMER.DURABLE.CREATE.{st}.>"]
    return out


def permissions(role: str, s: Scope, policy: str = "*", user: str | None = None) -> Permissions | None:
    """The permissions of ``role`` (``policy``: a trainer's); None means unrestricted (admin)."""
    user = user or (f"trainer-{policy}" if role == "trainer" and policy != "*" else role)
    if role == "admin":
        return None
    p = Permissions(subscribe=[f"{inbox_prefix(user)}.>"])
    p.add(pub=[*_reads_state(s), s.subject("hb", f"{role}.*")])
    if role == "dataflow":
        p.add(pub=[*_creates_topology(s), *_pulls(s.stream("traj"), "dataflow"), *_reads_trajectory_objects(s),
                   f"{API}.STREAM.MSG.GET.{s.stream('task')}", f"{API}.STREAM.MSG.DELETE.{s.stream('task')}",  # a task given up on
                   *_reads_weights(s), *_follows(s.stream("dlq")),
                   s.subject("task"), s.subject("batch"), s.subject("dlq", "traj"),
                   s.kv("state", "dataflow"), s.kv("state", "autoscale.*"), s.kv("fates", "plan.>"), s.kv("fates", "fate.>"),
                   f"{API}.DIRECT.GET.{s.kv_stream('fates')}", f"{API}.DIRECT.GET.{s.kv_stream('fates')}.>",
                   f"{API}.STREAM.MSG.GET.{s.kv_stream('fates')}"],
              sub=[s.subject("hb")])
    elif role == "trainer":
        p.add(pub=[*_pulls(s.stream("batch"), "*" if policy == "*" else f"trainer-{policy}"), *_reads_weights(s),
                   f"{API}.STREAM.MSG.GET.{s.stream('batch')}",  # its unacked batches, replayed after a restart
                   f"{API}.DIRECT.GET.{s.stream('traj')}", *_reads_trajectory_objects(s),
                   s.subject("weights", policy), s.subject("dlq", "batch"),
                   f"$O.{s.obj_bucket}.C.>", f"$O.{s.obj_bucket}.M.>", f"{API}.STREAM.PURGE.{s.obj_stream}",
                   f"$JS.*.API.STREAM.PURGE.{s.obj_stream}",
                   # its payloads' metadata (the orphan sweep, retention), on the hub and the mirrors
                   f"{API}.STREAM.MSG.GET.{s.obj_stream}", f"$JS.*.API.STREAM.MSG.GET.{s.obj_stream}",
                   s.kv("state", f"version.{policy}"), s.kv("state", f"done.{policy}"),
                   f"{API}.DIRECT.GET.{s.kv_stream('fates')}", f"{API}.DIRECT.GET.{s.kv_stream('fates')}.>",
                   f"{API}.STREAM.MSG.GET.{s.kv_stream('fates')}"])
    elif role == "rollout":
        pools = s.pools
        node = node_of(user)  # a node's own credential: its own subject only
        p.add(pub=[*(x for pool in pools for x in _pulls(s.stream("task"), pool)), *_reads_weights(s),
                   s.subject("traj", f"*.{node}" if node else ">"), f"$O.{s.traj_obj_bucket}.C.>", f"$O.{s.traj_obj_bucket}.M.>",
                   s.subject("dlq", "task"), s.subject("dlq", "weights"), s.kv("state", "keyframe_request.*")])
    elif role == "evaluator":
        p.add(pub=[*_reads_weights(s), s.subject("dlq", "weights"), s.kv("state", "eval.>"), s.kv("state", "keyframe_request.*")])
    elif role == "observer":
        p.add(pub=[f"{API}.STREAM.NAMES", *_reads_weights(s), f"{API}.DIRECT.GET.{s.kv_stream('fates')}.>"],
              sub=[s.subject("hb")])
    else:
        raise ValueError(f"unknown role {role!r}; roles: {ROLES}")
    return p


@dataclass(frozen=True)
class User:
    name: str
    role: str
    password: str  # a literal, or ``$ENV_VAR`` for the server's environment
    policy: str = "*"


def render_accounts(users: Iterable[User], scope: Scope) -> str:
    """The ``accounts`` block of a nats-server config: one account, JetStream on, a user per role."""
    lines = ["accounts {", "  ASTRA {", "    jetstream: enabled", "    users = ["]
    for u in users:
        perms = permissions(u.role, scope, u.policy, u.name)
        pw = u.password if u.password.startswith("$") else json.dumps(u.password)
        if perms is None:
            lines.append(f"      {{ user: {json.dumps(u.name)}, password: {pw} }}")
            continue
        lines.append(f"      {{ user: {json.dumps(u.name)}, password: {pw}, permissions: {{")
        for verb, subjects in (("publish", perms.publish), ("subscribe", perms.subscribe)):
            rows = [", ".join(json.dumps(x) for x in subjects[i : i + 4]) for i in range(0, len(subjects), 4)]
            lines.append(f"          {verb}: {{ allow: [")
            lines += [f"            {r}," if i < len(rows) - 1 else f"            {r}" for i, r in enumerate(rows)]
            lines.append("          ] }")
        lines.append("      } }")
    lines += ["    ]", "  }", "}"]
    return "\n".join(lines) + "\n"


SHIPPED_HEADER = """\
# One account for AstraFlow runs, a user per role, per-role subject permissions (least privilege).
# GENERATED by `python -m astraflow.streams.permissions` from astraflow/streams/permissions.py;
# `astraflow up` renders the same table for its own run (and per-policy trainer users).
# Passwords come from the environment of the nats-server process:
#   ASTRA_ADMIN_PASSWORD=... ASTRA_DATAFLOW_PASSWORD=... ASTRA_TRAINER_SOLVER_PASSWORD=... ASTRA_TRAINER_VERIFIER_PASSWORD=... \\
#   ASTRA_ROLLOUT_PASSWORD=... ASTRA_EVALUATOR_PASSWORD=... ASTRA_OBSERVER_PASSWORD=... nats-server -c jetstream/accounts.conf
# Other policies, pools, or one run id (the tightest scoping: streams told apart by name):
#   python -m astraflow.streams.permissions --run RUN --policies solver,verifier --pools raas --out accounts.conf
# Workers join with `--user ROLE` and the password in $NATS_PASSWORD, or with `--credential FILE`.
# Clients must use their own inbox prefix `_INBOX_{user}` (astraflow does): nobody reads another's replies.
listen: 127.0.0.1:4222
max_payload: 8MB
jetstream { store_dir: "./nats-store" }

"""


def deployment_users(policies: Iterable[str], password: str = "env") -> list[User]:
    """A user per role and one trainer user per policy; passwords from ``$ASTRA_{USER}_PASSWORD``."""
    named = [("admin", "admin", "*"), ("dataflow", "dataflow", "*"), *((f"trainer-{p}", "trainer", p) for p in policies),
             ("rollout", "rollout", "*"), ("evaluator", "evaluator", "*"), ("observer", "observer", "*")]
    return [User(n, r, f"$ASTRA_{n.upper().replace('-', '_')}_PASSWORD", p) for n, r, p in named]


def shipped_accounts_conf(run: str = "*", policies: tuple[str, ...] = ("solver", "verifier"), pools: tuple[str, ...] = ("raas",)) -> str:
    """The config for a deployment: ``run`` ``*`` serves any run id (streams are then not told apart by
    name, only consumers, so render one per run for the tightest scoping)."""
    return SHIPPED_HEADER + render_accounts(deployment_users(policies), Scope(run, policies, pools))


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Render the per-role accounts config of a deployment.")
    ap.add_argument("--run", default="*", help="run id to scope every stream and subject to (default: any run)")
    ap.add_argument("--policies", default="solver,verifier", help="comma-separated policy names (one trainer user each)")
    ap.add_argument("--pools", default="raas", help="comma-separated rollout pools")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "jetstream" / "accounts.conf"))
    a = ap.parse_args(argv)
    text = shipped_accounts_conf(a.run, tuple(a.policies.split(",")), tuple(a.pools.split(",")))
    Path(a.out).write_text(text)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
