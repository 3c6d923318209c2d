"""Weight versions a serving engine's worker fetches and installs itself: the node plans, the worker reads.

The node plans which versions to apply (``weights/sync.py``), as for any engine; an engine whose worker lives in a
process of its own (vLLM's) is then told the plan, and its worker does the rest:

1. ``begin(source, chain)``: on a thread of its own the worker reads each payload from the object store
   (``ObjectSource``) and applies it while it streams in onto a bf16 image the worker holds — every check of
   ``weights/image.py`` (a delta only onto exactly its base, each chunk's sha256, the state digest after every step,
   a corrupt or missing chunk never applied) — while the engine goes on generating with the weights it has;
2. ``poll(job)``: the node asks until the fetch is done: the report says which version the image holds and which
   verified version waits to be installed, or why the chain failed (the node then plans again, from a keyframe);
3. ``take()``: between two decoding steps (the engine paused), the names the staged version changed and the image to
   write them from: the engine writes them into its live parameters (``vllm.py``: layer by layer, repacked).

So no version passes through the node process or a model directory, and generation stalls only for step 3.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future

import torch

from astraflow.streams.messages import WeightVersion
from astraflow.streams.object_source import ObjectSource
from astraflow.streams.plane import Plane
from astraflow.weights.engine_held import FetchReport
from astraflow.weights.image import HeldImage

log = logging.getLogger(__name__)


class StagedInstall:
    """What the worker's ``HeldImage`` installs into: the names the next install writes (None: every tensor) and the
    version they make. Nothing is written here; ``take`` hands them to the engine between decoding steps."""

    def __init__(self) -> None:
        self.version = -1
        self.names: set[str] | None = set()

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.names, self.version = None, version

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if self.names is not None:
            self.names |= set(tensors)
        self.version = version


class WorkerWeights:
    """The weights one engine worker holds and fetches (module doc). ``worker_id``: its connections' name."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.stats: Counter[str] = Counter()
        self.staged = StagedInstall()
        self.installed = -1  # the version the engine's parameters hold
        self.held: HeldImage | None = None  # made with the first source
        self._source: ObjectSource | None = None
        self._plane: Plane | None = None
        self._job: Future[FetchReport] | None = None
        self._jobs = 0
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="astraflow-weights", daemon=True).start()

    def begin(self, source: ObjectSource, chain: list[WeightVersion]) -> int:
        """Start fetching ``chain`` (oldest first) onto the image; the job's number, for ``poll``."""
        if self._job is not None and not self._job.done():
            raise RuntimeError("a fetch is still running in this worker")
        self._jobs += 1
        self._job = asyncio.run_coroutine_threadsafe(self._fetch(source, chain), self._loop)
        return self._jobs

    def poll(self, job: int) -> FetchReport | None:
        """The report of fetch ``job`` (None while it runs)."""
        if job != self._jobs or self._job is None:
            raise RuntimeError(f"no fetch {job} in this worker (the last was {self._jobs})")
        return self._job.result() if self._job.done() else None

    def take(self) -> tuple[int, set[str], dict[str, torch.Tensor]] | None:
        """The staged version, the names it changed since the last install (every name after a keyframe) and the image
        to write them from, taken: None when nothing waits, or the image was dropped since (the next chain starts from a
        keyframe then)."""
        if self._job is not None and not self._job.done():
            raise RuntimeError("a fetch is still running in this worker: the image is not settled")
        held, staged = self.held, self.staged
        if held is None or held.image is None or staged.version < 0 or staged.version == self.installed:
            return None
        if held.version != staged.version:
            raise RuntimeError(f"the worker holds v{held.version}, staged v{staged.version}: a fetch ran past its install")
        names = set(held.image) if staged.names is None else staged.names
        staged.names = set()
        self.installed = staged.version
        return staged.version, names, held.image

    def close(self) -> None:
        if self._plane is not None:
            asyncio.run_coroutine_threadsafe(self._plane.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _fetch(self, source: ObjectSource, chain: list[WeightVersion]) -> FetchReport:
        before = Counter(self.stats)
        error = None
        try:
            held = await self._held(source)
            await held.apply_chain(chain)
        except Exception as e:  # the node plans again from what the report says is held
            error = f"{type(e).__name__}: {e}"
        image = self.held
        return FetchReport(held_version=image.version if image is not None and image.image is not None else -1,
                           held_digest=image.digest if image is not None else None, staged=self.staged.version,
                           stats={k: v - before[k] for k, v in self.stats.items() if v != before[k]}, error=error)

    async def _held(self, source: ObjectSource) -> HeldImage:
        """The image, reading from ``source`` (connected once; again when the node names another source)."""
        if self._plane is None or source != self._source:
            if self._plane is not None:
                await self._plane.close()
            self._plane, objects = await source.open(self.worker_id)
            self._source = source
            log.info("%s reads weight versions from %s itself (%s)", self.worker_id, source.nats.redacted(), objects.stream)
            if self.held is None:
                self.held = HeldImage(self.staged, objects, self.stats)
            self.held.objects = objects
        assert self.held is not None
        return self.held


def whole_layers(changed: set[str], names: Iterable[str], packed: Mapping[str, list[str]]) -> list[str]:
    """Every name of ``names`` in a layer that holds a ``changed`` one, sorted: an engine that fuses checkpoint tensors
    into one layer (``packed``: ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``, vLLM's ``packed_modules_mapping``)
    rebuilds a layer from all of its parts, so a change to ``q_proj.weight`` rewrites ``k_proj`` and ``v_proj`` too."""
    part_of = {part: whole for whole, parts in packed.items() for part in parts}

    def layer(name: str) -> str:
        *path, _param = name.split(".")
        if path:
            path[-1] = part_of.get(path[-1], path[-1])
        return ".".join(path)

    layers = {layer(n) for n in changed}
    return sorted(n for n in names if layer(n) in layers)
