"""The in-flight audit: tasks out that will never come back, found and settled ``failed:lost``.

A task is out until its primary group completes, a node dead-letters it, or the server gives up on it (max
deliveries, kept in the DLQ stream). One more end needs looking for: a node acked the task (its message left the TASK
work queue) but its group never completes (a node that published part of a group, trajectories lost). Such a task
would hold its place in flight for good, and enough of them stop the run: the issuing budget counts them.

The same holds for a group kept before a restart (in the state, its trajectories unacked): it comes back by
redelivery; one that does not within the grace would count as buffered for good, and is settled ``failed:lost`` too.

So every ``AUDIT_S`` the dataflow looks up, by the TASK stream sequence each was published at, the oldest tasks out
for longer than the task ack wait (at most ``AUDIT_MAX`` a pass). A task whose message is gone while no trajectory
waits undelivered on the dataflow's consumer, for longer than ``grace`` (two trajectory ack waits: a trajectory
delivered and held comes back within one), is lost. The bookkeeping is pure (:func:`lost_tasks`); the service reads
the plane and settles what it returns.
"""

from __future__ import annotations

from collections.abc import Mapping

AUDIT_S = 5.0  # how often the audit runs
AUDIT_MAX = 64  # tasks looked up per pass, oldest first


def due(out_since: Mapping[str, float], now: float, older_than: float, limit: int = AUDIT_MAX) -> list[str]:
    """The tasks to look up: out for longer than ``older_than`` seconds, oldest first, at most ``limit``."""
    old = sorted((t for t, since in out_since.items() if now - since > older_than), key=lambda t: out_since[t])
    return old[:limit]


def lost_tasks(gone_since: dict[str, float], looked_up: Mapping[str, bool], now: float, grace: float, drained: bool) -> list[str]:
    """Note when each task's message was first seen gone (``looked_up``: task -> its message still in the stream), forget
    the ones seen there again; the tasks gone for longer than ``grace`` while the dataflow's consumer holds nothing
    undelivered (``drained``) are lost. Updates ``gone_since`` in place."""
    for task, present in looked_up.items():
        if present:
            gone_since.pop(task, None)
        else:
            gone_since.setdefault(task, now)
    if not drained:
        return []
    return [t for t, since in gone_since.items() if now - since > grace]
