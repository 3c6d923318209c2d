"""greso: skip prompts that keep producing zero-variance groups before rolling them out.

GRESO (Zheng et al. 2025, "Act Only When It Pays: Efficient Reinforcement Learning for LLM
Reasoning via Selective Rollouts", arXiv:2506.02177). A group whose rewards are all equal has
zero advantage and trains nothing; such prompts tend to stay that way, so skip them early.

Per (policy, prompt) we keep ``z``, the number of consecutive most recent observed groups with
zero reward variance (max == min), and the kind of the latest: easy (reward >= easy_threshold,
all correct) or hard (all wrong). With ``p`` the policy's exploration probability of that kind:

    P(skip) = 1 - p ** z            (z = 0: never skipped)

so every further zero-variance round multiplies the chance of another rollout by ``p``. A
skipped prompt keeps its ``z`` (no new evidence); a group with nonzero variance resets it.

``p_easy`` and ``p_hard`` adapt so that the zero-variance share of what is rolled out tracks
its target. After every ``window`` observed groups of a policy, with ``easy_ratio`` the share of
easy zero-variance groups in that window (``hard_ratio`` likewise):

    p_easy <- max(p_easy - delta, p_min)  if easy_ratio >= target_easy   (skip more)
    p_easy <- min(p_easy + delta, p_max)  otherwise                      (skip less)

and the same for ``p_hard``. This is the reference implementation's rule
(github.com/Infini-AI-Lab/GRESO, applied once per training step there; per window of observed
groups here, since the dataflow streams). The defaults are the reference's: p = 0.5,
delta = 0.01, p in [0.05, 0.95], total target 0.25 split 1/3 easy and 2/3 hard.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Literal

from pydantic import Field, model_validator

from astraflow.algorithms.base import CURATORS, AlgoConfig, Curator
from astraflow.algorithms.types import KEEP, Context, Decision, Group, PromptItem, drop


class GresoConfig(AlgoConfig):
    type: Literal["greso"] = "greso"
    p_easy: float = Field(0.5, ge=0.0, le=1.0)
    """Initial exploration probability for prompts whose zero-variance groups were all correct."""
    p_hard: float = Field(0.5, ge=0.0, le=1.0)
    """Initial exploration probability for prompts whose zero-variance groups were all wrong."""
    target_easy: float = Field(0.25 / 3, ge=0.0, le=1.0)
    """Target share of easy zero-variance groups among observed groups."""
    target_hard: float = Field(0.25 * 2 / 3, ge=0.0, le=1.0)
    """Target share of hard zero-variance groups among observed groups."""
    delta: float = Field(0.01, ge=0.0, le=1.0)
    """Step by which p_easy / p_hard move toward their targets after each window."""
    p_min: float = Field(0.05, ge=0.0, le=1.0)
    """Floor of p_easy and p_hard (a prompt is never skipped for good)."""
    p_max: float = Field(0.95, ge=0.0, le=1.0)
    """Ceiling of p_easy and p_hard."""
    window: int = Field(64, ge=1)
    """Observed groups per policy between two adjustments of p_easy / p_hard."""
    easy_threshold: float = 0.5
    """A zero-variance group with reward >= this is easy (all correct), below it hard."""

    @model_validator(mode="after")
    def _check_bounds(self) -> GresoConfig:
        if not self.p_min <= self.p_max:
            raise ValueError(f"p_min ({self.p_min}) must not exceed p_max ({self.p_max})")
        for name in ("p_easy", "p_hard"):
            if not self.p_min <= getattr(self, name) <= self.p_max:
                raise ValueError(f"{name} ({getattr(self, name)}) must lie in [p_min, p_max]")
        return self


@CURATORS.register("greso", GresoConfig)
class Greso(Curator):
    name = "greso"

    def __init__(self, cfg: GresoConfig | None = None) -> None:
        self.cfg = cfg or GresoConfig()
        self.p: dict[str, dict[str, float]] = {}  # policy -> {"easy": p_easy, "hard": p_hard}
        self.window: dict[str, dict[str, int]] = {}  # policy -> counts in the current window
        self.streaks: dict[str, dict[str, list[Any]]] = {}  # policy -> prompt -> [z, kind]

    def probs(self, policy: str) -> dict[str, float]:
        return self.p.setdefault(policy, {"easy": self.cfg.p_easy, "hard": self.cfg.p_hard})

    def skip_probability(self, policy: str, prompt_id: str) -> float:
        z, kind = self.streaks.get(policy, {}).get(prompt_id, (0, "easy"))
        return 1.0 - self.probs(policy)[kind] ** z

    def select(self, prompt: PromptItem, ctx: Context, rng: random.Random) -> Decision:
        streak = self.streaks.get(prompt.policy, {}).get(prompt.prompt_id)
        if streak is None:
            return KEEP
        if rng.random() < self.skip_probability(prompt.policy, prompt.prompt_id):
            return drop(f"greso_{streak[1]}")
        return KEEP

    def observe(self, group: Group, ctx: Context) -> None:
        rewards = group.rewards
        streaks = self.streaks.setdefault(group.policy, {})
        counts = self.window.setdefault(group.policy, {"n": 0, "easy": 0, "hard": 0})
        counts["n"] += 1
        if max(rewards) == min(rewards):  # zero variance (False if any reward is NaN)
            kind = "easy" if rewards[0] >= self.cfg.easy_threshold else "hard"
            z = streaks.get(group.prompt_id, [0, kind])[0]
            streaks[group.prompt_id] = [z + 1, kind]
            counts[kind] += 1
        else:
            streaks.pop(group.prompt_id, None)
        if counts["n"] >= self.cfg.window:
            self._adapt(group.policy, counts)
            counts.update(n=0, easy=0, hard=0)

    def _adapt(self, policy: str, counts: dict[str, int]) -> None:
        p, c = self.probs(policy), self.cfg
        for kind, target in (("easy", c.target_easy), ("hard", c.target_hard)):
            if counts[kind] / counts["n"] >= target:
                p[kind] = max(p[kind] - c.delta, c.p_min)
            else:
                p[kind] = min(p[kind] + c.delta, c.p_max)

    def state(self) -> dict[str, Any]:
        return copy.deepcopy({"p": self.p, "window": self.window, "streaks": self.streaks})

    def load_state(self, state: dict[str, Any]) -> None:
        self.p = {pol: dict(v) for pol, v in state["p"].items()}
        self.window = {pol: dict(v) for pol, v in state["window"].items()}
        self.streaks = {pol: {k: list(v) for k, v in s.items()} for pol, s in state["streaks"].items()}
