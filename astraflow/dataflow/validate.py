"""What a trajectory may hold: the dataflow's value checks, as pure functions (no I/O).

The plane is open: any node may publish any well-formed trajectory. Before a trajectory joins a
group, ingest checks its values against the run (:class:`Limits`, built once from the recipe)
and against its task (:func:`check_versions`). A failed check names one code, which becomes the
task's fate ``invalid:{code}`` (see ``ingest.py``), and a detail for the dead-letter entry:

| code | the trajectory is turned away when |
|---|---|
| ``traj_id`` | ``traj_id`` is not ``{task_id}.{policy}.{index}`` (one id per sample, so a copy is always the same id) |
| ``index`` | ``index`` is outside ``[0, group_size)`` |
| ``group_size`` | ``group_size`` differs from the run's (every task of the run has ``dataflow.group_size``) |
| ``reward`` | the reward is NaN, infinite, beyond ±1e30, or missing without ``finish_reason: error`` |
| ``time`` | ``created_at`` is not finite |
| ``prompt`` | the prompt is empty |
| ``token`` | a prompt or completion token id lies outside ``[0, vocab)`` of the policy's model |
| ``length`` | single-turn: more than ``max_new_tokens`` completion tokens; multi-turn: more than |
|  | ``max_turns × max_new_tokens`` generated tokens, or prompt + completion longer than the model's context |
| ``logprob`` | a behaviour logprob is NaN, infinite, or above 0 (by more than 1e-3 of rounding) |
| ``mask`` | a ``loss_mask`` value is not 0 or 1 |
| ``version`` | a token newer than the policy's newest announced version, a generated token older than its |
|  | task's ``min_versions``, an inserted token below -1 |

**Explicit failure.** A sample whose workflow failed says so with ``finish_reason: "error"`` and
``reward: None``; it is valid, and its group is settled ``filtered:sample_error`` (``land``). A
missing reward with any other finish reason is invalid. So every group that reaches the
curators' statistics, the filters and the advantage has finite rewards, by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from astraflow.config import Recipe
from astraflow.models import model_limits
from astraflow.streams.messages import Trajectory

MAX_ABS_REWARD = 1e30  # advantages travel as float32 (max ~3.4e38): a reward this size still fits after any built-in advantage
LOGPROB_SLACK = 1e-3  # engines round log-softmax; a logprob this far above 0 is rounding, not a lie
SINGLE_TURN = frozenset({"single_turn", "solver_verifier", "solver_selector", "solver_testgen"})  # one generation per trajectory
_U4 = np.dtype("<u4")


@dataclass(frozen=True)
class Invalid:
    code: str  # the fate suffix: ``invalid:{code}``
    detail: str  # for the dead-letter entry
    ahead: bool = False  # a token version newer than the newest known (worth confirming on the plane first)

    @property
    def reason(self) -> str:
        return f"invalid {self.code}: {self.detail}"


@dataclass(frozen=True)
class PolicyLimits:
    vocab: int  # token ids lie in [0, vocab)
    max_completion: int | None  # completion tokens (single-turn: max_new_tokens); None: bounded by the two below
    max_generated: int  # generated (loss_mask 1) tokens: max_new_tokens per turn
    max_row: int | None  # prompt + completion (multi-turn: the model's context); None: not checked


@dataclass(frozen=True)
class Limits:
    """What any trajectory of the run may hold, per policy."""

    group_size: int
    policies: Mapping[str, PolicyLimits]

    @classmethod
    def of(cls, recipe: Recipe) -> Limits:
        """From the recipe: the model of each policy (``models.model_limits``) and the rollout's budgets."""
        r = recipe.rollout
        single = recipe.workflow in SINGLE_TURN
        out = {}
        for name, p in recipe.policies.items():
            model = model_limits(p.model)
            out[name] = PolicyLimits(vocab=model.vocab, max_completion=r.max_new_tokens if single else None,
                                     max_generated=r.max_new_tokens * (1 if single else r.max_turns),
                                     max_row=None if single else model.context)
        return cls(group_size=recipe.dataflow.group_size, policies=out)


