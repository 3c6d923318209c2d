"""Trainer side of the weight plane: publish version v as a keyframe or a delta from v-1.

The trainer keeps the bf16 image of the last published version. Version v goes out as a delta
against it, except

* at start (no image yet) and when the image is not v-1;
* every ``keyframe_every`` versions;
* on request: a RaaS node or an operator puts ``keyframe_request.{policy}`` in the run KV
  (:func:`request_keyframe`); the next version after a new request is a keyframe;
* whenever the delta would exceed ``max_delta_fraction`` of the full bf16 payload.

The payload is encoded while it is written: the encoder's pieces go to the object store as they
come (``ObjectStore.put`` takes an iterable), so publishing starts after the first section and
the payload is never whole in memory. A delta is written until it passes the fraction; then its
chunks are purged and a keyframe is written instead.

Weights that are not finite are never published (:class:`NonFiniteWeights`, before anything is
written). The payload is written to the object store first (chunks, each with a sha256); the
announcement (base version and digest, object refs with sizes and digests, the state digest)
is published last and is the commit point; if it fails, the new chunks are purged. ``publish`` is
``store`` (everything before the commit point) then ``announce`` (the commit point and what follows
it), apart so that a caller can act between them (the trainer's ``before_announce`` crash point). Each
announcement expects to follow the publisher's previous one on the subject (the server checks
it): if another trainer of the policy announced in between, this one's publish fails
(``PublishConflict``) instead of putting a second state under a version number. What else a
writer the permissions let through put on the subject (an announcement impossible on its face, or
not newer than this publisher's last: ``checks.foreign_harmless``, which every node turns away)
is stepped over, so it cannot stop the trainer. Then, in a
background task (one at a time), the retention plan deletes what the last ``keep_versions``
versions no longer need, from the bucket and from every region mirror in ``mirror_domains``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

from astraflow.streams.messages import AdapterSpec, ObjectRef, Suspect, WeightVersion
from astraflow.streams.objects import WriteInterrupted
from astraflow.streams.plane import Plane, PublishConflict, PublishRefused
from astraflow.streams.retry import MAX_PAUSE_S, PATIENCE_S, PAUSE_S, UNANSWERED
from astraflow.streams.state import KeyframeRequest, VersionRecord
from astraflow.streams.weight_channel import WeightChannel
from astraflow.weights.checks import foreign_harmless
from astraflow.weights.delta import iter_encode_delta, iter_encode_keyframe, state_digest, to_bf16_state
from astraflow.weights.finite import FiniteState, non_finite
from astraflow.weights.keeper import PayloadKeeper, base_name, payload_name
from astraflow.weights.retention import key_of

log = logging.getLogger(__name__)
T = TypeVar("T")
Encoding = Literal["keyframe", "delta"]
WRITE_ATTEMPTS = 3  # writes of one version a lost connection may interrupt before the store gives up
STEP_OVERS = 8  # refused publishes in a row before a foreign writer counts as another trainer anyway


class NonFiniteWeights(ValueError):
    """A state holding NaN or infinite values: never announced."""


@dataclass(frozen=True)
class Stored:
    """A version whose payload is in the object store, not yet announced (:meth:`WeightPublisher.store`)."""

    ann: WeightVersion  # the announcement to publish: objects, digests, base
    image: dict[str, torch.Tensor]  # its bf16 state: the base of the next delta once announced
    request_rev: int  # the keyframe request revision it read
    why: str  # why this encoding (logged)


class DeltaTooLarge(RuntimeError):
    """A delta grew past its limit while it was encoded: a keyframe goes out instead."""


def capped(pieces: Iterator[bytes], limit: int) -> Generator[bytes, None, None]:
    """``pieces`` passed on until their total would exceed ``limit`` bytes: then :class:`DeltaTooLarge`."""
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > limit:
            raise DeltaTooLarge(f"{total} B, over {limit} B")
        yield piece


async def request_keyframe(plane: Plane, policy: str, reason: str = "") -> None:
    """Ask the trainer of ``policy`` to make its next version a keyframe (from any region: the
    run state is written through the plane's JetStream domain, so a node on a leaf reaches the hub)."""
    await plane.state.put(KeyframeRequest(policy=policy, by=plane.worker_id, reason=reason[:500]))


async def written(write: Callable[[], Awaitable[T]], what: str, patience: float = PATIENCE_S) -> T:
    """``write()``, done again when the server's restart interrupted it (at once, up to ``WRITE_ATTEMPTS`` in all), or
    when the plane did not answer it (a cluster electing the bucket's leader after a member was killed: for up to
    ``patience`` seconds, pausing between). Each attempt writes under a fresh object id; a failed one's chunks are
    purged, and the next one's metadata replaces any it left."""
    loop = asyncio.get_running_loop()
    deadline, pause, interrupted = loop.time() + patience, PAUSE_S, 0
    while True:
        try:
            return await write()
        except WriteInterrupted as e:
            interrupted += 1
            if interrupted >= WRITE_ATTEMPTS:
                raise
            log.warning("%s: %s; writing it again", what, e)
        except UNANSWERED as e:
            if loop.time() + pause > deadline:
                raise
            log.warning("%s: no answer (%s); writing it again in %.2fs", what, type(e).__name__, pause)
            await asyncio.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)


