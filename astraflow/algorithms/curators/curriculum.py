"""curriculum: roll out prompts whose difficulty lies in a window that advances as the policy learns.

A prompt's ``difficulty`` is in [0, 1] (0 = easiest); prompts without one are always kept. Per
policy the window is ``[lo, lo + width]``, starting at ``lo = start``. Each observed group
updates the moving success rate

    s <- (1 - ema) * s + ema * success(group)    success = share of samples with reward >= success_threshold

(``s`` starts at the first group's success). Once at least ``patience`` groups have been observed
since the window last moved:

    lo <- min(lo + step, 1 - width)   if s >= advance_at        (harder prompts)
    lo <- max(lo - step, 0)           if s <  retreat_at         (easier; only when retreat_at is set)

Prompts outside the window are skipped ("curriculum_too_easy" / "curriculum_too_hard"), except
with probability ``explore``, so the edges of the data keep being sampled.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Literal

from pydantic import Field, model_validator

from astraflow.algorithms.base import CURATORS, AlgoConfig, Curator
from astraflow.algorithms.types import KEEP, Context, Decision, Group, PromptItem, drop


class CurriculumConfig(AlgoConfig):
    type: Literal["curriculum"] = "curriculum"
    start: float = Field(0.0, ge=0.0, le=1.0)
    """Initial lower edge of the difficulty window."""
    width: float = Field(0.3, gt=0.0, le=1.0)
    """Width of the difficulty window."""
    step: float = Field(0.05, gt=0.0, le=1.0)
    """How far the window moves each time it moves."""
    ema: float = Field(0.1, gt=0.0, le=1.0)
    """Weight of the newest group in the moving success rate."""
    success_threshold: float = 0.5
    """A sample with reward >= this counts as a success."""
    advance_at: float = Field(0.7, ge=0.0, le=1.0)
    """Move the window to harder prompts when the moving success rate reaches this."""
    retreat_at: float | None = Field(None, ge=0.0, le=1.0)
    """Move it back to easier prompts when the success rate falls below this; None: never."""
    patience: int = Field(16, ge=1)
    """Groups observed since the window last moved before it may move again."""
    explore: float = Field(0.05, ge=0.0, le=1.0)
    """Probability of keeping a prompt outside the window anyway."""

    @model_validator(mode="after")
    def _check(self) -> CurriculumConfig:
        if self.start + self.width > 1.0 + 1e-9:
            raise ValueError(f"start + width ({self.start} + {self.width}) must not exceed 1")
        if self.retreat_at is not None and self.retreat_at >= self.advance_at:
            raise ValueError(f"retreat_at ({self.retreat_at}) must be below advance_at ({self.advance_at})")
        return self


@CURATORS.register("curriculum", CurriculumConfig)
class Curriculum(Curator):
    name = "curriculum"

    def __init__(self, cfg: CurriculumConfig | None = None) -> None:
        self.cfg = cfg or CurriculumConfig()
        self.policies: dict[str, dict[str, Any]] = {}  # policy -> {"lo", "success", "since"}

    def _policy(self, policy: str) -> dict[str, Any]:
        return self.policies.setdefault(policy, {"lo": self.cfg.start, "success": None, "since": 0})

    def window(self, policy: str) -> tuple[float, float]:
        lo = self._policy(policy)["lo"]
        return lo, lo + self.cfg.width

    def select(self, prompt: PromptItem, ctx: Context, rng: random.Random) -> Decision:
        if prompt.difficulty is None:
            return KEEP
        lo, hi = self.window(prompt.policy)
        if lo <= prompt.difficulty <= hi:
            return KEEP
        if rng.random() < self.cfg.explore:
            return KEEP
        return drop("curriculum_too_easy" if prompt.difficulty < lo else "curriculum_too_hard")

    def observe(self, group: Group, ctx: Context) -> None:
        c, st = self.cfg, self._policy(group.policy)
        success = sum(r >= c.success_threshold for r in group.rewards) / len(group.samples)
        st["success"] = success if st["success"] is None else (1 - c.ema) * st["success"] + c.ema * success
        st["since"] += 1
        if st["since"] < c.patience:
            return
        if st["success"] >= c.advance_at and st["lo"] < 1.0 - c.width:
            st["lo"], st["since"] = min(st["lo"] + c.step, 1.0 - c.width), 0
        elif c.retreat_at is not None and st["success"] < c.retreat_at and st["lo"] > 0.0:
            st["lo"], st["since"] = max(st["lo"] - c.step, 0.0), 0

    def state(self) -> dict[str, Any]:
        return {"policies": copy.deepcopy(self.policies)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.policies = copy.deepcopy(state["policies"])
