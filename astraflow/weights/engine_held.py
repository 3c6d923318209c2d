"""The weights of an engine that fetches its own (vLLM's worker, ``rollout/engines/worker_weights.py``), as the node's
sync sees them: the same face as ``HeldImage`` (``key``, ``holding``, ``hold_base``, ``apply_chain``), but the image
lives in the engine's worker and the node holds none.

``apply_chain`` hands the planned chain to the engine (``fetch_chain``: the worker reads and checks every payload while
the engine generates), then installs the verified version it staged (``install_fetched``: the only part that stalls
generation). A chain that failed midway still installs what it verified, then raises, so the sync plans again from a
keyframe, exactly as with a local image. LoRA versions (``adapter``) stay on the node: their adapters are kept here and
loaded by the engine's own LoRA support (``load_adapter``), so they go through a local ``HeldImage``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from astraflow.streams.messages import WeightVersion
from astraflow.streams.object_source import ObjectSource
from astraflow.streams.objects import ObjectStore
from astraflow.weights.image import HeldImage, WeightSyncError, WeightTarget
from astraflow.weights.retention import Key


class FetchReport(BaseModel):
    """What a worker's fetch left: the image it holds (``held_version`` -1: none, or dropped), the verified version
    waiting to be installed (``staged``; -1: none), the counters it added, and the error that ended it (None: none)."""

    model_config = ConfigDict(extra="forbid")
    held_version: int
    held_digest: str | None
    staged: int
    stats: dict[str, int]
    error: str | None = None


class FetchesOwnWeights(WeightTarget, Protocol):
    """An engine whose worker reads weight versions from the object store itself (vLLM's); ``load_state`` is still
    how a caller with tensors in hand installs them."""

    def fetch_chain(self, source: ObjectSource, chain: list[WeightVersion]) -> FetchReport: ...

    def install_fetched(self, version: int) -> None: ...


class EngineHeldImage:
    """``HeldImage``'s face over an image in the engine's worker (module doc); ``version``/``digest``: what the worker's
    last report said it holds."""

    def __init__(self, engine: FetchesOwnWeights, source: ObjectSource, objects: ObjectStore, stats: Counter[str]) -> None:
        self.engine, self.source, self.stats = engine, source, stats
        self.local = HeldImage(engine, objects, stats)  # LoRA versions' adapters (module doc)
        self.on_node = False  # the last version reached was a LoRA version, held by ``local``
        self.version = -1  # of the worker's image (-1: none)
        self.digest: str | None = None
        self.pinned = False

    @property
    def holding(self) -> bool:
        return self.local.holding if self.on_node else self.version >= 0

    def key(self) -> Key | None:
        if self.on_node:
            return self.local.key()
        return (self.version, self.digest) if self.version >= 0 and self.digest is not None else None

    async def hold_base(self, target: WeightVersion) -> str | None:
        return await self.local.hold_base(target)

    async def apply_chain(self, chain: list[WeightVersion]) -> None:
        if any(a.adapter is not None for a in chain):
            self.on_node = True
            await self.local.apply_chain(chain)
            return
        self.on_node = False
        self.local.drop()
        report = await asyncio.to_thread(self.engine.fetch_chain, self.source, chain)
        self.stats.update(report.stats)
        self.version, self.digest = report.held_version, report.held_digest
        if report.staged >= 0 and report.staged != self.engine.version:
            await asyncio.to_thread(self.engine.install_fetched, report.staged)
        if report.error is not None:
            raise WeightSyncError(f"the engine's worker: {report.error}")

    def drop(self) -> None:
        self.version, self.digest = -1, None
        self.local.drop()


def holder_for(engine: Any, source: ObjectSource | None, objects: ObjectStore, stats: Counter[str]) -> HeldImage | EngineHeldImage:
    """Where a node holds ``engine``'s weights: in the engine's worker where it fetches its own and the node knows how to
    reach the store from another process (``source``), else in the node (``HeldImage``)."""
    if source is not None and callable(getattr(engine, "fetch_chain", None)):
        return EngineHeldImage(engine, source, objects, stats)
    return HeldImage(engine, objects, stats)
