"""The weights a rollout node holds: a bf16 image of one verified version, applied onto while payloads are fetched, and
installed into the engine once its state digest checks (``weights/sync.py`` decides which versions to reach; this
module reaches them). See ``sync.py`` for the guarantees: a delta only onto exactly its base, a missing or corrupt chunk
never applied, an image a failed delta may have changed dropped, and the engine kept at the last verified version.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import aclosing
from functools import partial
from typing import Any, Protocol, cast

import torch

from astraflow.streams.messages import AdapterSpec, ObjectRef, WeightVersion
from astraflow.streams.objects import CorruptObject, MissingObject, ObjectError, ObjectStore
from astraflow.weights.adapters import BaseMismatch, MergedAdapters
from astraflow.weights.delta import DeltaApplier, DeltaError, KeyframeDecoder, state_digest
from astraflow.weights.load import on_accelerator
from astraflow.weights.retention import Key

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A version cannot be reached from what the node holds and what the plane still stores."""



class Sink(Protocol):
    """What a payload is fed to while it is fetched (``DeltaApplier``, ``KeyframeDecoder``)."""

    @property
    def received(self) -> int: ...

    def feed(self, data: bytes) -> None: ...

    def close(self) -> object: ...


async def fetch_into(objects: ObjectStore, ref: ObjectRef, sink: Sink, finish: Callable[[Any], Any] = lambda r: r) -> Any:
    """Feed ``ref``'s chunks to ``sink`` while they are fetched, each once it checks (sha256, length; the last
    once the whole payload's sha256 checks too), on a worker thread while the next ones arrive; then
    ``finish(sink.close())``. The last chunk, ``close`` and ``finish`` take one thread hop together, so a
    one-chunk payload (a small model's delta) costs one hop in all."""
    last: bytes | None = None
    async with aclosing(objects.iter_chunks(ref)) as chunks:
        index = 0
        async for chunk in chunks:
            index += 1
            if index < len(ref.digests):
                await asyncio.to_thread(sink.feed, chunk)
            else:
                last = chunk

    def close() -> Any:
        if last is not None:
            sink.feed(last)
        return finish(sink.close())

    return await asyncio.to_thread(close)


class WeightTarget(Protocol):
    """What the sync needs of an engine (the rollout ``Engine`` satisfies it).

    Optional, used when present: ``load_tensors(tensors, version)`` to receive only the changed
    tensors (a hook for runtime-update APIs; no shipped engine has it yet), and ``state_view()`` (the engine's own tensors by
    name) so a delta writes only what changed (hf). Where that view's tensors are on a GPU, the image is decoded into
    pinned host memory, so installing a version copies into the engine's parameters without blocking (``load.py``).
    """

    @property
    def version(self) -> int: ...

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None: ...


def install(engine: Any, image: Mapping[str, torch.Tensor], version: int, changed: set[str] | None) -> None:
    """Put ``image`` (version ``version``) into the engine; ``changed`` None: the whole state.

    * ``load_tensors(changed, version)`` where the engine has it (a hook; no shipped engine has it yet);
    * else, when the engine's ``state_view()`` holds every tensor (hf), ``load_state`` gets the
      engine's own tensors for the unchanged names and the image's for the changed ones: copying
      a tensor onto itself is a no-op in torch, so only changed tensors are written, in place,
      under the engine's own lock (generation never sees a half-applied version);
    * else the whole image through ``load_state``.
    """
    if changed is not None and hasattr(engine, "load_tensors"):
        engine.load_tensors({n: image[n] for n in sorted(changed)}, version)
        return
    if changed is not None:
        view = engine.state_view()
        if all(n in view for n in image):
            engine.load_state({**view, **{n: image[n] for n in changed}}, version)
            return
    engine.load_state(dict(image), version)


