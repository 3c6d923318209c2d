"""What a weight announcement may say: the checks a node runs before it plans from one (pure, no I/O).

``WeightSync`` turns away an announcement that fails them (to the DLQ, with the reason, from its
live follower; skipped when read from the history) and never plans a chain through it:

| check | an announcement is turned away when |
|---|---|
| policy | it names another policy than the subject it came on |
| versions | ``version`` < 0; a keyframe with a base, or whose ``keyframe_version`` is not its own version; a |
|  | delta without a base, with ``base_version`` >= ``version``, or with ``keyframe_version`` > ``base_version`` |
| digests | ``state_digest`` / ``base_digest`` / object digests are not sha256 hex |
| objects | not exactly one object; a size < 0, a chunk size <= 0, a chunk digest count that does not match |
|  | size / chunk size; an object id that is not a subject token |
| order (live only) | ``version`` is not above the newest this node has seen of the policy (:func:`order_problem`; |
|  | the same announcement again is ignored, not rejected) |

Every reader of announcements applies them, not only nodes: the dataflow (versions and trained
batches), the launcher (``metrics.jsonl``), a trainer reading where its policy stands
(:func:`in_order`) and a publisher whose announcement the server refused because something was
announced after its own (:func:`foreign_harmless`: it steps over what no trainer could have made).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from astraflow.streams.messages import WeightVersion

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def announcement_problem(ann: WeightVersion, policy: str) -> str | None:
    """What is impossible about ``ann`` on ``policy``'s subject, or None."""
    if ann.policy != policy:
        return f"an announcement of policy {ann.policy!r} on the subject of {policy!r}"
    v, k = ann.version, ann.keyframe_version
    if v < 0:
        return f"version {v} < 0"
    if ann.encoding == "keyframe":
        if ann.base_version is not None or ann.base_digest is not None:
            return f"keyframe v{v} names a base (v{ann.base_version})"
        if k != v:
            return f"keyframe v{v} names keyframe_version {k}"
    else:
        b = ann.base_version
        if b is None or ann.base_digest is None:
            return f"delta v{v} without a base"
        if not 0 <= b < v:
            return f"delta v{v} applies onto v{b}, not an earlier version"
        if not 0 <= k <= b:
            return f"delta v{v} onto v{b} names keyframe_version {k}"
        if not _SHA256.match(ann.base_digest):
            return f"v{v}: base_digest is not a sha256"
    if not _SHA256.match(ann.state_digest):
        return f"v{v}: state_digest is not a sha256"
    if len(ann.objects) != 1:
        return f"v{v} names {len(ann.objects)} objects; a version is one object"
    ref = ann.objects[0]
    if ref.size < 0 or ref.chunk_size <= 0:
        return f"v{v}: object size {ref.size}, chunk size {ref.chunk_size}"
    chunks = max(1, -(-ref.size // ref.chunk_size))
    if len(ref.digests) != chunks:
        return f"v{v}: {len(ref.digests)} chunk digests for {ref.size} bytes in chunks of {ref.chunk_size} ({chunks} chunks)"
    if not _TOKEN.match(ref.nuid):
        return f"v{v}: object id {ref.nuid[:40]!r} is not a subject token"
    if not all(_SHA256.match(d) for d in (ref.digest, *ref.digests)):
        return f"v{v}: an object digest is not a sha256"
    return None


def order_problem(ann: WeightVersion, newest: WeightVersion | None) -> str | None:
    """A live announcement must be newer than the newest seen (versions are never reused); None when it is,
    or when it is that same announcement again (the caller ignores it)."""
    if newest is None or ann.version > newest.version:
        return None
    if ann.version == newest.version and ann.state_digest == newest.state_digest:
        return None
    if ann.version == newest.version:
        return f"v{ann.version} announced again with another state ({ann.state_digest[:12]}, first {newest.state_digest[:12]})"
    return f"v{ann.version} announced after v{newest.version}: versions only rise"


def in_order(anns: Iterable[WeightVersion], policy: str) -> list[WeightVersion]:
    """The announcements of a history (oldest first) a node would have followed: possible on their face, each
    newer than the newest before it (a repeat of the same announcement dropped)."""
    out: list[WeightVersion] = []
    for ann in anns:
        newest = out[-1] if out else None
        if announcement_problem(ann, policy) is None and order_problem(ann, newest) is None and \
                (newest is None or ann.version > newest.version):
            out.append(ann)
    return out


def foreign_harmless(ann: WeightVersion, policy: str, own_version: int) -> bool:
    """An announcement another writer put on ``policy``'s subject that no trainer of it could have made: impossible
    on its face, or not newer than ``own_version`` (the publisher's own last). Nodes turn those away; a
    trainer steps over them. Anything else is another trainer's version."""
    return announcement_problem(ann, policy) is not None or ann.version <= own_version
