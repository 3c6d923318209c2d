"""The weight announcements of one policy as the roles see them: its trainer announces each version after the last
one it knows of (a second writer's announcement in between makes that fail), nodes, the dataflow and the launcher
follow them or read the newest, from the hub or from a region's mirror.

Announcements are messages on ``weights.{policy}`` of the run's WEIGHTS stream (or of a mirror of it in another
JetStream domain); the chunks they name are in the object store (``objects.py``). A position is where the stream
keeps an announcement: what ``announce`` must follow, compared by the publisher and by nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from astraflow.streams.consuming import Check, Follower, OnBad, log_bad
from astraflow.streams.messages import WeightVersion

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane


class WeightChannel:
    """``policy``'s announcements; ``stream``/``domain``: a region's mirror of them (default: the hub's stream)."""

    def __init__(self, plane: Plane, policy: str, stream: str | None = None, domain: str | None = None) -> None:
        self.plane, self.policy, self.domain = plane, policy, domain
        self.subject = plane.names.weights(policy)
        self.where = stream or plane.names.weights_stream  # named in errors: which stream (or mirror) lacked a version

    async def announce(self, ann: WeightVersion, msg_id: str, after: int) -> int:
        """Publish ``ann`` only if the policy's last announcement is at position ``after`` (``PublishConflict`` if not);
        its position (``after`` or below when the server held it already under ``msg_id``)."""
        return await self.plane.publish(self.subject, ann, msg_id=msg_id, after=after)

    async def last_position(self) -> int:
        """The position of the policy's newest announcement; 0 when there is none."""
        return await self.plane.stored.last_seq(self.where, self.subject)

    async def read(self, position: int) -> WeightVersion:
        """The announcement at ``position``."""
        return await self.plane.stored.get(self.where, position, WeightVersion)

    async def newest(self) -> WeightVersion | None:
        """The policy's newest announcement (None: none yet); ``DecodeError`` when it does not decode."""
        return await self.plane.stored.last(self.where, self.subject, WeightVersion)

    async def history(self, on_bad: OnBad = log_bad) -> list[WeightVersion]:
        """Every announcement the stream still keeps, oldest first (undecodable ones handed to ``on_bad``, skipped)."""
        return await self.plane.history(self.subject, WeightVersion, stream=self.where, domain=self.domain, on_bad=on_bad)

    def follower(self, start: Literal["last", "all"] = "last", on_bad: OnBad = log_bad,
                 check: Check[WeightVersion] | None = None) -> Follower[WeightVersion]:
        """Follow the announcements from the newest (``last``) or the first kept (``all``); ``check``: a reason against
        one dead-letters it."""
        return self.plane.follower(self.subject, WeightVersion, stream=self.where, domain=self.domain, start=start,
                                   on_bad=on_bad, check=check)
