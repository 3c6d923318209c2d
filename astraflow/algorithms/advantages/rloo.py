"""rloo: REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

Each sample's baseline is the mean reward of the other samples of its group:

    A_i = r_i - (sum(r) - r_i) / (G - 1)  =  G / (G - 1) * (r_i - mean(r))

A group of one sample has no other samples and gets 0.
"""

from __future__ import annotations

from typing import Literal

from astraflow.algorithms.base import ADVANTAGES, Advantage, AlgoConfig, finite_rewards
from astraflow.algorithms.types import Group


class RlooConfig(AlgoConfig):
    type: Literal["rloo"] = "rloo"


@ADVANTAGES.register("rloo", RlooConfig)
class Rloo(Advantage):
    name = "rloo"

    def __init__(self, cfg: RlooConfig | None = None) -> None:
        self.cfg = cfg or RlooConfig()

    def compute(self, group: Group) -> list[float]:
        rewards = finite_rewards(group)
        n = len(rewards)
        if n == 1:
            return [0.0]
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
