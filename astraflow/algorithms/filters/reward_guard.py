"""reward_guard: drop groups with a missing, NaN or infinite reward, or one outside bounds.

    drop  if  any(r is None or not isfinite(r))                  (reason "bad_reward")
    drop  if  any(r < low) or any(r > high)   (bounds set)       (reason "reward_out_of_range")

A failed verifier must not reach the advantage: one NaN poisons the whole group's baseline. The
dataflow already turns away NaN, infinite and (outside ``finish_reason: error``) missing rewards
before a group forms (``dataflow/validate.py``), so here the guard is a second line and, with
``low`` / ``high``, a recipe's own bounds on what a reward may be.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import model_validator

from astraflow.algorithms.base import FILTERS, AlgoConfig, Filter
from astraflow.algorithms.types import KEEP, Context, Decision, Group, drop


class RewardGuardConfig(AlgoConfig):
    type: Literal["reward_guard"] = "reward_guard"
    low: float | None = None
    """Smallest valid reward; None: no lower bound."""
    high: float | None = None
    """Largest valid reward; None: no upper bound."""

    @model_validator(mode="after")
    def _check(self) -> RewardGuardConfig:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self


@FILTERS.register("reward_guard", RewardGuardConfig)
class RewardGuard(Filter):
    name = "reward_guard"

    def __init__(self, cfg: RewardGuardConfig | None = None) -> None:
        self.cfg = cfg or RewardGuardConfig()

    def keep(self, group: Group, ctx: Context) -> Decision:
        rewards = group.rewards
        if not all(math.isfinite(r) for r in rewards):
            return drop("bad_reward")
        low, high = self.cfg.low, self.cfg.high
        if (low is not None and min(rewards) < low) or (high is not None and max(rewards) > high):
            return drop("reward_out_of_range")
        return KEEP
