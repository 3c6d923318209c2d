"""grpo: group-normalised advantage (Shao et al. 2024, DeepSeekMath), optionally Dr. GRPO.

For the rewards r_1..r_G of one group:

    A_i = (r_i - mean(r)) / (std(r) + eps)       scale = "std"  (GRPO)
    A_i =  r_i - mean(r)                          scale = "none" (Dr. GRPO, Liu et al. 2025:
                                                  dividing by std over-weights near-solved
                                                  and near-hopeless prompts)

std is the unbiased sample standard deviation (divides by G - 1, like torch.std) when
``unbiased_std``, else the population one (divides by G). A group of one sample gets 0.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from astraflow.algorithms.base import ADVANTAGES, Advantage, AlgoConfig, finite_rewards
from astraflow.algorithms.types import Group


class GrpoConfig(AlgoConfig):
    type: Literal["grpo"] = "grpo"
    scale: Literal["std", "none"] = "std"
    """Divide by the group's reward std ("std", GRPO) or not ("none", Dr. GRPO)."""
    unbiased_std: bool = True
    """Use the sample std (divide by G - 1) rather than the population std (divide by G)."""
    eps: float = Field(1e-6, ge=0.0)
    """Added to the std before dividing."""


@ADVANTAGES.register("grpo", GrpoConfig)
class Grpo(Advantage):
    name = "grpo"

    def __init__(self, cfg: GrpoConfig | None = None) -> None:
        self.cfg = cfg or GrpoConfig()

    def compute(self, group: Group) -> list[float]:
        rewards = finite_rewards(group)
        n = len(rewards)
        mean = sum(rewards) / n
        centred = [r - mean for r in rewards]
        if self.cfg.scale == "none":
            return centred
        dof = n - 1 if self.cfg.unbiased_std else n
        std = math.sqrt(sum(c * c for c in centred) / dof) if dof > 0 else 0.0
        return [c / (std + self.cfg.eps) for c in centred]
