"""Where another process of a role reads the run's weight payloads: the role's own connection options, its run, and
the bucket as its JetStream domain sees it. A serving engine's worker (vLLM's, ``rollout/engines/worker_weights.py``)
fetches each version itself with it, so the version reaches the engine's parameters without passing through the node.

The options carry the node's credential (its user and password, or the paths of its key files): the worker reads what
the node may read, nothing more. They travel to the worker as JSON, on the node's host only (an in-process engine's
call, or the local engine server's ``/collective_rpc``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from astraflow.streams.objects import ObjectStore
from astraflow.streams.plane import NatsOptions, Plane


class ObjectSource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    nats: NatsOptions
    run: str
    domain: str | None = None  # the JetStream domain read (a region's leaf: its mirrors)
    stream: str | None = None  # the object stream's name there (None: the hub's, which mirrors share)
    wait_missing: float = 0.0  # how long a chunk may lag its announcement (a mirror)

    @classmethod
    def of(cls, plane: Plane, domain: str | None, stream: str | None, wait_missing: float) -> ObjectSource | None:
        """How ``plane``'s weight bucket is read from another process (None: ``plane`` was not made by
        ``Plane.connect``, so there is no telling)."""
        if plane.options is None:
            return None
        return cls(nats=plane.options, run=plane.names.run, domain=domain or plane.domain, stream=stream,
                   wait_missing=wait_missing)

    async def open(self, worker_id: str, wait: float = 30.0) -> tuple[Plane, ObjectStore]:
        """A connection of this process (named ``worker_id``) and the bucket read through it."""
        plane = await Plane.connect(self.nats, self.run, worker_id, wait=wait)
        return plane, plane.objects(domain=self.domain, stream=self.stream, wait_missing=self.wait_missing)
