"""A pull of the TRAJ stream made ready for admission (``ingest.py``): every trajectory whole, its offloaded arrays read
back with every digest checked (``streams/trajectories.py``), and its claims scored again (``claims.py``), all of the
pull at once before ingest decides on any of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from astraflow.dataflow.claims import ClaimCheck
from astraflow.dataflow.durability import Ackable
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.reputation import Reputation, sender
from astraflow.dataflow.validate import Invalid
from astraflow.streams.messages import Trajectory
from astraflow.streams.trajectories import PayloadUnavailable

log = logging.getLogger(__name__)
INLINE_S = 0.002  # claims expected to take less than this are checked on the loop: a worker thread's hand-off costs more
Resolve = Callable[[list[Trajectory]], Awaitable[list[Trajectory | PayloadUnavailable]]]  # offloaded arrays read back


class Incoming(Ackable, Protocol):
    """A trajectory's delivery: a ``Delivery[Trajectory]``, or one trajectory of a group's (``parts.Part``)."""

    msg: Trajectory

    @property
    def position(self) -> int: ...

    @property
    def subject(self) -> str: ...  # names the sending node (``reputation.sender``)

    async def reject(self, reason: str, code: str = "") -> None: ...

    async def nak(self, delay: float | None = None) -> None: ...


Read = tuple[Incoming, Trajectory, Invalid | None]  # a delivery, its trajectory whole, and why its arrays cannot be read


@dataclass
class PullReader:
    resolve: Resolve
    claims: ClaimCheck | None  # None: claims are trusted (``dataflow.trust_claims``)
    in_flight: InFlight  # the prompt each task was issued with
    policies: Collection[str]  # the run's
    reputation: Reputation  # a quarantined node's claims are not scored
    stats: Counter[str]  # the dataflow's heartbeat counters

    async def check_claims(self, items: Sequence[Read]) -> list[Invalid | None]:
        """What each trajectory's claims fail on (None: nothing, or not checked). In a worker thread when the checks so
        far say this pull's would take ``INLINE_S`` or more (scoring completions again may take a while, and the loop
        serves heartbeats and acks meanwhile); on the loop otherwise, where most pulls' checks take less than handing
        them to a thread costs. A trajectory whose arrays could not be read, of a policy the run does not have, or of a
        quarantined node, is not checked (admission turns it away)."""
        out: list[Invalid | None] = [None] * len(items)
        if self.claims is None:
            return out
        todo = [k for k, (d, t, unreadable) in enumerate(items)
                if unreadable is None and t.policy in self.policies and not self.reputation.refuses(sender(d.subject))]
        if todo:
            asked = [(items[k][1], self.in_flight.prompt_of(items[k][1].task_id)) for k in todo]
            cost = self.claims.cost  # what the checks cost so far: their mean says whether a thread is worth it
            inline = cost.checked > 0 and cost.check_s / cost.checked * len(asked) < INLINE_S
            found = self.claims.check_all(asked) if inline else await asyncio.to_thread(self.claims.check_all, asked)
            for k, bad in zip(todo, found, strict=True):
                out[k] = bad
            self.stats["claims.checked"], self.stats["claims.rescored"] = cost.checked, cost.rescored
            self.stats["claims.check_ms"] = round(1e3 * cost.check_s)
        return out

    async def whole(self, deliveries: Sequence[Incoming]) -> list[Read]:
        """Each delivery with its trajectory whole (offloaded arrays read back), or why they cannot be read. If the
        reads fail for another reason (a timeout), the offloaded ones are given back (nak) and left out."""
        offloaded = [d for d in deliveries if d.msg.offloaded]
        if not offloaded:
            return [(d, d.msg, None) for d in deliveries]
        try:
            resolved = dict(zip(map(id, offloaded), await self.resolve([d.msg for d in offloaded]), strict=True))
        except Exception as e:  # says nothing about the trajectories: read them again later
            log.warning("reading the arrays of %d trajectories failed (%s: %s); giving them back", len(offloaded), type(e).__name__, e)
            await asyncio.gather(*(d.nak(delay=1.0) for d in offloaded), return_exceptions=True)
            self.stats["payload_retries"] += len(offloaded)
            return [(d, d.msg, None) for d in deliveries if not d.msg.offloaded]
        out: list[Read] = []
        for d in deliveries:
            r = resolved.get(id(d), d.msg)
            out.append((d, d.msg, Invalid("payload", str(r))) if isinstance(r, PayloadUnavailable) else (d, r, None))
        return out