def keyframe_reason(image_version: int | None, version: int, forced: bool, keyframe_every: int) -> str | None:
    """Why ``version`` must be a keyframe, or None (a delta from the image, which is ``image_version``; None: no image)."""
    if image_version is None:
        return "start"
    if image_version != version - 1:
        return f"image is v{image_version}, not v{version - 1}"
    if forced:
        return "forced"
    if version % keyframe_every == 0:
        return f"every {keyframe_every}"
    return None


def harmless_tail(anns: list[WeightVersion], own: tuple[int | None, str | None], policy: str, mine: int) -> list[WeightVersion] | None:
    """The announcements after the newest one keyed ``own`` (all of them if none is), if no trainer could have made
    any of them (``foreign_harmless``: a publisher at ``mine`` may step over them); None if one could."""
    at = next((i for i in range(len(anns) - 1, -1, -1) if key_of(anns[i]) == own), -1)
    after = anns[at + 1:]
    return after if all(foreign_harmless(a, policy, mine) for a in after) else None


class WeightPublisher:
    """Publishes a policy's versions. ``keep_versions``: how many newest versions stay
    reconstructible (None keeps everything); ``mirror_domains``: JetStream domains of region
    leaves whose mirrors get the same deletions."""

    def __init__(self, plane: Plane, policy: str, keyframe_every: int = 10, max_delta_fraction: float = 0.5,
                 keep_versions: int | None = 64, mirror_domains: tuple[str, ...] = ()) -> None:
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
        if keep_versions is not None and keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1 or None (keep all), got {keep_versions}")
        self.plane = plane
        self.policy = policy
        self.keyframe_every = keyframe_every
        self.max_delta_fraction = max_delta_fraction
        self.keeper = PayloadKeeper(plane, policy, keep_versions, tuple(mirror_domains))  # what is stored, what goes
        self.announcements = WeightChannel(plane, policy)
        self.image: dict[str, torch.Tensor] | None = None
        self.image_digest: str | None = None
        self.image_version: int | None = None
        self.keyframe_version = -1
        self.lineage = ""  # the weight lineage announced with every version (set by the trainer's start)
        self.adapter: AdapterSpec | None = None  # versions are LoRA adapters over this base (:meth:`adapt`); None: full weights
        self.bytes_sent = 0
        self._request_rev = 0  # KV revision of the last keyframe request served
        self._last: int | None = None  # the position of the policy's newest announcement, as this publisher knows it

    def follows(self, position: int) -> None:
        """The announcement this publisher's next version follows is at ``position`` of the policy's announcements (0:
        none yet): the server refuses the next announcement if anything else was announced on the subject since."""
        self._last = position

    async def adapt(self, base: Mapping[str, torch.Tensor], scale: float, built_digest: str | None,
                    history: Iterable[WeightVersion] = ()) -> AdapterSpec:
        """Announce LoRA adapters over ``base`` (bf16), scale ``scale``, from now on. The base is stored in the object store
        (:func:`base_name`, once: a copy an earlier trainer of the run announced is reused) unless every node builds it
        itself: its digest is ``built_digest``, the model the recipe builds (None: unknown, stored)."""
        digest = await asyncio.to_thread(state_digest, base)
        ref = None
        if digest != built_digest:
            ref = next((a.adapter.base for a in reversed(list(history))
                        if a.adapter is not None and a.adapter.base is not None and a.adapter.base_digest == digest), None)
            if ref is None:
                ref = await self.plane.objects().put(base_name(self.policy, digest), iter_encode_keyframe(base), self.policy)
                self.bytes_sent += ref.size
        self.adapter = AdapterSpec(base_digest=digest, scale=scale, base=ref)
        return self.adapter

    # ------------------------------------------------------------------ decisions
    async def _put(self, new: dict[str, torch.Tensor], version: int, force_keyframe: bool,
                   digest: asyncio.Future[str]) -> tuple[Encoding, ObjectRef, str]:
        """Encode ``new`` while writing it to the object store; (encoding, ref, why). A delta that grows past
        ``max_delta_fraction`` of the full bf16 bytes is dropped as soon as it does (its chunks purged) and
        a keyframe goes out instead."""
        objects = self.plane.objects()

        async def name(encoding: Encoding) -> str:
            return payload_name(self.policy, version, await digest, encoding)

        why = keyframe_reason(None if self.image is None else self.image_version, version, force_keyframe, self.keyframe_every)
        if why is None:
            assert self.image is not None
            full_bytes = sum(t.numel() * t.element_size() for t in new.values())
            encoder = iter_encode_delta(self.image, new)
            try:
                capped_delta = capped(encoder, int(self.max_delta_fraction * full_bytes))
                return "delta", await objects.put(name("delta"), capped_delta, self.policy), "delta"
            except DeltaTooLarge:
                why = f"delta over {self.max_delta_fraction:g} x {full_bytes} B"
            finally:
                await asyncio.to_thread(encoder.close)  # a dropped encoder's threads stop here
        return "keyframe", await objects.put(name("keyframe"), iter_encode_keyframe(new), self.policy), why

    # ------------------------------------------------------------------ publish
    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, batch_ids: list[str] | None = None,
        metrics: dict[str, float] | None = None, force_keyframe: bool = False,
    ) -> WeightVersion:
        """Store ``state`` as ``version``, then announce it (:meth:`store`, :meth:`announce`)."""
        return await self.announce(await self.store(state, version, batch_ids, metrics, force_keyframe))

    async def store(
        self, state: Mapping[str, torch.Tensor], version: int, batch_ids: list[str] | None = None,
        metrics: dict[str, float] | None = None, force_keyframe: bool = False, copy: bool = True,
        suspects: list[Suspect] | None = None,
    ) -> Stored:
        """Everything before the commit point: a bf16 copy of ``state``, checked finite, its digest, the payload encoded
        and written. Nothing is announced: :meth:`announce` it next, before anything else is stored (its delta's base is
        the image of the last announcement). ``copy=False``: ``state`` is already a bf16 image that nothing changes any
        more (the trainer's image of a version), taken as it is; it is still checked finite, unless it is a
        :class:`~astraflow.weights.finite.FiniteState` (found finite as it was taken). ``suspects``: what the step's
        token check left out, announced with it."""
        if not self.keeper.seeded:
            await self.keeper.seed()
        asking = asyncio.ensure_future(self.plane.state.revision(KeyframeRequest, self.policy))  # beside the copy and check
        new = await asyncio.to_thread(to_bf16_state, state) if copy else dict(state)
        bad = [] if isinstance(state, FiniteState) and not copy else await asyncio.to_thread(non_finite, new)
        request_rev = await asking  # a failed read raises
        if bad:
            raise NonFiniteWeights(f"weights {self.policy} v{version}: {len(bad)} tensors hold NaN or inf ({', '.join(bad[:3])}); "
                                   "not published")
        requested = request_rev > self._request_rev
        digesting = asyncio.ensure_future(asyncio.to_thread(state_digest, new))  # releases the GIL: overlaps the encoding
        try:
            encoding, ref, why = await written(lambda: self._put(new, version, force_keyframe or requested, digesting),
                                               f"weights {self.policy} v{version}")
        finally:
            await asyncio.gather(digesting, return_exceptions=True)
        digest = digesting.result()
        if requested and why == "forced" and not force_keyframe:
            why = "requested"
        is_key = encoding == "keyframe"
        ann = WeightVersion(
            policy=self.policy, version=version, encoding=encoding,
            base_version=None if is_key else self.image_version,
            base_digest=None if is_key else self.image_digest,
            state_digest=digest, keyframe_version=version if is_key else self.keyframe_version, objects=[ref],
            batch_ids=list(batch_ids or []), metrics=dict(metrics or {}), suspects=list(suspects or []), lineage=self.lineage,
            adapter=self.adapter,
        )
        return Stored(ann, new, request_rev, why)

    async def answer_keyframe_request(self) -> WeightVersion | None:
        """A keyframe request made since the last one served, answered now: the current version announced again as a
        keyframe (same number, same state; nothing is trained for it). A trainer calls this while it waits for batches,
        since the next version, which would serve the request, may never come: when every node has lost its chain (a
        payload gone), no node can serve a task and no batch ever arrives. None: nothing to answer."""
        if self.image is None or self.image_version is None or self.image_digest is None:
            return None
        if await self.plane.state.revision(KeyframeRequest, self.policy) <= self._request_rev:
            return None
        first = self.keeper.history.get((self.image_version, self.image_digest))
        stored = await self.store(self.image, self.image_version, list(first.batch_ids) if first else [],
                                  dict(first.metrics) if first else {}, force_keyframe=True, copy=False)
        log.warning("weights %s: a keyframe was requested while no version is coming; v%d announced again as a keyframe",
                    self.policy, self.image_version)
        return await self.announce(stored, again=True)

    async def announce(self, stored: Stored, again: bool = False) -> WeightVersion:
        """The commit point of a stored version: its announcement, then the image it becomes, ``version.{policy}`` and a
        retention pass. An announcement the server refused purges the stored payload and raises; one whose outcome is unknown
        (a timeout, the connection lost) raises and leaves it to the next trainer's sweep (it may be named). The image stays."""
        ann, ref = stored.ann, stored.ann.objects[0]
        msg_id = f"{self.policy}-w{ann.version}-{ann.state_digest[:16]}" + (f"-k{stored.request_rev}" if again else "")
        try:  # the commit point: a retry of the same state is deduplicated by the server; another writer's is refused
            position, landed = await self._announce(ann, msg_id=msg_id)
        except PublishRefused:  # not in the stream: nothing will ever name the payload
            await asyncio.shield(self.keeper.discard(ref))
            raise
        except BaseException as e:  # a timeout, a lost connection: the announcement may have landed, naming the payload
            log.warning("weights %s v%d: the announcement's outcome is unknown (%s); its payload stays (the next trainer "
                        "sweeps it if no announcement names it)", self.policy, ann.version, type(e).__name__)
            raise
        if landed:
            self._last = position
        else:  # the server held this announcement already (a retry under the same id): it names its own payload, not ours
            await asyncio.shield(self.keeper.discard(ref))
            ann = await self.announcements.read(position)
            ref = ann.objects[0]
        if ann.encoding == "keyframe":
            self.keyframe_version = ann.version
            self._request_rev = max(self._request_rev, stored.request_rev)
        self.image, self.image_digest, self.image_version = stored.image, ann.state_digest, ann.version
        self.bytes_sent += ref.size
        self.keeper.announced(ann, landed)
        log.debug("weights %s v%d: %s (%s), %d bytes", self.policy, ann.version, ann.encoding, stored.why, ref.size)
        await self.plane.state.put(VersionRecord(policy=self.policy, version=ann.version, lineage=self.lineage))
        self.keeper.collect()  # off the training path: a slow or unreachable mirror never stalls a step
        return ann

    async def _announce(self, ann: WeightVersion, msg_id: str) -> tuple[int, bool]:
        """Publish ``ann`` right after the last announcement this publisher knows of; its position, and False when the
        server held it already (a retry under the same id: the original's position, not past the last). A refusal
        because of announcements no trainer could have made (``foreign_harmless``) is retried after them."""
        after = self._last
        if after is None:
            after = self._last = await self.announcements.last_position()
        for _ in range(STEP_OVERS):
            try:
                position = await self.announcements.announce(ann, msg_id=msg_id, after=after)
                return position, position > after
            except PublishConflict:
                past = await self._past_foreign()
                if past is None:
                    raise
                after = self._last = past
        raise PublishConflict(f"{self.announcements.subject}: still refused after stepping over foreign announcements "
                              f"{STEP_OVERS} times")

    async def _past_foreign(self) -> int | None:
        """The position of the policy's last announcement if everything after this publisher's last one is harmless
        (logged and stepped over), else None (another trainer announced)."""
        last = await self.announcements.last_position()
        anns = await self.announcements.history()  # undecodable ones are skipped (and harmless)
        mine = -1 if self.image_version is None else self.image_version
        after = harmless_tail(anns, (self.image_version, self.image_digest), self.policy, mine)
        if after is None:
            return None
        log.warning("weights %s: stepping over %d announcements no trainer could have made (after v%d)", self.policy, len(after), mine)
        return last

