"""Node reputation: every failed check counts against the node that sent it; past a threshold the node is quarantined.

Who sent a trajectory is the node its subject names (``af.{run}.traj.{policy}.{node}``): a node's own credential may
publish under its own name only, so the server vouches for it. A trajectory on a subject that names no node (the
shared ``rollout`` user of a hand-rendered deployment, an admin, an unauthenticated plane) is counted against no one:
its ``node_id`` is a claim, and quarantining by a claim would let a liar cut off the honest node it names. There a
liar's trajectories are refused one by one, as before.

A node fails a task when a trajectory it sent for that task is turned away (``invalid:*``), for anything but arrays
that could not be read back (``payload``: the store's trouble as much as the node's). One bad group is one failure,
however many of its samples were bad. ``dataflow.quarantine_after`` failures quarantine the node:

- from then on each trajectory it sends is refused, ``invalid:quarantined`` (never trained);
- the quarantine is part of the dataflow's state (it survives restarts) and of its heartbeat, so ``astraflow status``
  and the live view name the node and why;
- the launcher revokes the node's credential on the running server (``launch/access.py``): its connection is closed,
  and the tasks it had pulled and not answered go back to the other nodes when their ack wait runs out;
- ``astraflow node admit NAME`` lets it back in: it writes an :class:`~astraflow.streams.state.AdmitRecord`, which the
  dataflow reads for each quarantined node every audit, and the node starts again with a clean record.

An honest node fails nothing: every CPU recipe runs to its end with no trajectory refused (``tests/test_recipes.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from astraflow.dataflow.validate import Invalid
from astraflow.streams.dataflow_state import Quarantine
from astraflow.streams.messages import Suspect
from astraflow.streams.state import AdmitRecord
from astraflow.streams.subjects import Names

log = logging.getLogger(__name__)

BLAMELESS = frozenset({"payload"})  # refusal codes that say nothing about the node


def sender(subject: str) -> str | None:
    """The node a trajectory counts against: the one its subject names (the server vouches for it), else none."""
    return Names.sender(subject)


@dataclass
class Reputation:
    threshold: int  # failed tasks that quarantine a node; 0: none ever is
    quarantined: dict[str, Quarantine] = field(default_factory=dict)
    failed: dict[str, dict[str, str]] = field(default_factory=dict)  # node -> its failed tasks -> the first code
    on_quarantine: Callable[[Quarantine], None] | None = None  # the service: its state is written with the turn's commit

    def refuses(self, node: str | None) -> bool:
        """Whether ``node``'s trajectories are refused (None: a sender no subject names, never)."""
        return node is not None and node in self.quarantined

    def refusal(self, node: str | None) -> Invalid | None:
        """``invalid:quarantined`` for what a quarantined node sends, else None."""
        q = self.quarantined.get(node) if node is not None else None
        return None if q is None else Invalid("quarantined", f"node {node!r} is quarantined ({q.summary()})")

    def suspected(self, suspect: Suspect, version: int) -> Quarantine | None:
        """A trajectory the trainer's token check left out of the step of ``version``: counted against its node."""
        reason = (f"the trainer's token check (v{version}) left out {suspect.traj_id}: its behaviour logprobs are "
                  f"{suspect.gap:.2f} nats per token from the policy's")
        return self.blame(suspect.node, suspect.task_id, "logprobs", reason)

    def blame(self, node: str | None, task_id: str, code: str, reason: str, now: float | None = None) -> Quarantine | None:
        """Count a refusal against ``node`` (None: a sender no subject vouches for, counted against no one); the node's
        :class:`Quarantine` when this failure tips it over (``on_quarantine`` called), else None."""
        if node is None or code in BLAMELESS or node in self.quarantined:
            return None
        tasks = self.failed.setdefault(node, {})
        tasks.setdefault(task_id, code)
        if not self.threshold or len(tasks) < self.threshold:
            return None
        codes: dict[str, int] = {}
        for c in tasks.values():
            codes[c] = codes.get(c, 0) + 1
        q = Quarantine(node=node, at=time.time() if now is None else now, reason=reason[:300], failures=codes)
        self.quarantined[node] = q
        del self.failed[node]
        log.warning("node %s quarantined: %d failed tasks (%s); its trajectories are refused from now on, last: %s",
                    node, sum(q.failures.values()), q.summary(), q.reason)
        if self.on_quarantine is not None:
            self.on_quarantine(q)
        return q

    async def readmit(self, admission: Callable[[str], Awaitable[AdmitRecord | None]]) -> list[str]:
        """Lift the quarantine of each node an operator admitted after it was quarantined (``astraflow node admit``:
        ``admission(node)`` reads its record); the nodes let back in."""
        back = []
        for node, q in list(self.quarantined.items()):
            record = await admission(node)
            if record is not None and record.lifts(q.at) and self.admit(node):
                log.warning("node %s admitted again by %s: its trajectories are taken again", node, record.by)
                back.append(node)
        return back

    def admit(self, node: str) -> bool:
        """Let ``node`` back in with a clean record; whether it was quarantined."""
        self.failed.pop(node, None)
        return self.quarantined.pop(node, None) is not None

    def failures(self, node: str) -> int:
        return len(self.failed.get(node, {}))
