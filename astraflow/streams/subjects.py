"""Names of subjects, streams, consumers and buckets for one run.

Everything is scoped by the run id; policy and workflow names are subject tokens, so all three
are restricted to ``[A-Za-z0-9_-]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FAMILIES = ("task", "traj", "batch", "weights", "dlq")  # subject families that have a stream


def check_token(kind: str, value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{kind} {value!r} must match [A-Za-z0-9_-]{{1,64}} (it is a NATS subject token)")
    return value


@dataclass(frozen=True)
class Names:
    run: str

    def __post_init__(self) -> None:
        check_token("run id", self.run)

    # subjects
    def task(self, workflow: str) -> str:
        return f"af.{self.run}.task.{check_token('workflow', workflow)}"

    def traj(self, policy: str, node: str | None = None) -> str:
        """A policy's trajectories; ``node``: the publishing node's own subject (a node credential may publish only
        under its name, so the server vouches for it: ``sender``)."""
        base = f"af.{self.run}.traj.{check_token('policy', policy)}"
        return f"{base}.{check_token('node', node)}" if node else base

    @staticmethod
    def sender(subject: str) -> str | None:
        """The node a trajectory subject names (``af.{run}.traj.{policy}.{node}``), None for one that names none."""
        parts = subject.split(".")
        return parts[4] if len(parts) == 5 and parts[2] == "traj" else None

    def batch(self, policy: str) -> str:
        return f"af.{self.run}.batch.{check_token('policy', policy)}"

    def weights(self, policy: str) -> str:
        return f"af.{self.run}.weights.{check_token('policy', policy)}"

    def hb(self, role: str, worker_id: str) -> str:
        return f"af.{self.run}.hb.{role}.{check_token('worker id', worker_id)}"

    def dlq(self, kind: str) -> str:
        return f"af.{self.run}.dlq.{kind}"

    def all(self, family: str) -> str:
        return f"af.{self.run}.{family}.>"

    # streams
    def stream(self, family: str) -> str:
        """The stream of a subject family: ``task``, ``traj``, ``batch``, ``weights`` or ``dlq``."""
        if family not in FAMILIES:
            raise ValueError(f"no stream for subject family {family!r}; families: {FAMILIES}")
        return f"AF_{self.run}_{family.upper()}"

    @property
    def task_stream(self) -> str:
        return f"AF_{self.run}_TASK"

    @property
    def traj_stream(self) -> str:
        return f"AF_{self.run}_TRAJ"

    @property
    def batch_stream(self) -> str:
        return f"AF_{self.run}_BATCH"

    @property
    def weights_stream(self) -> str:
        return f"AF_{self.run}_WEIGHTS"

    @property
    def dlq_stream(self) -> str:
        return f"AF_{self.run}_DLQ"

    # consumers
    @staticmethod
    def pool_consumer(pool: str = "raas") -> str:
        return check_token("pool", pool)

    DATAFLOW_CONSUMER = "dataflow"

    @staticmethod
    def trainer_consumer(policy: str) -> str:
        return f"trainer-{check_token('policy', policy)}"

    # buckets
    @property
    def state_bucket(self) -> str:
        return f"af_{self.run}_state"

    @property
    def fates_bucket(self) -> str:
        return f"af_{self.run}_fates"

    @property
    def object_bucket(self) -> str:
        """Weight payloads (written by trainers)."""
        return f"af_{self.run}_weights"

    @property
    def traj_object_bucket(self) -> str:
        """The arrays of trajectories too large for one message (written by rollout nodes)."""
        return f"af_{self.run}_traj_objects"

    def max_deliveries_advisory(self, stream: str, durable: str) -> str:
        """Where the server announces a message that ran out of deliveries on ``durable``."""
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{durable}"
