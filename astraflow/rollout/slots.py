"""A rollout node's generation slots: up to ``size`` tasks in flight, a new one admitted whenever one finishes.

Each admitted task is served by its own asyncio task (its own workflow call on its own thread), so a
slow task holds one slot and never the node: the others keep finishing, being acked and being
replaced. While a task is held, its delivery is kept alive on the server with ``in_progress`` every
``keep_alive_s`` (``ack_wait / 3``). ``drain()`` waits for what is in flight; each task's own
runner bounds that wait by ``rollout.drain_timeout`` once the node is told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from astraflow.streams.messages import Task
from astraflow.streams.plane import Delivery


class Slots:
    """``size`` generation slots; ``held`` are the deliveries of the tasks in them."""

    def __init__(self, size: int, keep_alive_s: float) -> None:
        if size < 1:
            raise ValueError(f"a node needs at least one generation slot, got {size}")
        self.size = size
        self.keep_alive_s = keep_alive_s
        self._running: dict[asyncio.Task[Any], Delivery[Task]] = {}
        self._freed = asyncio.Event()

    @property
    def held(self) -> list[Delivery[Task]]:
        return list(self._running.values())

    @property
    def free(self) -> int:
        return self.size - len(self._running)

    def start(self, delivery: Delivery[Task], work: Coroutine[Any, Any, None]) -> None:
        """Serve ``delivery`` with ``work`` in a slot (the caller admits at most ``free`` at a time)."""
        assert self.free > 0, "no free slot"
        runner = asyncio.create_task(work)
        self._running[runner] = delivery
        runner.add_done_callback(self._release)

    def _release(self, runner: asyncio.Task[Any]) -> None:
        self._running.pop(runner, None)
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
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

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
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper
