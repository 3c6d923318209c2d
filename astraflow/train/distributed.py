"""Backend operations every rank of a data-parallel trainer runs together.

Rank 0 is the only rank on the plane: it pulls batches and publishes versions. Each operation
that involves the model (a step, gathering the weights, a checkpoint) is named by rank 0 and
broadcast to the other ranks, which run it in the same order (:meth:`Collective.follow`).
With one process this is a plain call.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from astraflow.train.backend import TrainerBackend
from astraflow.train.checkpoint import Checkpointer


class Collective:
    def __init__(self, backend: TrainerBackend, checkpointer: Checkpointer | None = None) -> None:
        self.backend = backend
        self.checkpointer = checkpointer

    @property
    def distributed(self) -> bool:
        return self.backend.world_size > 1

    def __call__(self, op: str, *args: Any) -> Any:
        """Run ``op`` on every rank (rank 0 only calls this); returns rank 0's result."""
        if self.distributed:
            dist.broadcast_object_list([(op, args)], src=0)
        return self._run(op, args)

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 names until it says ``stop``."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            op, args = box[0]
            self._run(op, args)
            if op == "stop":
                return

    def _run(self, op: str, args: tuple[Any, ...]) -> Any:
        b, c = self.backend, self.checkpointer
        if op == "step":
            return b.step(*args)
        if op == "state":
            return b.state_dict_bf16()
        if op == "load_weights":
            return b.load_weights(*args)
        if op in ("save", "load"):
            if c is None:
                raise RuntimeError(f"{op}: the trainer has no checkpoint directory")
            return c.save(b, *args) if op == "save" else c.load(b, *args)
        if op == "stop":
            return None
        raise ValueError(f"unknown collective operation {op!r}")


def barrier_for(backend: TrainerBackend) -> Any:
    """A barrier over the trainer's ranks (a no-op for one process)."""
    return dist.barrier if backend.world_size > 1 else None
