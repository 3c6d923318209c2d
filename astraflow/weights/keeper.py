"""What a policy's publisher has stored and announced, and what of it goes (``retention.py`` plans which):

* the history: the announcements whose payloads are stored, in publication order, seeded at the first publish from
  what earlier trainers of the run announced (:meth:`PayloadKeeper.seed`), when the payloads an earlier trainer stored
  and never announced are swept too;
* after each announcement, one retention pass at a time, in the background (:meth:`PayloadKeeper.collect`): what the
  newest ``keep_versions`` versions' chains do not need goes, and so does the first payload of a state announced again,
  from the hub and from every region mirror in ``mirror_domains``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Literal

from astraflow.streams.messages import ObjectRef, WeightVersion
from astraflow.streams.plane import Plane
from astraflow.streams.weight_channel import WeightChannel
from astraflow.weights.checks import in_order
from astraflow.weights.retention import Key, RetentionPlan, execute_retention, key_of, plan_retention

log = logging.getLogger(__name__)
MIRROR_SWEEP_S = 5.0  # how long a restarted publisher's first put waits for each region mirror's sweep
HUB_SWEEP_S = 30.0  # and for the hub's (a sweep cut short leaves its orphans to the next life; it never holds a version back)
_PAYLOAD_NAME = re.compile(r"(?P<policy>.+)/v(?P<version>\d+)-[0-9a-f]+\.(?:delta|keyframe)")


def payload_name(policy: str, version: int, digest: str, encoding: Literal["keyframe", "delta"]) -> str:
    """The object name of a version's payload: ``{policy}/v{version}-{digest12}.{encoding}``."""
    return f"{policy}/v{version}-{digest[:12]}.{encoding}"


def base_name(policy: str, digest: str) -> str:
    """The object name of the base model a LoRA policy's adapters apply onto: ``{policy}/base-{digest12}.keyframe``
    (never a version's payload: retention and the sweep leave it)."""
    return f"{policy}/base-{digest[:12]}.keyframe"


def payload_version(name: str, policy: str) -> int | None:
    """The version a :func:`payload_name` of ``policy`` names (None: not one)."""
    found = _PAYLOAD_NAME.fullmatch(name)
    return int(found["version"]) if found is not None and found["policy"] == policy else None


class PayloadKeeper:
    def __init__(self, plane: Plane, policy: str, keep_versions: int | None, mirror_domains: tuple[str, ...]) -> None:
        self.plane, self.policy = plane, policy
        self.keep_versions = keep_versions  # newest versions kept reconstructible; None: every one
        self.mirror_domains = mirror_domains
        self.history: dict[Key, WeightVersion] = {}  # announcements whose objects are stored, in publication order
        self.seeded = False  # history holds what earlier trainers of this run announced
        self.deleted = 0  # versions garbage-collected
        self._gc: asyncio.Task[None] | None = None
        self._superseded: list[WeightVersion] = []  # first announcements of a state announced again, their payloads to delete

    def announced(self, ann: WeightVersion, landed: bool) -> None:
        """``ann`` is announced (``landed``: by this publish, not found there already): the newest of the history."""
        before = self.history.pop(key_of(ann), None)  # a re-announced state moves to the end: publication order
        if landed and before is not None and before.objects != ann.objects:  # announced again: the first payload goes next pass
            self._superseded.append(before)
        self.history[key_of(ann)] = ann

    def collect(self) -> None:
        """A retention pass in the background, unless one is running."""
        if self._gc is None or self._gc.done():
            self._gc = asyncio.create_task(self._collect_logged())

    async def wait(self) -> None:
        """Finish retention up to the last announcement: wait for the pass in flight, then run one more on the current
        history (tests, shutdown)."""
        if self._gc is not None:
            await asyncio.shield(self._gc)
        await self.collect_garbage()

    async def _collect_logged(self) -> None:
        try:
            await self.collect_garbage()
        except Exception:  # retention is retried after the next publish
            log.exception("weights %s: retention pass failed", self.policy)

    async def seed(self) -> None:
        """Adopt the announcements a previous trainer of this run left on the stream, so retention
        collects their objects too (a restarted or resumed trainer)."""
        try:
            anns = await WeightChannel(self.plane, self.policy).history()
        except Exception as e:  # retention of older objects is best effort; publishing is not
            log.warning("weights %s: could not read earlier announcements: %s", self.policy, e)
            return
        for ann in in_order(anns, self.policy):  # never what a foreign writer put there: its objects may be anyone's
            self.history.setdefault(key_of(ann), ann)
        self.seeded = True
        await self._sweep(anns)

    async def _sweep(self, anns: list[WeightVersion]) -> None:
        """Purge the payloads an earlier trainer of this policy stored and never announced (killed in between, or in
        the middle of the put): those of a version above every announcement, or never finished. With retention on, also
        those below the keyframe of every announcement the stream still holds (it keeps ``weights_history`` per
        subject): no chain the stream names reaches them, and a trainer restarted past that many versions would otherwise
        find them here, unnamed, at every start (retention works from announcements and never sees them). Any object an
        announcement names is kept, a foreign one's too (``ObjectStore.sweep``)."""
        keep = {ref.nuid for a in anns for ref in a.objects} | {a.adapter.base.nuid for a in anns if a.adapter and a.adapter.base}
        newest = max((a.version for a in anns), default=-1)
        floor = min((a.keyframe_version for a in anns), default=-1) if self.keep_versions is not None else -1

        def stale(name: str) -> bool:
            version = payload_version(name, self.policy)
            return version is not None and (version > newest or version < floor)

        stores = {"the hub": self.plane.objects(), **{f"the mirror in {d}": self.plane.objects(domain=d) for d in self.mirror_domains}}
        for where, store in stores.items():
            try:  # before the first put (a sweep beside it could take it for an orphan), bounded: best effort, never a stall
                bound = HUB_SWEEP_S if where == "the hub" else MIRROR_SWEEP_S
                purged = await asyncio.wait_for(store.sweep(self.policy, keep, stale), bound)
            except Exception as e:  # best effort, as retention: publishing goes on
                log.warning("weights %s: could not sweep unannounced payloads from %s: %s", self.policy, where, e)
                continue
            if purged:
                log.warning("weights %s: purged %d payloads stored and never announced (a trainer killed before its "
                            "announcement) from %s", self.policy, purged, where)

    async def discard(self, ref: ObjectRef) -> None:
        try:
            await self.plane.objects().delete(ref)
        except Exception as e:  # the announcement never went out: nothing references the chunks
            log.warning("weights %s: could not purge unannounced %s: %s", self.policy, ref.name, e)

    async def collect_garbage(self) -> int:
        """Delete what the last ``keep_versions`` versions' chains do not need, and the first payload of a state announced
        again (its nodes rebuild from the later announcement); returns how many versions went."""
        targets = [self.plane.objects(), *(self.plane.objects(domain=d) for d in self.mirror_domains)]
        if self._superseded:
            superseded, self._superseded = self._superseded, []
            gone = await execute_retention(RetentionPlan(keep=(), delete=tuple(superseded)), targets)
            self._superseded += [a for a in superseded if a not in gone]  # a failed delete is tried again next pass
        if self.keep_versions is None or len(self.history) <= self.keep_versions:
            return 0
        plan = plan_retention(self.history.values(), self.keep_versions)
        if not plan.delete:
            return 0
        gone = await execute_retention(plan, targets)
        for ann in gone:
            self.history.pop(key_of(ann), None)
        self.deleted += len(gone)
        return len(gone)
