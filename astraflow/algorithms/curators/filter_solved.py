"""filter_solved: stop rolling out prompts the policy has already solved.

Per (policy, prompt) we keep the mean rewards of its last ``k`` observed groups. A prompt is
solved when there are ``k`` of them and every one is ``>= threshold``:

    solved(prompt) = len(last_k) == k and min(last_k) >= threshold    (a missing reward: unsolved)

A solved prompt is skipped (reason "solved"), except with probability ``revisit``, which lets
it be rolled out again so a prompt the policy forgets is noticed (its new group enters last_k).
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Literal

from pydantic import Field

from astraflow.algorithms.base import CURATORS, AlgoConfig, Curator
from astraflow.algorithms.types import KEEP, Context, Decision, Group, PromptItem, drop


class FilterSolvedConfig(AlgoConfig):
    type: Literal["filter_solved"] = "filter_solved"
    k: int = Field(2, ge=1)
    """How many most recent groups of a prompt must all be solved."""
    threshold: float = 1.0
    """A group is solved when its mean reward is >= this."""
    revisit: float = Field(0.0, ge=0.0, le=1.0)
    """Probability of rolling out a solved prompt anyway."""


@CURATORS.register("filter_solved", FilterSolvedConfig)
class FilterSolved(Curator):
    name = "filter_solved"

    def __init__(self, cfg: FilterSolvedConfig | None = None) -> None:
        self.cfg = cfg or FilterSolvedConfig()
        self.history: dict[str, dict[str, list[float | None]]] = {}  # policy -> prompt -> last k mean rewards

    def solved(self, policy: str, prompt_id: str) -> bool:
        last = self.history.get(policy, {}).get(prompt_id, [])
        return len(last) == self.cfg.k and all(m is not None and m >= self.cfg.threshold for m in last)

    def select(self, prompt: PromptItem, ctx: Context, rng: random.Random) -> Decision:
        if not self.solved(prompt.policy, prompt.prompt_id):
            return KEEP
        if self.cfg.revisit > 0.0 and rng.random() < self.cfg.revisit:
            return KEEP
        return drop("solved")

    def observe(self, group: Group, ctx: Context) -> None:
        last = self.history.setdefault(group.policy, {}).setdefault(group.prompt_id, [])
        mean = group.reward_mean
        last.append(mean if math.isfinite(mean) else None)  # a missing reward never counts as solved
        del last[: -self.cfg.k]

    def state(self) -> dict[str, Any]:
        return {"history": copy.deepcopy(self.history)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.history = copy.deepcopy(state["history"])
