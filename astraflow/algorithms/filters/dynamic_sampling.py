"""dynamic_sampling: drop groups whose rewards are all equal (DAPO, Yu et al. 2025).

With group-normalised advantages A_i = (r_i - mean(r)) / (std(r) + eps), a group whose rewards
are all equal has A_i = 0 for every sample: it costs a training slot and teaches nothing.

    drop  if  max(r) - min(r) <= tolerance      (reason "zero_variance")

A group with a missing or non-finite reward never gets here from the dataflow (it validates rewards);
alone, such a group is left to the reward_guard filter. While every group is dropped (a policy that
always succeeds or always fails) no batch forms and no version comes: the dataflow warns after four
batches' worth of groups dropped in a row, and at each doubling (``dataflow/ingest.py``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from astraflow.algorithms.base import FILTERS, AlgoConfig, Filter
from astraflow.algorithms.types import KEEP, Context, Decision, Group, drop


class DynamicSamplingConfig(AlgoConfig):
    type: Literal["dynamic_sampling"] = "dynamic_sampling"
    tolerance: float = Field(0.0, ge=0.0)
    """Rewards closer than this count as equal."""


@FILTERS.register("dynamic_sampling", DynamicSamplingConfig)
class DynamicSampling(Filter):
    name = "dynamic_sampling"

    def __init__(self, cfg: DynamicSamplingConfig | None = None) -> None:
        self.cfg = cfg or DynamicSamplingConfig()

    def keep(self, group: Group, ctx: Context) -> Decision:
        rewards = group.rewards
        if not all(math.isfinite(r) for r in rewards):
            return KEEP
        if max(rewards) - min(rewards) <= self.cfg.tolerance:
            return drop("zero_variance")
        return KEEP