def check_trajectory(t: Trajectory, limits: PolicyLimits, group_size: int) -> Invalid | None:
    """The checks that need nothing but the trajectory and the run (the first that fails)."""
    if t.traj_id != f"{t.task_id}.{t.policy}.{t.index}":
        return Invalid("traj_id", f"traj_id {t.traj_id!r} is not {t.task_id}.{t.policy}.{t.index}")
    if t.group_size != group_size:
        return Invalid("group_size", f"group_size {t.group_size}, the run's tasks have {group_size}")
    if not 0 <= t.index < group_size:
        return Invalid("index", f"index {t.index} outside [0, {group_size})")
    bad = _reward(t)
    if bad is not None:
        return bad
    if not math.isfinite(t.created_at):
        return Invalid("time", f"created_at {t.created_at}")
    prompt, ids = np.frombuffer(t.prompt_ids, _U4), np.frombuffer(t.completion_ids, _U4)  # negative ids read as huge
    n = len(ids)
    if not len(prompt):
        return Invalid("prompt", "empty prompt")
    if prompt.max() >= limits.vocab or (n and ids.max() >= limits.vocab):
        both = np.concatenate([prompt, ids]).view("<i4")
        return Invalid("token", f"token ids span [{both.min()}, {both.max()}], the policy's vocabulary is [0, {limits.vocab})")
    if limits.max_completion is not None and n > limits.max_completion:
        return Invalid("length", f"{n} completion tokens, the limit is {limits.max_completion}")
    if limits.max_row is not None and len(prompt) + n > limits.max_row:
        return Invalid("length", f"{len(prompt)} + {n} tokens, the model's context is {limits.max_row}")
    if not n:
        return None
    mask = np.frombuffer(t.loss_mask, np.uint8)
    if mask.max() > 1:
        return Invalid("mask", f"loss_mask values {sorted(set(mask.tolist()))[:4]}, only 0 and 1 mean something")
    if limits.max_completion is None and (generated := int(mask.sum())) > limits.max_generated:
        return Invalid("length", f"{generated} generated tokens, the limit is {limits.max_generated}")
    lp = np.frombuffer(t.logprobs, "<f4")
    hi, lo = lp.max(), lp.min()
    if not (hi <= LOGPROB_SLACK and lo > -np.inf):  # NaN fails both comparisons
        return Invalid("logprob", f"behaviour logprobs span [{lo}, {hi}]; they must be finite and <= 0")
    return None


def _reward(t: Trajectory) -> Invalid | None:
    r = t.reward
    if r is None:
        if t.finish_reason == "error":  # an explicit failure
            return None
        return Invalid("reward", f"no reward, finish_reason {t.finish_reason!r} (only 'error' may omit it)")
    if not (math.isfinite(r) and abs(r) <= MAX_ABS_REWARD):
        return Invalid("reward", f"reward {r} is not a finite number within ±{MAX_ABS_REWARD:g}")
    return None


def check_versions(t: Trajectory, floor: int, newest: int) -> Invalid | None:
    """Token versions within the window: none newer than ``newest`` (the policy's newest announced
    version), generated ones (``loss_mask`` 1) at least ``floor`` (its task's ``min_versions``), the
    inserted ones at least -1 (tool output before any generated token carries -1)."""
    v = np.frombuffer(t.versions, "<i4")
    if not len(v):
        return None
    lo, hi = int(v.min()), int(v.max())
    if hi > newest:
        return Invalid("version", f"a token of v{hi}, the newest announced version is v{newest}", ahead=True)
    if lo >= floor:
        return None
    generated = v[np.frombuffer(t.loss_mask, np.uint8) == 1]
    if len(generated) and int(generated.min()) < floor:
        return Invalid("version", f"a generated token of v{int(generated.min())}, the task allows v{floor} or newer")
    if lo < -1:
        return Invalid("version", f"an inserted token of v{lo}")
    return None
