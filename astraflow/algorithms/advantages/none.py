"""none: the raw reward is the advantage (A_i = r_i), for losses that bring their own baseline."""

from __future__ import annotations

from typing import Literal

from astraflow.algorithms.base import ADVANTAGES, Advantage, AlgoConfig, finite_rewards
from astraflow.algorithms.types import Group


class NoneConfig(AlgoConfig):
    type: Literal["none"] = "none"


@ADVANTAGES.register("none", NoneConfig)
class RawReward(Advantage):
    name = "none"

    def __init__(self, cfg: NoneConfig | None = None) -> None:
        self.cfg = cfg or NoneConfig()

    def compute(self, group: Group) -> list[float]:
        return finite_rewards(group)