class HeldImage:
    """The image a node holds (``image``: bf16 tensors of ``version``, hashing to ``digest``; None: none yet, or dropped),
    the adapters it is (``adapter``; None: full weights), and its way into ``engine``. ``stats``: the sync's counters."""

    def __init__(self, engine: WeightTarget, objects: ObjectStore, stats: Counter[str]) -> None:
        self.engine, self.objects, self.stats = engine, objects, stats
        self.image: dict[str, torch.Tensor] | None = None
        self.version = -1
        self.digest: str | None = None
        self.adapter: AdapterSpec | None = None  # the image is that LoRA version's adapters (None: full weights)
        self.adapters = MergedAdapters(engine)  # how the engine serves adapters, merged into a copy of its base
        view = getattr(engine, "state_view", None)  # weights on a GPU: the image in pinned memory, installed without blocking
        self.pinned = view is not None and on_accelerator(view())

    @property
    def holding(self) -> bool:
        return self.image is not None

    def key(self) -> Key | None:
        """The state held, as a chain may start from it (None: none)."""
        return (self.version, self.digest) if self.image is not None and self.digest is not None else None

    async def hold_base(self, target: WeightVersion) -> str | None:
        """Why the engine cannot serve ``target``'s adapters (None: it can): it holds their base, or fetched the base the
        version names (checked against its digest)."""
        spec = target.adapter
        if spec is None:
            return None
        try:
            if hasattr(self.engine, "load_adapter"):  # it serves adapters itself (shared_base.py), or keeps them (a trainer)
                problem = getattr(self.engine, "adapter_problem", lambda _spec: None)(spec)
                if problem is not None:
                    raise BaseMismatch(problem)
            elif await asyncio.to_thread(self.adapters.needs_base, spec):
                assert spec.base is not None
                base, digest = await fetch_into(self.objects, spec.base, KeyframeDecoder(), finish=_with_digest)
                self.adapters.take_base(base, digest, spec)
                self.stats["bases"] += 1
                self.stats["bytes"] += spec.base.size
            return None
        except (BaseMismatch, ObjectError, DeltaError) as e:
            return str(e)

    def install(self, changed: set[str] | None) -> None:
        """Put the image into the engine: full weights as they are, a LoRA version's adapters merged into a copy of the
        base (or to an engine that takes adapters itself)."""
        assert self.image is not None
        if self.adapter is None:
            install(self.engine, self.image, self.version, changed)
            if self.adapters.served or self.adapters.digest is not None:
                self.adapters = MergedAdapters(self.engine)  # the engine's weights are no base any more
        elif hasattr(self.engine, "load_adapter"):
            self.engine.load_adapter(self.image, self.version, self.adapter)
        else:
            tensors, whole = self.adapters.merged(self.image, self.adapter.scale)
            install(self.engine, tensors, self.version, None if whole else set(tensors))
            self.adapters.installed(self.image)

    def drop(self) -> None:
        """The image matches no version any more (partly changed, or not the announced state): the engine keeps the last
        verified one, and the next version comes from a keyframe chain."""
        self.image, self.digest, self.version = None, None, -1

    async def apply_chain(self, chain: list[WeightVersion]) -> None:
        """Apply ``chain`` onto the image while fetching, checking every step; install what was verified into the engine.
        A keyframe decodes into fresh tensors; a delta applies in place as its chunks arrive (:func:`feed`)."""
        changed: set[str] | None = set()
        try:
            for ann in chain:
                if ann.encoding == "keyframe":
                    _, (image, digest) = await feed(self.objects, ann, partial(KeyframeDecoder, self.pinned), False, self.stats,
                                                    self.drop, finish=_with_digest)
                    changed = None
                else:
                    if self.image is None or ann.base_version != self.version or ann.base_digest != self.digest:
                        raise WeightSyncError(f"delta v{ann.version} applies onto v{ann.base_version}, "
                                              f"the node holds v{self.version}")
                    image = self.image
                    applier, digest = await feed(self.objects, ann, partial(DeltaApplier, image), True, self.stats,
                                                 self.drop, finish=lambda _stats: state_digest(image))
                    if changed is not None:
                        changed |= cast(DeltaApplier, applier).changed
                if digest != ann.state_digest:
                    self.drop()
                    self.stats["corrupt"] += 1
                    raise WeightSyncError(f"v{ann.version}: state digest mismatch after applying")
                self.image, self.digest, self.version, self.adapter = image, digest, ann.version, ann.adapter
                self.stats[ann.encoding + "s"] += 1
                self.stats["bytes"] += ann.objects[0].size
        finally:
            if self.image is not None and self.version != self.engine.version:
                await asyncio.to_thread(self.install, changed)



async def feed(objects: ObjectStore, ann: WeightVersion, make: Callable[[], Sink], in_place: bool, stats: Counter[str],
               drop_image: Callable[[], None], finish: Callable[[Any], Any] = lambda r: r) -> tuple[Sink, Any]:
    """``ann``'s payload fed to a sink from ``make`` while it is fetched from ``objects`` (:func:`fetch_into`); (the
    sink, what its ``close`` returned).

    A missing or corrupt chunk is fetched once more into a fresh sink, unless the sink works ``in_place`` on the image
    and was fed already: the image may be partly changed then, so it is dropped (``drop_image``: it matches no version;
    the engine keeps the last verified one) and the error goes to the caller, which rebuilds from the keyframe chain.
    """
    if len(ann.objects) != 1:
        raise WeightSyncError(f"v{ann.version} names {len(ann.objects)} objects; this build reads exactly one")
    (ref,) = ann.objects
    for attempt in (1, 2):
        sink = make()
        try:
            return sink, await fetch_into(objects, ref, sink, finish)
        except BaseException as e:
            touched = in_place and sink.received > 0
            if touched:
                drop_image()
            if not isinstance(e, ObjectError):
                raise
            kind = "corrupt" if isinstance(e, CorruptObject) else "missing" if isinstance(e, MissingObject) else "object_errors"
            stats[kind] += 1
            if attempt == 2 or touched:
                raise
            stats["refetches"] += 1
            log.warning("weights %s v%d: %s; fetching again", ann.policy, ann.version, e)
    raise AssertionError("unreachable")



def _with_digest(image: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """A decoded keyframe and its state digest (the announced digest is what tells it is the version)."""
    return image, state_digest(image)
