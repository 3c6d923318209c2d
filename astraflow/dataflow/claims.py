"""What a node claims, checked against what the run issued and knows.

A trajectory can hold only values in range and still lie: an answer to a prompt of the node's
choosing under a task's id, or a reward its completion did not earn. The workflow declares what it
knows in advance about each role's trajectories (``registry.Claims``, on its option model), and the
dataflow checks a trajectory of that role against the task it issued (:class:`ClaimCheck`), after
the value checks of ``validate.py``. Each failed check names a code, which becomes the task's fate
``invalid:{code}`` exactly as a value check's does:

| code | the trajectory is turned away when |
|---|---|
| ``prompt_claim`` | its ``prompt_id`` is not the one its task was issued with (or, for a task issued before a |
|  | restart whose message is gone, not one of the run's prompts), or, where the role's prompt is the issued one, |
|  | its ``prompt_ids`` are not that prompt's tokens under the policy's tokenizer |
| ``reward_range`` | its reward lies outside the range the role's reward declares (``rewards.reward_range``) |
| ``reward_claim`` | where the role's reward is the recipe's reward of its completion, scoring the decoded |
|  | completion with the issued task's meta gives another value (or fails) |

Re-scoring is the run's own reward function on the dataflow's side, with the same tokenizer and
the same decoding as a node (``PolicyHandle.decode``). A cheap reward (exact match, math-verify,
reasoning-gym) is scored again for every trajectory; a costly one (``@costly``: tests in a sandbox)
for a share ``dataflow.rescore_costly`` of them, picked by a keyed hash of the trajectory id whose
key the dataflow draws at start, so a node cannot tell which of its answers will be checked.

The checks of a pull run together (:meth:`ClaimCheck.check_all`), so a group's samples share the work they have in
common: a completion its group holds twice (a trained policy repeats its answers) is decoded and scored once, against
each sample's own claim (a reward is a function of the text and the task's meta). An issued prompt is encoded once
per policy and prompt for the run (up to ``PROMPT_CACHE_BYTES`` of tokens per policy: a dataset's every prompt, in
most runs), not once per task.

``dataflow.trust_claims: true`` turns the checks off (a test workflow whose prompts are its own).
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from astraflow.config import Recipe
from astraflow.dataflow.validate import Invalid
from astraflow.models import TextOf
from astraflow.registry import DEFAULT_REWARD_RANGE, REWARDS, WORKFLOWS, Claims
from astraflow.streams.messages import Trajectory
from astraflow.tasks import Problem

FREE = Claims()
REWARD_TOLERANCE = 1e-6  # |claimed − rescored| allowed (relative above 1): float32 sums on one side, float64 on the other
PROMPT_CACHE_BYTES = 64 << 20  # encoded prompts kept, per policy (least recently used dropped beyond it)

Reward = Callable[[str, dict[str, Any]], float]
Scores = dict[tuple[str, int, bytes], "float | str"]  # (policy, id of the problem, completion tokens) -> reward, or why scoring failed


def role_claims(recipe: Recipe) -> dict[str, Claims]:
    """What each policy's trajectories are checked against: the workflow's claims in the order of its roles, the task's
    own policy first, then the others in the recipe's order (as multi-policy workflows pick their partner)."""
    declared: tuple[Claims, ...] = getattr(WORKFLOWS.options(recipe.workflow), "claims", ())
    order = [recipe.primary] + [p for p in recipe.policy_names if p != recipe.primary]
    return {p: declared[i] if i < len(declared) else FREE for i, p in enumerate(order)}


def reward_matches(claimed: float, scored: float) -> bool:
    return abs(claimed - scored) <= REWARD_TOLERANCE * max(1.0, abs(scored))


