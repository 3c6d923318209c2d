"""Trainer checkpoints: atomic directories of weights, optimizer, RNG, version and trained batch ids.

Layout under the checkpoint root (one root per policy, e.g. ``RUN_DIR/checkpoints/solver``)::

    v00000012/            one complete checkpoint (the version it holds)
      model.safetensors   weights (written by the backend; deepspeed adds its own files)
      optimizer.safetensors  optimizer state (its structure in the metadata; optimizer.pt in older checkpoints)
      rng-0.pt            RNG states of rank 0 (torch, cuda, python, numpy)
      meta.json           version, trained batch ids, the last step's batch ids and metrics, lineage
    reference.safetensors the frozen version-0 policy of the KL penalty (written once)

A checkpoint is written into ``.tmp-v00000012/``, every file fsync'ed, then renamed into
place (and the root fsync'ed), so a crash leaves either the whole checkpoint or none of it.
The newest ``keep`` checkpoints are kept.

Two ways to write one: :meth:`Checkpointer.save` (synchronous, collective under data parallel), or
:meth:`Checkpointer.snapshot` (an in-memory copy of weights, optimizer, RNG and meta, taken at once)
then :meth:`Checkpointer.write` of that copy from another thread while training goes on
(``train/group_commit.py``). A backend that cannot copy itself (``snapshot()`` is None: DeepSpeed)
is saved synchronously by ``snapshot``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from astraflow.runtime import crash_point
from astraflow.train.backend import TrainerBackend

_NAME = re.compile(r"^v(\d{8})$")


@dataclass(frozen=True)
class CheckpointMeta:
    version: int  # the weight version these weights are
    policy: str
    trained: list[str]  # ids of every batch trained into these weights, in order
    last_batch_ids: list[str] = field(default_factory=list)  # the batches of this version's step
    last_metrics: dict[str, float] = field(default_factory=dict)  # that step's metrics (for a re-announcement)
    created_at: float = field(default_factory=time.time)
    lineage: str = ""  # the weight lineage these weights belong to ("" in checkpoints from before lineages)
    lineage_base: int = 0  # its first version (``trainer.steps`` count from it)


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint held in memory, not yet written: what :meth:`Checkpointer.write` puts on disk."""

    meta: CheckpointMeta
    write_backend: Callable[[Path], None]  # writes the copied weights and optimizer state under a directory
    rng: dict[str, Any]
    reference: dict[str, torch.Tensor] | None  # the KL reference, while its file is not written yet


class Checkpointer:
    def __init__(self, root: Path, keep: int = 2, rank: int = 0, barrier: Callable[[], None] | None = None) -> None:
        self.root = Path(root)
        self.keep = keep
        self.rank = rank
        self.barrier = barrier or (lambda: None)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):  # a save that died half-way
                shutil.rmtree(stale, ignore_errors=True)
        self.barrier()

    def latest(self) -> tuple[Path, CheckpointMeta] | None:
        found = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _NAME.match(p.name)) and (p / "meta.json").exists())
        if not found:
            return None
        path = found[-1][1]
        return path, CheckpointMeta(**json.loads((path / "meta.json").read_text()))

    def save(self, backend: TrainerBackend, meta: CheckpointMeta) -> Path:
        """Write a checkpoint of ``backend`` at ``meta.version``; a collective call under data parallel."""
        tmp = self._tmp(meta.version)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.barrier()
        reference = backend.reference_state()
        if reference is not None:  # the first checkpoint (v0) fixes π_ref for the whole run
            self.save_reference(reference)
        backend.save(tmp)
        torch.save(_rng_state(), tmp / f"rng-{self.rank}.pt")
        self.barrier()
        final = self._commit(tmp, meta) if self.rank == 0 else self._final(meta.version)
        self.barrier()
        return final

    def snapshot(self, backend: TrainerBackend, meta: CheckpointMeta) -> Snapshot | None:
        """Copy what a checkpoint at ``meta.version`` holds, now, for :meth:`write` later (from any thread); None when
        the backend cannot copy itself: then the checkpoint is saved here, synchronously (collective)."""
        write_backend = backend.snapshot()
        if write_backend is None:
            self.save(backend, meta)
            return None
        reference = None if (self.root / "reference.safetensors").exists() else backend.reference_state()
        return Snapshot(meta, write_backend, _rng_state(), reference)

    def write(self, snap: Snapshot) -> Path:
        """Write ``snap`` as a complete checkpoint (temp directory, fsync, atomic rename); one process only."""
        tmp = self._tmp(snap.meta.version)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        if snap.reference is not None:
            self.save_reference(snap.reference)
        snap.write_backend(tmp)
        torch.save(snap.rng, tmp / f"rng-{self.rank}.pt")
        crash_point("during_checkpoint_write", snap.meta.version)
        return self._commit(tmp, snap.meta)

    def _tmp(self, version: int) -> Path:
        return self.root / f".tmp-v{version:08d}"

    def _final(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def _commit(self, tmp: Path, meta: CheckpointMeta) -> Path:
        """Rank 0: the meta, every file fsync'ed, then the directory renamed into place (the commit point)."""
        final = self._final(meta.version)
        (tmp / "meta.json").write_text(json.dumps(asdict(meta)))
        _fsync_tree(tmp)
        if final.exists():  # a checkpoint of this version from an earlier life: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def load(self, backend: TrainerBackend, path: Path) -> None:
        backend.load(path)
        reference = self.load_reference()
        if reference is not None:
            backend.load_reference(reference)
        rng = path / f"rng-{self.rank}.pt"
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=True))

    # ------------------------------------------------------------------ the KL reference (written once)
    def save_reference(self, state: dict[str, torch.Tensor]) -> None:
        path = self.root / "reference.safetensors"
        if self.rank != 0 or path.exists():
            return
        tmp = self.root / ".tmp-reference.safetensors"
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(tmp))
        _fsync_file(tmp)
        os.rename(tmp, path)
        _fsync_dir(self.root)

    def load_reference(self) -> dict[str, torch.Tensor] | None:
        path = self.root / "reference.safetensors"
        return load_file(str(path)) if path.exists() else None

    def _prune(self) -> None:
        done = sorted(p for p in self.root.iterdir() if _NAME.match(p.name))
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": _numpy_state(),
    }


def _numpy_state() -> list[Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return [name, np.asarray(keys).tolist(), pos, has_gauss, gauss]


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    random.setstate(s["python"])
    name, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_file(path)  # directories are fsync'ed through a read-only descriptor on POSIX


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):
        if p.is_file():
            _fsync_file(p)
        elif p.is_dir():
            _fsync_dir(p)
    _fsync_dir(root)
