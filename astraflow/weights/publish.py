"""Trainer side of the weight plane: publish version v as a keyframe or a delta from v-1.

The trainer keeps the bf16 image of the last published version. Version v goes out as a
delta against it, except at start, every ``keyframe_every`` versions, on request, and
whenever the delta would exceed ``max_delta_fraction`` of the keyframe. The payload is written
to the object store first; the announcement is published last and is the commit point.
"""

from __future__ import annotations

import asyncio
from typing import Mapping

import torch

from astraflow.streams.messages import WeightVersion
from astraflow.streams.objects import chunk_size_for, put_object
from astraflow.streams.plane import Plane
from astraflow.weights.delta import encode_delta, encode_keyframe, state_digest, to_bf16_state


class WeightPublisher:
    def __init__(self, plane: Plane, policy: str, keyframe_every: int = 10, max_delta_fraction: float = 0.5) -> None:
        self.plane = plane
        self.policy = policy
        self.keyframe_every = keyframe_every
        self.max_delta_fraction = max_delta_fraction
        self.image: dict[str, torch.Tensor] | None = None
        self.image_digest: str | None = None
        self.image_version: int | None = None
        self.keyframe_version = -1
        self.bytes_sent = 0

    def _encode(self, new: dict[str, torch.Tensor], version: int, force_keyframe: bool) -> tuple[str, bytes]:
        wants_key = force_keyframe or self.image is None or version % self.keyframe_every == 0 or self.image_version != version - 1
        if not wants_key:
            payload, _ = encode_delta(self.image, new)
            full_bytes = sum(t.numel() * t.element_size() for t in new.values())
            if len(payload) <= self.max_delta_fraction * full_bytes:
                return "delta", payload
        return "keyframe", encode_keyframe(new)

    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, batch_ids: list[str] | None = None,
        metrics: dict[str, float] | None = None, force_keyframe: bool = False,
    ) -> WeightVersion:
        new = to_bf16_state(state)
        encoding, payload = await asyncio.to_thread(self._encode, new, version, force_keyframe)
        digest = await asyncio.to_thread(state_digest, new)
        bucket = self.plane.names.object_bucket
        ref = await put_object(self.plane.js, bucket, f"{self.policy}/v{version}.{encoding}", payload, chunk_size_for(self.plane.max_payload))
        if encoding == "keyframe":
            self.keyframe_version = version
        ann = WeightVersion(
            policy=self.policy, version=version, encoding=encoding,
            base_version=self.image_version if encoding == "delta" else None,
            base_digest=self.image_digest if encoding == "delta" else None,
            state_digest=digest, keyframe_version=self.keyframe_version, objects=[ref],
            batch_ids=list(batch_ids or []), metrics=dict(metrics or {}),
        )
        await self.plane.publish(self.plane.names.weights(self.policy), ann, msg_id=f"{self.policy}-w{version}")
        await self.plane.state_put(f"version.{self.policy}", version)
        self.image, self.image_digest, self.image_version = new, digest, version
        self.bytes_sent += len(payload)
        return ann