def sampled(key: bytes, traj_id: str, share: float) -> bool:
    """Whether ``traj_id`` is among the ``share`` picked: a keyed hash read as a number in [0, 1)."""
    if share >= 1.0:
        return True
    h = hashlib.blake2b(traj_id.encode(), key=key, digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 < share


@dataclass
class ClaimCost:
    """What the checks cost: trajectories checked and rescored, and the seconds spent on each."""

    checked: int = 0
    rescored: int = 0
    check_s: float = 0.0
    rescore_s: float = 0.0
    by_code: dict[str, int] = field(default_factory=dict)


class ClaimCheck:
    """The claims of a run's trajectories, checked against the prompts it issues (:meth:`check`; no I/O)."""

    def __init__(self, recipe: Recipe, problems: Sequence[Problem], key: bytes | None = None) -> None:
        self.roles = role_claims(recipe)
        self.problems: dict[str, list[Problem]] = {}  # prompt_id -> the run's problems of that id (a jsonl may repeat one)
        for p in problems:
            self.problems.setdefault(p.prompt_id, []).append(p)
        self.reward: Reward = REWARDS.get(recipe.reward)
        self.range: tuple[float, float] = getattr(self.reward, "value_range", DEFAULT_REWARD_RANGE)
        self.share = recipe.dataflow.rescore_costly if getattr(self.reward, "costly", False) else 1.0
        self.texts = {p: TextOf(recipe.policies[p].model.tokenizer) for p in recipe.policy_names}
        self.key = key if key is not None else secrets.token_bytes(16)
        self._prompts: dict[str, OrderedDict[str, bytes]] = {p: OrderedDict() for p in recipe.policy_names}
        self._prompt_bytes: dict[str, int] = dict.fromkeys(recipe.policy_names, 0)
        self.cost = ClaimCost()

    def check(self, t: Trajectory, issued: str | None, scores: Scores | None = None) -> Invalid | None:
        """``t``'s claims (its values already checked), against the ``prompt_id`` its task was issued with (None: not
        known, a task issued before a restart whose message the TASK stream no longer holds). ``scores``: completions
        scored so far in this pull (:meth:`check_all`)."""
        start = time.perf_counter()
        try:
            return self._check(t, issued, {} if scores is None else scores)
        finally:
            self.cost.checked += 1
            self.cost.check_s += time.perf_counter() - start

    def check_all(self, items: Sequence[tuple[Trajectory, str | None]]) -> list[Invalid | None]:
        """:meth:`check` for each ``(trajectory, issued prompt_id)``, a completion scored once however many samples
        hold it; counted per code in ``cost.by_code``."""
        scores: Scores = {}
        out = [self.check(t, issued, scores) for t, issued in items]
        for bad in out:
            if bad is not None:
                self.cost.by_code[bad.code] = self.cost.by_code.get(bad.code, 0) + 1
        return out

    def _check(self, t: Trajectory, issued: str | None, scores: Scores) -> Invalid | None:
        claims = self.roles.get(t.policy, FREE)
        if issued is not None and t.prompt_id != issued:
            return Invalid("prompt_claim", f"prompt_id {t.prompt_id[:80]!r}, its task was issued with {issued!r}")
        candidates = self.problems.get(t.prompt_id)
        if not candidates:
            return Invalid("prompt_claim", f"prompt_id {t.prompt_id[:80]!r} is not one of the run's prompts")
        if claims.prompt == "issued":
            candidates = [p for p in candidates if t.prompt_ids == self.prompt_tokens(t.policy, p)]
            if not candidates:
                n = len(t.prompt_ids) // 4
                return Invalid("prompt_claim", f"{n} prompt tokens that are not the tokens of prompt {t.prompt_id[:80]!r}")
        problem = candidates[0]
        if t.reward is None or claims.reward == "free":  # an explicit failure carries no reward
            return None
        low, high = claims.reward_range or self.range
        if not low <= t.reward <= high:
            return Invalid("reward_range", f"reward {t.reward:g} outside [{low:g}, {high:g}], the range of the reward")
        if claims.reward == "rescored" and sampled(self.key, t.traj_id, self.share):
            return self.rescore(t, problem, scores)
        return None

    def rescore(self, t: Trajectory, problem: Problem, scores: Scores) -> Invalid | None:
        """The recipe's reward of ``t``'s decoded completion and the issued ``problem``'s meta, against the reward it
        claims. ``scores``: what the completions scored so far in this pull, by policy, problem and completion tokens:
        one already there is not scored again."""
        start = time.perf_counter()
        key = (t.policy, id(problem), t.completion_ids)
        scored = scores.get(key)
        if scored is None:
            try:
                text = self.texts[t.policy].decode_text(t.completion().tolist())
                scored = float(self.reward(text, dict(problem.meta)))
            except Exception as e:  # what a node's own scoring would have failed on: not a reward it earned
                scored = f"scoring its completion again raised {type(e).__name__}: {str(e)[:200]}"
            scores[key] = scored
        self.cost.rescored += 1
        self.cost.rescore_s += time.perf_counter() - start
        if isinstance(scored, str):
            return Invalid("reward_claim", scored)
        assert t.reward is not None
        if not (math.isfinite(scored) and reward_matches(t.reward, scored)):
            return Invalid("reward_claim", f"reward {t.reward:g} claimed, its completion scores {scored:g}")
        return None

    def prompt_tokens(self, policy: str, problem: Problem) -> bytes:
        """The issued prompt's tokens as the wire packs them (``<i4``), encoded once per policy and prompt."""
        cache = self._prompts[policy]
        ids = cache.get(problem.prompt)
        if ids is None:
            ids = cache[problem.prompt] = np.asarray(self.texts[policy].encode_prompt(problem.prompt), "<i4").tobytes()
            self._prompt_bytes[policy] += len(ids)
            while self._prompt_bytes[policy] > PROMPT_CACHE_BYTES and len(cache) > 1:
                self._prompt_bytes[policy] -= len(cache.popitem(last=False)[1])
        else:
            cache.move_to_end(problem.prompt)
        return ids
