"""Retention of weight versions: keep the last N versions reconstructible, delete the rest.

A version is reconstructible from its *chain*: the keyframe it was built from and every delta
after it, each delta applying onto exactly the version before it (linked by ``base_version``
and ``base_digest``). Planning is pure (:func:`plan_retention`); :func:`execute_retention`
deletes the planned objects from the object stream and from any region mirror.

Rules, in order:

* the newest version's chain (the newest keyframe and every delta after it) is never deleted;
* each of the last ``keep_last`` versions keeps its whole chain, so a kept delta keeps its
  keyframe and the deltas between;
* everything else is deleted.

Deleting runs after the new announcement (the commit point) is published, so a node that
reads a version being deleted sees a missing object, falls back to the newest keyframe chain,
and that chain is always kept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from astraflow.streams.messages import WeightVersion
from astraflow.streams.objects import ObjectError, ObjectStore

log = logging.getLogger(__name__)
DELETE_WAVE = 64  # objects of one target deleted at once

Key = tuple[int, str]  # (version, state_digest): unique even when a restarted trainer re-announces a version


def key_of(ann: WeightVersion) -> Key:
    return ann.version, ann.state_digest


def base_key(ann: WeightVersion) -> Key | None:
    """The key of the version a delta applies onto (None for a keyframe or a malformed delta)."""
    if ann.encoding != "delta" or ann.base_version is None or ann.base_digest is None:
        return None
    return ann.base_version, ann.base_digest


def walk_chain(ann: WeightVersion, index: Mapping[Key, WeightVersion]) -> tuple[list[WeightVersion], bool]:
    """``ann``'s chain as far as ``index`` holds it, oldest first, and whether it reaches a keyframe."""
    chain, complete = _unwalked(ann, index, {})
    return chain[::-1], complete


def _unwalked(ann: WeightVersion, index: Mapping[Key, WeightVersion], known: Mapping[Key, bool]) -> tuple[list[WeightVersion], bool]:
    """The part of ``ann``'s chain no earlier walk took (newest first), following base links, and whether the whole
    chain reaches a keyframe; the walk stops at the first announcement whose chain ``known`` holds (none: the whole
    chain). :func:`plan_retention` walks the newest versions' chains, which share their older part, each once (walked
    whole, each took up to a keyframe interval of steps: 0.65 ms a version at 64 versions kept and a keyframe every 10)."""
    path: list[WeightVersion] = []
    a = ann
    while (k := key_of(a)) not in known:
        path.append(a)
        if a.encoding != "delta" or len(path) > len(index):  # a keyframe, or a loop of links
            return path, a.encoding == "keyframe"
        base = index.get(base_key(a) or (-1, ""))
        if base is None:
            return path, False
        a = base
    return path, known[k]


def chain_of(ann: WeightVersion, index: Mapping[Key, WeightVersion]) -> list[WeightVersion] | None:
    """``ann``'s whole chain, keyframe first, following base links; None if a link is not in ``index``."""
    chain, complete = walk_chain(ann, index)
    return chain if complete else None


@dataclass(frozen=True)
class RetentionPlan:
    keep: tuple[WeightVersion, ...]  # announcements whose objects stay, in publication order
    delete: tuple[WeightVersion, ...]  # announcements whose objects go, in publication order
    broken: tuple[int, ...] = ()  # kept versions whose chain was already incomplete (logged)


def plan_retention(history: Iterable[WeightVersion], keep_last: int) -> RetentionPlan:
    """Which announcements' objects to keep and to delete so the last ``keep_last`` versions stay
    reconstructible. ``history`` is in publication order (oldest first): "last" means last
    published, so a restarted trainer's new chain counts as newest even where its version
    numbers are lower, and no clock is trusted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest version's chain is always kept), got {keep_last}")
    index = {key_of(a): a for a in history}
    order = {k: i for i, k in enumerate(index)}
    newest = list(index.values())[-keep_last:]
    complete: dict[Key, bool] = {}  # each kept announcement -> whether its chain reaches a keyframe
    broken: list[int] = []
    for ann in newest:
        path, ends = _unwalked(ann, index, complete)
        complete.update((key_of(a), ends) for a in path)
        if not ends:  # already unreconstructible: keep what there is of it all the same
            broken.append(ann.version)
    keep = [index[k] for k in complete]
    delete = [a for k, a in index.items() if k not in complete]
    return RetentionPlan(tuple(sorted(keep, key=lambda a: order[key_of(a)])), tuple(delete), tuple(broken))


async def execute_retention(plan: RetentionPlan, targets: Iterable[ObjectStore]) -> list[WeightVersion]:
    """Delete the objects of ``plan.delete`` from each target (the hub's bucket, each region's
    mirror). Returns the announcements whose objects are gone from every target; failures are
    logged (once per target) and retried next time. A target's deletes go out together, ``DELETE_WAVE`` at a time:
    a keyframe's chain leaves the window all at once, and one after another each would be its own round trips."""
    gone = [True] * len(plan.delete)
    refs = [(i, ref) for i, ann in enumerate(plan.delete) for ref in ann.objects]
    for store in targets:
        failures: list[ObjectError] = []
        for at in range(0, len(refs), DELETE_WAVE):
            wave = refs[at:at + DELETE_WAVE]
            outcomes = await asyncio.gather(*(store.delete(ref) for _, ref in wave), return_exceptions=True)
            for (i, _), outcome in zip(wave, outcomes, strict=True):
                if isinstance(outcome, ObjectError):
                    gone[i] = False
                    failures.append(outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
            if failures:  # the target is failing: the rest of its deletes wait for the next pass
                for i, _ in refs[at + DELETE_WAVE:]:
                    gone[i] = False
                break
        if failures:
            log.warning("retention: %d objects not deleted (%s)", len(failures), failures[0])
    if plan.broken:
        log.warning("retention: versions %s were already unreconstructible (links missing)", list(plan.broken))
    return [ann for ann, ok in zip(plan.delete, gone, strict=True) if ok]
