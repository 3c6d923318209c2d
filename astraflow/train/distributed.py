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
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from astraflow.train.backend import TrainerBackend
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta, Snapshot
from astraflow.train.peers import PeerWatch, leave_group

if TYPE_CHECKING:
    from astraflow.streams.trajectories import TrainingBatch

log = logging.getLogger(__name__)


class Op(str, Enum):
    """What rank 0 names to the followers (broadcast with its arguments)."""

    STEP = "step"
    STATE = "state"
    BASE = "base"
    RETUNE = "retune"
    LOAD_WEIGHTS = "load_weights"
    SAVE = "save"
    SNAPSHOT = "snapshot"
    LOAD = "load"
    NOOP = "noop"
    STOP = "stop"


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
        b = backend
        self._handlers: dict[Op, Callable[..., Any]] = {
            Op.STEP: b.step, Op.STATE: b.state_dict_bf16, Op.BASE: b.base_bf16, Op.RETUNE: b.retune, Op.LOAD_WEIGHTS: b.load_weights,
            Op.SAVE: lambda meta: self._checkpointer().save(b, meta), Op.SNAPSHOT: lambda meta: self._checkpointer().snapshot(b, meta),
            Op.LOAD: lambda path: self._checkpointer().load(b, path), Op.NOOP: lambda: None, Op.STOP: self._stopped}
        self.watch: PeerWatch | None = None
        if self.distributed:
            self.watch = PeerWatch(backend.rank, backend.world_size, peer_timeout).start()
            if backend.rank == 0:
                threading.Thread(target=self._keep_alive, name="collective-keepalive", daemon=True).start()

    @property
    def distributed(self) -> bool:
        return self.backend.world_size > 1

    # ------------------------------------------------------------ rank 0's typed surface: each runs on every rank
    def step(self, batch: TrainingBatch) -> dict[str, float]:
        result: dict[str, float] = self._call(Op.STEP, batch)
        return result

    def state(self) -> dict[str, torch.Tensor]:
        """The bf16 image of the weights (``state_dict_bf16``)."""
        result: dict[str, torch.Tensor] = self._call(Op.STATE)
        return result

    def base(self) -> dict[str, torch.Tensor] | None:
        """The bf16 base weights LoRA versions adapt (``base_bf16``), or None."""
        result: dict[str, torch.Tensor] | None = self._call(Op.BASE)
        return result

    def retune(self) -> dict[str, tuple[float, float]]:
        result: dict[str, tuple[float, float]] = self._call(Op.RETUNE)
        return result

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        self._call(Op.LOAD_WEIGHTS, state)

    def save(self, meta: CheckpointMeta) -> Path:
        result: Path = self._call(Op.SAVE, meta)
        return result

    def snapshot(self, meta: CheckpointMeta) -> Snapshot | None:
        result: Snapshot | None = self._call(Op.SNAPSHOT, meta)
        return result

    def load(self, path: Path) -> None:
        self._call(Op.LOAD, path)

    def stop(self) -> None:
        self._call(Op.STOP)

    def _call(self, op: Op, *args: Any) -> Any:
        """Run ``op`` on every rank (rank 0 only calls this); returns rank 0's result."""
        if not self.distributed:
            return self._run(op, args)
        with self._lock:
            if self._done.is_set():  # after ``stop`` no rank follows any more
                raise RuntimeError(f"{op.value}: the group was stopped")
            return self._broadcast(op, args)

    def _broadcast(self, op: Op, args: tuple[Any, ...]) -> Any:
        """Name ``op`` to the followers and run it here (the caller holds the lock)."""
        self._last = time.monotonic()
        try:
            _bind_device(self.backend)
            dist.broadcast_object_list([(op, args)], src=0)
            return self._run(op, args)
        except Exception as e:
            log.exception("%s failed on rank 0", op.value)
            self._on_failure(f"rank 0: {op.value} failed ({e})")
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
            if op is Op.STOP:
                return

    def _run(self, op: Op, args: tuple[Any, ...]) -> Any:
        return self._handlers[op](*args)

    def _checkpointer(self) -> Checkpointer:
        if self.checkpointer is None:
            raise RuntimeError("the trainer has no checkpoint directory")
        return self.checkpointer

    def _stopped(self) -> None:
        self._done.set()
        if self.watch is not None:  # no collective follows: a peer leaving now is no failure
            self.watch.stop()

    def _keep_alive(self) -> None:
        """Rank 0: a ``noop`` after ``keepalive_s`` without an operation (the followers' broadcast must not time out)."""
        while not self._done.wait(self.keepalive_s / 4):
            with self._lock:
                if not self._done.is_set() and time.monotonic() - self._last >= self.keepalive_s:
                    self._broadcast(Op.NOOP, ())


def _bind_device(backend: TrainerBackend) -> None:
    """Collectives run in worker threads: point this thread at the rank's GPU (the CUDA device is per thread)."""
    device = getattr(backend, "device", None)
    if torch.cuda.is_available() and isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.set_device(device)


def barrier_for(backend: TrainerBackend) -> Any:
    """A barrier over the trainer's ranks (a no-op for one process)."""
    return dist.barrier if backend.world_size > 1 else None
