"""A rollout node's weights: one ``WeightSync`` per policy, the newest version it knows was announced, and refresh.

A refresh applies every announced version the node has not applied yet. Each policy's
announcements are pushed to the node as they are made (``WeightSync``'s follower, an ordered
push consumer), so a refresh that finds nothing new asks the server nothing: it is called after
every pull, and a node that asked the run-state KV each time spent a request per pull on it. A
follower not made yet (the stream not there, the server restarting) is tried again every
``FULL_REFRESH_S``, not at every safe point, so a plane that does not answer costs a pull no
wait. Refreshes are serialised: the admission loop, a workflow's safe point and the watch
(:meth:`NodeWeights.watch`) may ask at once. The run-state KV (``version.{policy}``) is read only
to confirm, before a task is turned away as too new, that its version was really announced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.streams.messages import Task
from astraflow.streams.plane import Plane
from astraflow.streams.state import VersionRecord
from astraflow.weights.sync import WeightSync

log = logging.getLogger(__name__)
FULL_REFRESH_S = 5.0
WATCH_S = 0.25  # a watching node refreshes at least this often (a follower not made yet is tried every FULL_REFRESH_S)


class NodeWeights:
    """The weight versions of a node's policies. ``stats``: the node's counters (``refreshes``, ``refresh_s``,
    ``refresh_errors`` are added to)."""

    def __init__(self, plane: Plane, handles: Mapping[str, PolicyHandle], domain: str | None, stats: dict[str, float]) -> None:
        self.plane = plane
        self.syncs = {p: WeightSync(plane, p, h.engine, domain=domain) for p, h in handles.items()}
        self.announced = {p: -1 for p in handles}  # newest version the run-state KV confirmed, per policy
        self.stats = stats
        self._last_full_refresh = 0.0
        self._lock = asyncio.Lock()

    def version(self, policy: str) -> int:
        return self.syncs[policy].version

    async def join(self, stop: asyncio.Event) -> None:
        """Wait for each policy's current weights, however long a warm start takes (or until ``stop``)."""
        for policy, sync in self.syncs.items():
            while sync.version < 0 and not stop.is_set():
                try:
                    await sync.wait_for(0, timeout=60)
                except TimeoutError as e:
                    log.info("still waiting for the first weights of %s: %s", policy, e)
        self._last_full_refresh = time.monotonic()

    async def watch(self, stop: asyncio.Event, patience: float = WATCH_S) -> None:
        """Apply each version as it is announced, until ``stop``: fetched, decoded and checked while the engine
        generates, so a safe point finds it ready and only the install waits for the batch in flight (``hf``: between
        batches, or between decoding steps with partial rollouts). Every ``patience`` s without news it refreshes anyway
        (a follower not made yet is tried again there)."""
        while not stop.is_set():
            arrivals = [asyncio.ensure_future(sync.arrival(patience)) for sync in self.syncs.values()]
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait([*arrivals, stopping], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for f in (*arrivals, stopping):
                    f.cancel()
            if stop.is_set():
                break
            try:
                await self.refresh()
            except Exception as e:  # the watch goes on: safe points refresh too, but a version is ready sooner with it
                log.warning("watching for weights: %s: %s", type(e).__name__, e)

    async def refresh(self) -> bool:
        """A safe point: apply every announced version not applied yet; True if any version changed."""
        async with self._lock:
            t0 = time.perf_counter()
            try:
                return await self._refresh()
            finally:
                self.stats["refresh_s"] += time.perf_counter() - t0

    async def _refresh(self) -> bool:
        now = time.monotonic()
        due = now - self._last_full_refresh > FULL_REFRESH_S
        if due:
            self._last_full_refresh = now
        changed = False
        for p, sync in self.syncs.items():
            if not (due or sync.following):
                continue
            try:
                changed |= await sync.refresh(wait=0.0)
            except Exception as e:  # keep serving what the weights allow; tasks that need newer ones go back
                self.stats["refresh_errors"] += 1
                log.warning("refreshing %s failed: %s", p, e)
        if changed:
            self.stats["refreshes"] += 1
        return changed

    async def confirm_newest(self) -> None:
        """Read every policy's newest announced version from the run-state KV now (raises ``StateReadError``)."""
        for p in self.syncs:
            self._saw(p, await self.plane.state.get(VersionRecord, p))

    def _saw(self, policy: str, record: VersionRecord | None) -> None:
        if record is not None:
            self.announced[policy] = max(self.announced[policy], record.version)

    def newest(self) -> dict[str, int]:
        """The newest version of each policy this node knows was announced (KV, follower, or held)."""
        out = {}
        for p, sync in self.syncs.items():
            followed = sync.newest.version if sync.newest is not None else -1
            out[p] = max(self.announced[p], followed, sync.version)
        return out

    def ready_for(self, task: Task) -> bool:
        """The node holds weights at least as new as ``task`` allows for each of its policies."""
        return all(self.syncs[p].version >= v for p, v in task.min_versions.items() if p in self.syncs)
