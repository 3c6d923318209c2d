"""staleness: drop groups whose oldest token lags the trainer by too many versions.

    lag = versions[policy] - min(sample.version)
    drop  if  lag > max_staleness                           (reason "stale")
    drop  if  now > min(sample.deadline)  (deadlines set)   (reason "expired", when check_deadline)

``max_staleness`` defaults to the run's (``Context.max_staleness``). A policy whose trainer
version is not known yet has no lag, so its groups pass. Servers apply the same test again at
serving time, since a kept group can go stale while it waits in the buffer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from astraflow.algorithms.base import FILTERS, AlgoConfig, Filter
from astraflow.algorithms.types import KEEP, Context, Decision, Group, drop


class StalenessConfig(AlgoConfig):
    type: Literal["staleness"] = "staleness"
    max_staleness: int | None = Field(None, ge=0)
    """Versions a group may lag the trainer; None: the run's max_staleness."""
    check_deadline: bool = True
    """Also drop groups past a sample's wall-clock deadline (reason "expired")."""


@FILTERS.register("staleness", StalenessConfig)
class Staleness(Filter):
    name = "staleness"

    def __init__(self, cfg: StalenessConfig | None = None) -> None:
        self.cfg = cfg or StalenessConfig()

    def keep(self, group: Group, ctx: Context) -> Decision:
        reason = ctx.invalid_reason(group, self.cfg.max_staleness)
        if reason is None or (reason == "expired" and not self.cfg.check_deadline):
            return KEEP
        return drop(reason)
