"""edf: earliest deadline first: serve the oldest still-valid groups, drop the rest.

A group may be trained while the trainer is at most ``max_staleness`` versions past its oldest
token, and (if a sample has a wall-clock deadline) until that deadline:

    version_deadline = min_version + max_staleness     (last trainer version that may train it)
    time_deadline    = min(sample.deadline), or +inf when no sample has one

    drop   if versions[policy] > version_deadline      (reason "stale")
    drop   if now > time_deadline                      (reason "expired")
    order  by (version_deadline, time_deadline, created_at, buffer position)

so the group closest to going stale is served first and nothing that waits is wasted while a
fresher group is served ahead of it. (Unknown trainer version: never stale.)
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

from astraflow.algorithms.base import SERVERS, AlgoConfig, Server
from astraflow.algorithms.types import Context, Group


class EdfConfig(AlgoConfig):
    type: Literal["edf"] = "edf"


@SERVERS.register("edf", EdfConfig)
class Edf(Server):
    name = "edf"

    def __init__(self, cfg: EdfConfig | None = None) -> None:
        self.cfg = cfg or EdfConfig()

    def order(
        self, buffer: Sequence[Group], ctx: Context, rng: random.Random
    ) -> tuple[list[Group], list[tuple[str, str]]]:
        valid: list[tuple[tuple[float, float, float, int], Group]] = []
        dropped: list[tuple[str, str]] = []
        for i, group in enumerate(buffer):
            reason = ctx.invalid_reason(group)
            if reason is not None:
                dropped.append((group.task_id, reason))
                continue
            time_deadline = group.deadline
            key = (
                group.min_version + ctx.max_staleness,
                math.inf if time_deadline is None else time_deadline,
                group.created_at,
                i,
            )
            valid.append((key, group))
        valid.sort(key=lambda kv: kv[0])
        return [g for _, g in valid], dropped
