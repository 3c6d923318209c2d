"""fifo: serve groups in buffer (arrival) order.

The buffer is in the order groups completed; the first ``n_groups`` servable ones form the
batch. With ``drop_stale`` (the default) groups that may no longer be trained leave the buffer
first: ``versions[policy] - min_version > max_staleness`` (reason "stale") or a sample's
deadline has passed (reason "expired").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from astraflow.algorithms.base import SERVERS, AlgoConfig, Server
from astraflow.algorithms.types import Context, Group


class FifoConfig(AlgoConfig):
    type: Literal["fifo"] = "fifo"
    drop_stale: bool = True
    """Drop stale or expired groups at serving time instead of training on them."""


@SERVERS.register("fifo", FifoConfig)
class Fifo(Server):
    name = "fifo"

    def __init__(self, cfg: FifoConfig | None = None) -> None:
        self.cfg = cfg or FifoConfig()

    def order(
        self, buffer: Sequence[Group], ctx: Context, rng: random.Random
    ) -> tuple[list[Group], list[tuple[str, str]]]:
        if not self.cfg.drop_stale:
            return list(buffer), []
        ordered: list[Group] = []
        dropped: list[tuple[str, str]] = []
        for group in buffer:
            reason = ctx.invalid_reason(group)
            if reason is None:
                ordered.append(group)
            else:
                dropped.append((group.task_id, reason))
        return ordered, dropped
