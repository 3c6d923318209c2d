"""Backend operations every rank of a data-parallel trainer runs together.

Rank 0 is the only rank on the plane: it pulls batches and publishes versions. Each operation
that involves the model (a step, gathering the weights, a checkpoint or its in-memory snapshot) is named by rank 0 and
broadcast to the other ranks, which run it in the same order (:meth:`Collective.follow`).
With one process this is a plain call.

With several ranks the group fails as a whole (``train/peers.py``):

* every rank watches its peers' heartbeats and leaves (exit 75) when one falls silent;
* an operation that raises on any rank ends that rank the same way (the others are left inside a
  collective that cannot complete), instead of turning the batch away: its supervisor restarts
  the group, which resumes from the last checkpoint, and the plane redelivers the batch;
* while rank 0 waits for batches it broadcasts a ``noop`` every ``keepalive_s``, so a follower
  never waits out the process group's collective timeout on a quiet plane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from astraflow.train.backend import TrainerBackend
from astraflow.train.checkpoint import Checkpointer
from astraflow.train.peers import PeerWatch, leave_group

log = logging.getLogger(__name__)


class Collective:
    def __init__(self, backend: TrainerBackend, checkpointer: Checkpointer | None = None, peer_timeout: float = 60.0,
                 keepalive_s: float = 60.0, on_failure: Callable[[str], None] = leave_group) -> None:
        self.backend = backend
        self.checkpointer = checkpointer
        self.keepalive_s = keepalive_s
        self._on_failure = on_failure
        self._lock = threading.Lock()  # one broadcast at a time: the op sequence is the same on every rank
        self._last = time.monotonic()
        self._done = threading.Event()
        self.watch: PeerWatch | None = None
        if self.distributed:
            self.watch = PeerWatch(backend.rank, backend.world_size, peer_timeout).start()
            if backend.rank == 0:
                threading.Thread(target=self._keep_alive, name="collective-keepalive", daemon=True).start()

    @property
    def distributed(self) -> bool:
        return self.backend.world_size > 1

    def __call__(self, op: str, *args: Any) -> Any:
        """Run ``op`` on every rank (rank 0 only calls this); returns rank 0's result."""
        if not self.distributed:
            return self._run(op, args)
        with self._lock:
            if self._done.is_set():  # after ``stop`` no rank follows any more
                raise RuntimeError(f"{op}: the group was stopped")
            return self._broadcast(op, args)

    def _broadcast(self, op: str, args: tuple[Any, ...]) -> Any:
        """Name ``op`` to the followers and run it here (the caller holds the lock)."""
        self._last = time.monotonic()
        try:
            _bind_device(self.backend)
            dist.broadcast_object_list([(op, args)], src=0)
            return self._run(op, args)
        except Exception as e:
            log.exception("%s failed on rank 0", op)
            self._on_failure(f"rank 0: {op} failed ({e})")
            raise

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 names until it says ``stop``."""
        _bind_device(self.backend)
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0)
                op, args = box[0]
                self._run(op, args)
            except Exception as e:
                log.exception("rank %d: following rank 0 failed", self.backend.rank)
                self._on_failure(f"rank {self.backend.rank}: {e}")
                raise
            if op == "stop":
                return

    def _run(self, op: str, args: tuple[Any, ...]) -> Any:
        b, c = self.backend, self.checkpointer
        if op == "step":
            return b.step(*args)
        if op == "state":
            return b.state_dict_bf16()
        if op == "retune":
            return b.retune()
        if op == "load_weights":
            return b.load_weights(*args)
        if op in ("save", "snapshot", "load"):
            if c is None:
                raise RuntimeError(f"{op}: the trainer has no checkpoint directory")
            return c.save(b, *args) if op == "save" else c.snapshot(b, *args) if op == "snapshot" else c.load(b, *args)
        if op == "noop":
            return None
        if op == "stop":
            self._done.set()
            if self.watch is not None:  # no collective follows: a peer leaving now is no failure
                self.watch.stop()
            return None
        raise ValueError(f"unknown collective operation {op!r}")

    def _keep_alive(self) -> None:
        """Rank 0: a ``noop`` after ``keepalive_s`` without an operation (the followers' broadcast must not time out)."""
        while not self._done.wait(self.keepalive_s / 4):
            with self._lock:
                if not self._done.is_set() and time.monotonic() - self._last >= self.keepalive_s:
                    self._broadcast("noop", ())


def _bind_device(backend: TrainerBackend) -> None:
    """Collectives run in worker threads: point this thread at the rank's GPU (the CUDA device is per thread)."""
    device = getattr(backend, "device", None)
    if torch.cuda.is_available() and isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.set_device(device)


def barrier_for(backend: TrainerBackend) -> Any:
    """A barrier over the trainer's ranks (a no-op for one process)."""
    return dist.barrier if backend.world_size > 1 else None
