"""RaaS side of the weight plane: follow a policy's announcements and keep an engine current.

A delta is applied only onto exactly its base: the node's image must be ``base_version`` *and*
hash to ``base_digest`` (checked, never assumed), and the result must hash to the announced
``state_digest``. The plan to reach a version walks its base links back until it meets the
state the node holds, or a keyframe. So:

* a node that holds the base applies the deltas after it;
* a late joiner, a node whose state is not the base (another digest, a missed version) rebuilds
  from the latest keyframe and the deltas after it, read from the announcement stream's
  history (``joins`` / ``fallbacks``);
* a missing or corrupt chunk is never applied: the object is fetched once more
  (``refetches``), then the node falls back to the keyframe chain (``fallbacks``); if that
  fails too it keeps the weights it has, counts a ``failures``, logs why and asks the trainer
  for a keyframe (``keyframe_requests``).

Payloads are applied while they are fetched: each chunk is fed to a ``KeyframeDecoder`` (fresh
tensors) or a ``DeltaApplier`` (in place on the image, each tensor's section checked whole before
it is written) once its sha256 checks, the last chunk once the whole payload's does. A delta that
fails after its first chunk was fed (a chunk missing or corrupt midway, a section the codec
refuses) may have changed part of the image: the image is dropped rather than fetched again, the
engine keeps the last verified version (it is only installed from an image whose state digest
checked), and the node rebuilds from the keyframe chain as above.

Installing into the engine: a keyframe goes through ``load_state``; a delta chain writes only
the tensors it changed — through ``load_tensors`` where an engine has it (none shipped does: the
sglang engine takes the whole image through ``load_state``, staged as a model directory;
docs/weights.md), else in place through
``load_state`` with the engine's own tensors standing in for the unchanged ones (hf: no model
reload, the engine's lock held). An engine that fetches its own weights (vLLM's worker: ``fetch_chain``) holds the image
in its worker, with the same checks there; the node plans from what it reports (``weights/engine_held.py``).

An announcement that is impossible on its face (``weights/checks.py``: another policy, a base
that is not older, a keyframe version past the version, object sizes and digest counts that do
not match, a version not above the newest seen) is never planned from: from the live follower it
goes to the DLQ (``dlq.weights``) with the reason (``rejected``), from the history it is skipped
(``skipped_history``). From the history a chain is planned by (version, digest) keys, so only
through base digests that name them; picking a version by its number (``goto``) takes the first
announcement of it a node would have followed (``in_order``), never a later copy.

A LoRA version (``adapter`` in its announcement) is planned, fetched and checked like any other: its state is the
adapters. Installing it merges them into a copy of the base (``weights/adapters.py``) unless the target takes adapters
itself (``load_adapter(adapters, version, spec)``: the trainer's resume). Before its chain is fetched the node checks that
it holds that base, or fetches the base the version names; a version over a base it can neither hold nor fetch is refused
with the reason (``base_refused``), without asking for a keyframe, which would not help.

A node in a region reads the mirrors in its leaf's JetStream domain (``domain=``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping

from astraflow.streams.messages import WeightVersion
from astraflow.streams.object_source import ObjectSource
from astraflow.streams.objects import ObjectError
from astraflow.streams.plane import Plane
from astraflow.streams.weight_channel import WeightChannel
from astraflow.weights.adapters import AdapterError
from astraflow.weights.checks import announcement_problem, in_order, order_problem
from astraflow.weights.delta import DeltaError
from astraflow.weights.engine_held import holder_for
from astraflow.weights.image import WeightSyncError, WeightTarget
from astraflow.weights.publish import request_keyframe
from astraflow.weights.retention import Key, base_key, key_of

log = logging.getLogger(__name__)
KNOWN = 256  # announcements kept in memory for planning


class VersionGone(WeightSyncError):
    """A version the announcement stream no longer holds the way to: it, or the keyframe its chain starts from, is older
    than every announcement the stream keeps (``plane.weights_history`` per policy). No retry brings it back."""


class WeightSync:
    """Keeps ``engine`` at the newest announced version of ``policy``.

    ``domain``: the JetStream domain to read weights from (a region's leaf, where
    ``ensure_region_mirrors`` made the mirrors); the stream names default to the hub's, which
    the mirrors share. ``mirror_wait``: how long a chunk may lag its announcement (a mirror's
    two streams catch up independently); 0 on the hub, where chunks land before the commit.
    """

    def __init__(self, plane: Plane, policy: str, engine: WeightTarget, object_stream_name: str | None = None,
                 weights_stream_name: str | None = None, *, domain: str | None = None, mirror_wait: float | None = None,
                 request_keyframes: bool = True) -> None:
        self.plane = plane
        self.policy = policy
        self.engine = engine
        self.domain = domain
        self.announcements = WeightChannel(plane, policy, weights_stream_name, domain)
        wait = (10.0 if domain else 0.0) if mirror_wait is None else mirror_wait
        self.objects = plane.objects(domain=domain, stream=object_stream_name, wait_missing=wait)
        self.request_keyframes = request_keyframes
        self.stats: Counter[str] = Counter()
        source = ObjectSource.of(plane, domain, object_stream_name, wait)
        self.held = holder_for(engine, source, self.objects, self.stats)  # the verified version it holds, its way into the engine
        self.last_error = ""
        self.known: dict[Key, WeightVersion] = {}
        self._followed: list[WeightVersion] = []  # the history's announcements a node would have followed (goto picks by number from these)
        self.newest: WeightVersion | None = None  # the newest valid announcement the follower passed
        self._follower = self.announcements.follower(on_bad=self._bad, check=self._vet)

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def following(self) -> bool:
        """Announcements are pushed to this process as they are made: ``refresh(wait=0)`` asks the server nothing
        unless one came."""
        return self._follower.following

    async def arrival(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for an announcement; True if one came (``refresh`` applies it)."""
        return await self._follower.arrival(timeout)

    # ------------------------------------------------------------------ public
    async def refresh(self, wait: float = 0.05) -> bool:
        """Apply whatever was announced since the last call (waiting up to ``wait`` s for it when nothing was); True if
        the version changed."""
        anns = await self._follower.fetch(wait)
        for a in anns:
            self.known[key_of(a)] = a
        if len(self.known) > 4 * KNOWN:  # keep the newest announcements: older chains come from the history
            self.known = dict(sorted(self.known.items())[-KNOWN:])
        newer = [a for a in anns if a.version > self.version]
        if not newer:
            return False
        before = self.version
        await self._reach(max(newer, key=lambda a: (a.version, a.created_at)))
        return self.version != before

    async def wait_for(self, min_version: int, timeout: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.version < min_version:
            if loop.time() > deadline:
                why = f" (last error: {self.last_error})" if self.last_error else ""
                raise TimeoutError(f"no weights >= v{min_version} for {self.policy} after {timeout:.0f}s{why}")
            await self.refresh(wait=1.0)

    async def goto(self, version: int) -> None:
        """Bring the engine to exactly ``version`` (evaluators step through chosen versions)."""
        if version == self.version:
            return
        history = await self._history()
        found = [a for a in self._followed if a.version == version]  # a later copy of a past version never stands in for it
        oldest = min((a.version for a in self._followed), default=version)
        if not found:
            if version < oldest:
                raise VersionGone(f"v{version} of {self.policy} is gone from {self.announcements.where}, which keeps v{oldest} and later")
            raise WeightSyncError(f"v{version} of {self.policy} was never announced or is gone from {self.announcements.where}")
        if not await self._reach(found[0], history, ask=False):
            if found[0].keyframe_version < oldest:  # the chain's start is trimmed: no read of the history will have it again
                raise VersionGone(f"v{version} of {self.policy} builds on keyframe v{found[0].keyframe_version}, gone from "
                                  f"{self.announcements.where} (it keeps v{oldest} and later): {self.last_error}")
            raise WeightSyncError(f"could not reach v{version} of {self.policy}: {self.last_error}")

    async def request_keyframe(self, reason: str) -> None:
        self.stats["keyframe_requests"] += 1
        try:
            await request_keyframe(self.plane, self.policy, reason)
        except Exception as e:  # the request is a courtesy: the node keeps its weights either way
            log.warning("weights %s: keyframe request failed: %s", self.policy, e)

    # ------------------------------------------------------------------ planning
    def _bad(self, subject: str, reason: str) -> None:
        self.stats["rejected"] += 1
        log.warning("weights %s: announcement on %s turned away: %s", self.policy, subject, reason)

    def _vet(self, ann: WeightVersion) -> str | None:
        """The live follower's check, in stream order: a reason to dead-letter ``ann``, or None."""
        problem = announcement_problem(ann, self.policy) or order_problem(ann, self.newest)
        if problem is None and (self.newest is None or ann.version > self.newest.version):
            self.newest = ann
        return problem

    async def _history(self) -> dict[Key, WeightVersion]:
        """Every announcement possible on its face, by (version, state digest). A chain is planned by these keys, so
        an announcement is only ever reached through a base digest that names it, and every state is checked
        against its digest when applied; a restarted trainer's own v2 (another state under a number already
        used) stays reachable for the deltas built on it. Picking a version by its number is ``goto``'s job."""
        anns = await self.announcements.history(on_bad=self._bad)
        valid = [a for a in anns if announcement_problem(a, self.policy) is None]
        if len(valid) < len(anns):
            self.stats["skipped_history"] += len(anns) - len(valid)
        self._followed = in_order(valid, self.policy)
        history = {key_of(a): a for a in valid}
        self.known.update(history)
        return history

    async def _reach(self, target: WeightVersion, history: dict[Key, WeightVersion] | None = None, ask: bool = True) -> bool:
        """Bring the node to ``target``; False (weights unchanged; a keyframe requested if ``ask``) if it cannot."""
        if (refused := await self.held.hold_base(target)) is not None:
            self.stats["base_refused"] += 1
            self.last_error = f"v{target.version}: {refused}"
            log.error("weights %s: v%d refused: %s; keeping v%d", self.policy, target.version, refused, self.version)
            return False
        holding = self.held.holding
        try:
            chain = plan_chain(target, self.known, self.held.key())
            if chain is None:
                history = history if history is not None else await self._history()
                chain = plan_chain(target, history, self.held.key())
            if chain is None:
                raise WeightSyncError(
                    f"chain of v{target.version} is incomplete in {self.announcements.where} (keyframe v{target.keyframe_version} gone?)"
                )
            if not holding:
                self.stats["joins"] += 1  # a late joiner: the keyframe and the deltas after it
            elif chain and chain[0].encoding == "keyframe" and chain[0].version <= self.held.version < target.version:
                self.stats["fallbacks"] += 1  # our state is not a base of the target: rebuild
                log.warning(
                    "weights %s: v%d is not a base of v%d; rebuilding from keyframe v%d",
                    self.policy,
                    self.held.version,
                    target.version,
                    chain[0].version,
                )
            await self.held.apply_chain(chain)
            return True
        except Exception as first:
            self.stats["fallbacks"] += 1
            log.warning(
                "weights %s v%d: %s: %s; rebuilding from the keyframe chain", self.policy, target.version, type(first).__name__, first
            )
        try:
            chain = plan_chain(target, await self._history(), None)
            if chain is None:
                raise WeightSyncError(f"keyframe chain of v{target.version} is incomplete in {self.announcements.where}")
            await self.held.apply_chain(chain)
            return True
        except Exception as second:
            if not isinstance(second, (ObjectError, DeltaError, WeightSyncError, AdapterError)):
                log.exception("weights %s: unexpected error reaching v%d", self.policy, target.version)
            self.stats["failures"] += 1
            self.last_error = f"v{target.version}: {second}"
            log.error(
                "weights %s: cannot reach v%d (%s); keeping v%d, asking for a keyframe", self.policy, target.version, second, self.version
            )
            if ask and self.request_keyframes:
                await self.request_keyframe(f"{self.plane.worker_id} cannot reach v{target.version}: {second}")
            return False

def plan_chain(target: WeightVersion, index: Mapping[Key, WeightVersion], held: Key | None) -> list[WeightVersion] | None:
    """Announcements to apply to reach ``target``, oldest first: back along base links to the state ``held`` (None:
    none to start from) or to a keyframe; None if a link is not in ``index``."""
    if held == key_of(target):
        return []
    chain = [index.get(key_of(target), target)]  # a state announced again (as a keyframe): its latest announcement
    while chain[-1].encoding == "delta":
        base = base_key(chain[-1])
        if base is not None and base == held:
            break
        nxt = index.get(base) if base is not None else None
        if nxt is None or len(chain) > len(index):
            return None
        chain.append(nxt)
    return chain[::-1]
