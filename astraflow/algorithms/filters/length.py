"""length: drop groups with truncated or over-long samples.

    drop  if  drop_truncated and any(sample.truncated)                  (reason "truncated")
    drop  if  max_tokens is set and any(sample.n_tokens > max_tokens)    (reason "too_long")

The whole group goes: removing single samples would change the group's baseline (its mean
reward) and the group size the advantage assumes. Truncation is checked first.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astraflow.algorithms.base import FILTERS, AlgoConfig, Filter
from astraflow.algorithms.types import KEEP, Context, Decision, Group, drop


class LengthConfig(AlgoConfig):
    type: Literal["length"] = "length"
    drop_truncated: bool = True
    """Drop a group if any sample was cut off by the length limit."""
    max_tokens: int | None = Field(None, ge=1)
    """Drop a group if any sample has more completion tokens than this; None: no limit."""


@FILTERS.register("length", LengthConfig)
class Length(Filter):
    name = "length"

    def __init__(self, cfg: LengthConfig | None = None) -> None:
        self.cfg = cfg or LengthConfig()

    def keep(self, group: Group, ctx: Context) -> Decision:
        if self.cfg.drop_truncated and any(s.truncated for s in group.samples):
            return drop("truncated")
        limit = self.cfg.max_tokens
        if limit is not None and any(s.n_tokens > limit for s in group.samples):
            return drop("too_long")
        return KEEP
