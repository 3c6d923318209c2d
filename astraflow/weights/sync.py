"""RaaS side of the weight plane: follow a policy's announcements and keep an engine current.

A delta is applied only onto exactly its base: the node's version must equal ``base_version``
and its state digest ``base_digest`` (checked, never assumed), and the result must hash to the
announced ``state_digest``. Otherwise — a late joiner, a missed version, a corrupt or missing
chunk after one retry — the node rebuilds from the latest keyframe and the deltas after it,
read from the weights stream's history. A corrupt payload is never applied.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Mapping, Protocol

import torch
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api

from astraflow.streams.codec import DecodeError, decode
from astraflow.streams.messages import WeightVersion
from astraflow.streams.objects import ObjectError, get_object, object_stream
from astraflow.streams.plane import Plane
from astraflow.weights.delta import DeltaError, apply_delta, decode_keyframe, state_digest

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    pass


class WeightTarget(Protocol):
    """What the sync needs of an engine (the rollout ``Engine`` satisfies it)."""

    @property
    def version(self) -> int: ...

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None: ...


class WeightSync:
    def __init__(self, plane: Plane, policy: str, engine: WeightTarget, object_stream_name: str | None = None, weights_stream_name: str | None = None) -> None:
        self.plane = plane
        self.policy = policy
        self.engine = engine
        self.bucket = plane.names.object_bucket
        self.obj_stream = object_stream_name or object_stream(self.bucket)
        self.ann_stream = weights_stream_name or plane.names.weights_stream
        self.image: dict[str, torch.Tensor] | None = None
        self.digest: str | None = None
        self.stats: Counter[str] = Counter()
        self._sub: Any = None

    @property
    def version(self) -> int:
        return self.engine.version

    async def _consumer(self, deliver: api.DeliverPolicy) -> Any:
        cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=deliver, inactive_threshold=60.0, mem_storage=True, num_replicas=1)
        return await self.plane.js.pull_subscribe(self.plane.names.weights(self.policy), stream=self.ann_stream, config=cfg)

    async def _drain(self, sub: Any, timeout: float) -> list[WeightVersion]:
        out: list[WeightVersion] = []
        while True:
            try:
                msgs = await sub.fetch(batch=64, timeout=timeout if not out else 0.05)
            except (NatsTimeout, asyncio.TimeoutError):
                return out
            for m in msgs:
                try:
                    out.append(decode(m.data, WeightVersion))
                except DecodeError as e:
                    await self.plane.reject(m.subject, m.data, str(e), m.headers)

    async def refresh(self, wait: float = 0.05) -> bool:
        """Apply whatever was announced since the last call; True if the version changed."""
        if self._sub is None:
            self._sub = await self._consumer(api.DeliverPolicy.LAST)
        anns = [a for a in await self._drain(self._sub, wait) if a.version > self.version]
        if not anns:
            return False
        anns.sort(key=lambda a: a.version)
        before = self.version
        try:
            await self._apply_chain(self._plan(anns))
        except (ObjectError, DeltaError, WeightSyncError) as e:
            self.stats["fallbacks"] += 1
            log.warning("weights %s: %s; rebuilding from the latest keyframe", self.policy, e)
            await self._apply_chain(await self._history_chain(anns[-1]))
        return self.version != before

    async def wait_for(self, min_version: int, timeout: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.version < min_version:
            if loop.time() > deadline:
                raise TimeoutError(f"no weights >= v{min_version} for {self.policy} after {timeout:.0f}s")
            await self.refresh(wait=1.0)

    async def goto(self, version: int) -> None:
        """Bring the engine to exactly ``version`` (evaluators step through chosen versions)."""
        if version == self.version:
            return
        history = await self._history()
        if version not in history:
            raise WeightSyncError(f"v{version} of {self.policy} was never announced or is gone")
        if self.version < version and all(v in history and history[v].encoding == "delta" for v in range(self.version + 1, version + 1)):
            chain = [history[v] for v in range(self.version + 1, version + 1)]
            try:
                return await self._apply_chain(chain)
            except (ObjectError, DeltaError, WeightSyncError):
                self.stats["fallbacks"] += 1
        await self._apply_chain(await self._history_chain(history[version], history))

    async def _history(self) -> dict[int, WeightVersion]:
        sub = await self._consumer(api.DeliverPolicy.ALL)
        try:
            return {a.version: a for a in await self._drain(sub, 2.0)}
        finally:
            await sub.unsubscribe()

    def _plan(self, anns: list[WeightVersion]) -> list[WeightVersion]:
        """The announcements to apply in order: from the last keyframe, or a delta chain from our version."""
        keys = [i for i, a in enumerate(anns) if a.encoding == "keyframe"]
        chain = anns[keys[-1] :] if keys else anns
        for prev, a in zip([None, *chain], chain):
            if a.encoding == "delta" and prev is not None and a.base_version != prev.version:
                raise WeightSyncError(f"gap before v{a.version}")
        if chain[0].encoding == "delta" and chain[0].base_version != self.version:
            raise WeightSyncError(f"v{chain[0].version} is a delta from v{chain[0].base_version}, node holds v{self.version}")
        return chain

    async def _history_chain(self, target: WeightVersion, history: dict[int, WeightVersion] | None = None) -> list[WeightVersion]:
        history = dict(history or await self._history())
        history[target.version] = target
        key = history.get(target.keyframe_version)
        if key is None or key.encoding != "keyframe":
            raise WeightSyncError(f"keyframe v{target.keyframe_version} of {self.policy} is gone from the weights stream")
        chain = [key] + [history[v] for v in range(key.version + 1, target.version + 1) if v in history]
        if [a.version for a in chain] != list(range(key.version, target.version + 1)):
            raise WeightSyncError(f"history of {self.policy} misses versions between v{key.version} and v{target.version}")
        return chain

    async def _payload(self, ann: WeightVersion) -> bytes:
        (ref,) = ann.objects
        try:
            return bytes(await get_object(self.plane.js, self.bucket, ref, stream=self.obj_stream))
        except ObjectError as e:
            self.stats["refetches"] += 1
            log.warning("weights %s v%d: %s; fetching again", self.policy, ann.version, e)
            try:
                return bytes(await get_object(self.plane.js, self.bucket, ref, stream=self.obj_stream))
            except ObjectError:
                self.stats["corrupt"] += 1
                raise

    async def _apply_chain(self, chain: list[WeightVersion]) -> None:
        for ann in chain:
            payload = await self._payload(ann)
            if ann.encoding == "keyframe":
                image = await asyncio.to_thread(decode_keyframe, payload)
            else:
                if self.image is None or ann.base_version != self.version or ann.base_digest != self.digest:
                    raise WeightSyncError(f"delta v{ann.version} does not apply onto v{self.version}")
                image = self.image
                await asyncio.to_thread(apply_delta, image, payload)
            digest = await asyncio.to_thread(state_digest, image)
            if digest != ann.state_digest:
                self.image, self.digest = None, None  # our image no longer matches any version
                self.stats["corrupt"] += 1
                raise WeightSyncError(f"v{ann.version}: state digest mismatch after applying")
            self.engine.load_state(image, ann.version)
            self.image, self.digest = image, digest
            self.stats[ann.encoding + "s"] += 1
