"""Liveness of the ranks of a data-parallel trainer: a dead peer ends the survivors.

A rank that dies (kill -9, the OOM killer, a lost node) leaves its peers blocked in a collective
that may never complete: NCCL waits for its timeout, gloo for the process group's (30 min), and a
follower waiting for rank 0's next operation would wait for ever. So every rank of a group runs a
:class:`PeerWatch` thread. It bumps a counter under ``astraflow/alive/{life}/{rank}`` in the
group's rendezvous store (torchrun's agent store, or rank 0's TCPStore under the deepspeed
launcher and plain env launches) every ``timeout / 10`` seconds, and reads the other ranks'.

A peer whose counter has not moved for ``timeout`` seconds is dead, and so is every peer while the
store cannot be reached for that long (the rank or agent hosting it is gone). The watch then logs
which rank and exits the process at once with :data:`PEER_LOST_EXIT` (75, ``EX_TEMPFAIL``),
cleaning nothing up: the main thread may be stuck in a collective. Like a trainer killed with
kill -9, the group's supervisor (torchrun's agent with ``--max-restarts``, the deepspeed launcher,
systemd, a Kubernetes Job) restarts every rank, and the group resumes exactly from its last
checkpoint (``train/resume.py``); the batch rank 0 held is redelivered by the plane.

A rank that is alive but stuck is not this watch's business: its heartbeat thread keeps beating,
and the collective timeout of the process group catches it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)
PEER_LOST_EXIT = 75  # EX_TEMPFAIL: restart me (and my group) from the checkpoint


def silent_peers(last_moved: Mapping[int, float], now: float, timeout: float) -> list[int]:
    """Ranks whose heartbeat counter last moved more than ``timeout`` seconds before ``now``."""
    return sorted(r for r, t in last_moved.items() if now - t > timeout)


def _connect_store(timeout_s: float) -> Any:
    """A client of the group's rendezvous store (``MASTER_ADDR:MASTER_PORT``), its own connection."""
    from torch._C._distributed_c10d import TCPStore  # re-exported as torch.distributed.TCPStore, which mypy does not see

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def leave_group(why: str) -> None:
    log.error("%s: leaving (exit %d) so that the supervisor restarts the group from its last checkpoint", why, PEER_LOST_EXIT)
    logging.shutdown()
    os._exit(PEER_LOST_EXIT)


class PeerWatch:
    """Heartbeats of this rank and judgement of the others' (see the module doc)."""

    def __init__(self, rank: int, world_size: int, timeout: float, connect: Callable[[float], Any] = _connect_store,
                 on_lost: Callable[[str], None] = leave_group) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.every = timeout / 10
        self.life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # the agent store outlives a restarted group
        self._connect, self._on_lost = connect, on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"peer-watch-{rank}", daemon=True)

    def key(self, rank: int) -> str:
        return f"astraflow/alive/{self.life}/{rank}"

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.every + 1)

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        start = time.monotonic()
        moved = {r: start for r in peers}  # when each peer's counter last changed (start: the group just formed)
        seen: dict[int, bytes] = {}
        store, beats = None, 0
        while not self._stop.wait(self.every):
            try:
                store = store or self._connect(self.every)
                beats += 1
                store.set(self.key(self.rank), str(beats))
                now = time.monotonic()
                for r in peers:
                    if store.check([self.key(r)]):
                        value = bytes(store.get(self.key(r)))
                        if seen.get(r) != value:
                            seen[r], moved[r] = value, now
            except Exception as e:  # the store's host is gone or slow: no peer can be heard meanwhile
                log.debug("peer watch: store unreachable (%s)", e)
                store = None
            silent = silent_peers(moved, time.monotonic(), self.timeout)
            if silent and not self._stop.is_set():
                self._on_lost(f"rank {self.rank}: no heartbeat from rank(s) {silent} for {self.timeout:.0f}s")
                return
