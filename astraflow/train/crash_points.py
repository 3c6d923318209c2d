"""Test hook: ``ASTRAFLOW_TRAINER_CRASH=where@version`` SIGKILLs the trainer at that point of its loop.

Points: ``after_step``, ``after_snapshot`` (the checkpoint copied in memory, not written),
``during_checkpoint_write`` (its files written, not yet renamed into place), ``after_checkpoint``
(durable), ``before_announce`` (the version's payload stored, not announced: a publish in flight behind the
next step), ``after_publish`` (announced, its batch not yet held), ``after_ack`` (that version's batch acked),
``between_acks`` (after the first of a group of held acks, before the rest).
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)
CRASH_ENV = "ASTRAFLOW_TRAINER_CRASH"


def crash_point(where: str, version: int) -> None:
    """SIGKILL this process (from any thread) when ``ASTRAFLOW_TRAINER_CRASH`` names ``where@version``."""
    if os.environ.get(CRASH_ENV) == f"{where}@{version}":
        log.warning("crash point %s@%d: SIGKILL", where, version)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
