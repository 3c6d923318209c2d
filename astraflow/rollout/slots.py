"""A rollout node's generation slots: up to ``size`` tasks in flight, a new one admitted whenever one finishes.

Each admitted task is served by its own asyncio task (its own workflow call on its own thread), so a
slow task holds one slot and never the node: the others keep finishing, being acked and being
replaced. A task whose generation is over gives its slot back (:meth:`Slots.vacate`) before its
trajectories are published and it is acked: the next task generates meanwhile, and the tasks of
one engine batch, which finish together, are replaced together (one pull, one next batch)
rather than one by one as their settlements return. Until it is settled a task is still held:
its delivery is kept alive on the server with ``in_progress`` every ``keep_alive_s``
(``ack_wait / 3``), and ``drain()`` waits for it. Each task's own runner bounds that wait by
``rollout.drain_timeout`` once the node is told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from astraflow.runtime import cancel_and_wait
from astraflow.streams.messages import Task
from astraflow.streams.plane import Delivery


class Slots:
    """``size`` generation slots; ``held`` are the deliveries of the tasks in them."""

    def __init__(self, size: int, keep_alive_s: float) -> None:
        if size < 1:
            raise ValueError(f"a node needs at least one generation slot, got {size}")
        self.size = size
        self.keep_alive_s = keep_alive_s
        self._running: dict[asyncio.Task[Any], Delivery[Task]] = {}  # in a slot: admitted, generating
        self._settling: dict[asyncio.Task[Any], Delivery[Task]] = {}  # slot given back, not settled yet
        self._freed = asyncio.Event()

    @property
    def held(self) -> list[Delivery[Task]]:
        """Every delivery not settled yet: in a slot or settling."""
        return [*self._running.values(), *self._settling.values()]

    @property
    def free(self) -> int:
        return self.size - len(self._running)

    def start(self, delivery: Delivery[Task], work: Coroutine[Any, Any, None]) -> None:
        """Serve ``delivery`` with ``work`` in a slot (the caller admits at most ``free`` at a time)."""
        assert self.free > 0, "no free slot"
        runner = asyncio.create_task(work)
        self._running[runner] = delivery
        runner.add_done_callback(self._release)

    def vacate(self) -> None:
        """Called by a task's runner once its generation is over: its slot is free, its delivery still held."""
        runner = asyncio.current_task()
        if runner is not None and runner in self._running:
            self._settling[runner] = self._running.pop(runner)
            self._freed.set()

    def _release(self, runner: asyncio.Task[Any]) -> None:
        self._running.pop(runner, None)
        self._settling.pop(runner, None)
        self._freed.set()

    async def wait_free(self, stop: asyncio.Event) -> None:
        """Return once a slot is free or ``stop`` is set."""
        while self.free <= 0 and not stop.is_set():
            self._freed.clear()
            waits = {asyncio.ensure_future(self._freed.wait()), asyncio.ensure_future(stop.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def keep_alive(self) -> None:
        """Until cancelled: ``in_progress`` for every held delivery every ``keep_alive_s``."""
        while True:
            await asyncio.sleep(self.keep_alive_s)
            await asyncio.gather(*(d.in_progress() for d in self.held), return_exceptions=True)

    async def drain(self) -> None:
        """Wait for every task in flight (each settles its own delivery: ack, nak or term)."""
        while self._running or self._settling:
            await asyncio.gather(*self._running, *self._settling, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def kept_alive(self) -> AsyncIterator[Slots]:
        """The keep-alive loop for the lifetime of the block; on leaving, drains first, then stops keeping alive."""
        keeper = asyncio.create_task(self.keep_alive())
        try:
            yield self
        finally:
            try:
                await self.drain()
            finally:
                await cancel_and_wait(keeper)
