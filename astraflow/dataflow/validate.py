"""What a trajectory may hold: the dataflow's value checks, as pure functions (no I/O).

The plane is open: any node may publish any well-formed trajectory. Before a trajectory joins a
group, ingest checks its values against the run (:class:`Limits`, built once from the recipe)
and against its task (:func:`check_versions`). The arrays of a whole pull are reduced at once
(:func:`measure`), so each rule is a scalar comparison. A failed check names one code, which becomes the
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
| ``routing`` | recorded MoE routing (``trainer.routing``) in another layout than the model's layers, top-k and experts, |
|  | an expert id beyond the layer's experts, or one expert twice among a position's top-k |
| ``version`` | a token newer than the policy's newest announced version, a generated token older than its |
|  | task's ``min_versions``, an inserted token below -1 |
| ``payload`` | its arrays, in the object store (a trajectory too large for one message), are gone, fail a digest |
|  | or do not unpack (``ingest.py`` reads them back before these checks) |

**Explicit failure.** A sample whose workflow failed says so with ``finish_reason: "error"`` and
``reward: None``; it is valid, and its group is settled ``filtered:sample_error`` (``land``). A
missing reward with any other finish reason is invalid. So every group that reaches the
curators' statistics, the filters and the advantage has finite rewards, by construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from astraflow.config import Recipe
from astraflow.models import model_limits
from astraflow.streams.messages import Trajectory

MAX_ABS_REWARD = 1e30  # advantages travel as float32 (max ~3.4e38): a reward this size still fits after any built-in advantage
LOGPROB_SLACK = 1e-3  # engines round log-softmax; a logprob this far above 0 is rounding, not a lie
SINGLE_TURN = frozenset({"single_turn", "solver_verifier", "solver_selector", "solver_testgen"})  # one generation per trajectory


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
    max_generated: int | None  # generated (loss_mask 1) tokens: max_new_tokens per turn; None: unbounded turns (an agent)
    max_row: int | None  # prompt + completion (multi-turn: the model's context); None: not checked
    routing: tuple[int | None, int, int] | None = None  # recorded routing's (MoE layers or None: any, top-k, experts)


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
        turns = 1 if single else getattr(recipe.workflow_options, "max_turns", None)  # an agent calls as often as it likes
        out = {}
        for name, p in recipe.policies.items():
            model = model_limits(p.model)
            routing = None
            if p.trainer.routing != "own" and model.experts and model.top_k:
                routing = (model.moe_layers, model.top_k, model.experts)
            out[name] = PolicyLimits(vocab=model.vocab, max_completion=r.max_new_tokens if single else None,
                                     max_generated=r.max_new_tokens * turns if turns else None,
                                     max_row=None if single else model.context, routing=routing)
        return cls(group_size=recipe.dataflow.group_size, policies=out)


@dataclass(frozen=True, slots=True)
class Stats:
    """The extremes the checks read from a trajectory's arrays (ids read as unsigned: a negative id is huge)."""

    n_prompt: int
    n: int  # completion tokens
    prompt_max: int
    ids_max: int  # 0 when there are no completion tokens (so for the rest)
    mask_max: int
    generated: int  # tokens with loss_mask 1
    lp_max: float
    lp_min: float
    v_min: int
    v_max: int


def _segments(raws: list[bytes], dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The arrays of all trajectories end to end, each one's length, and the starts of the non-empty ones."""
    itemsize = np.dtype(dtype).itemsize
    lengths = np.fromiter((len(r) // itemsize for r in raws), np.int64, len(raws))
    starts = np.zeros(len(raws), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.frombuffer(b"".join(raws), dtype), lengths, starts[lengths > 0]


def measure(ts: Sequence[Trajectory]) -> list[Stats]:
    """Stats of every trajectory of a pull at once: one numpy reduction per quantity over the whole pull
    (``reduceat`` over the concatenation), not one per trajectory, which is where per-trajectory time went."""
    if not ts:
        return []
    prompt, n_prompt, p_starts = _segments([t.prompt_ids for t in ts], "<u4")
    ids, n, starts = _segments([t.completion_ids for t in ts], "<u4")
    masks = np.frombuffer(b"".join(t.loss_mask for t in ts), "<u1")
    logprobs = np.frombuffer(b"".join(t.logprobs for t in ts), "<f4")
    versions = np.frombuffer(b"".join(t.versions for t in ts), "<i4")

    def per_traj(ufunc: np.ufunc, values: np.ndarray, acc: type = np.float64) -> list[float]:  # 0 for an empty completion
        out: np.ndarray = np.zeros(len(ts), acc)
        if len(starts):
            out[n > 0] = ufunc.reduceat(values, starts, dtype=acc)
        return list(out.tolist())

    p_max = np.zeros(len(ts), np.int64)
    if len(p_starts):
        p_max[n_prompt > 0] = np.maximum.reduceat(prompt, p_starts)
    columns = (n_prompt.tolist(), n.tolist(), p_max.tolist(), per_traj(np.maximum, ids, np.int64),
               per_traj(np.maximum, masks, np.int64), per_traj(np.add, masks, np.int64),
               per_traj(np.maximum, logprobs), per_traj(np.minimum, logprobs),
               per_traj(np.minimum, versions, np.int64), per_traj(np.maximum, versions, np.int64))
    return [Stats(*row) for row in zip(*columns, strict=True)]


def check_trajectory(t: Trajectory, limits: PolicyLimits, group_size: int, s: Stats | None = None) -> Invalid | None:
    """The checks that need nothing but the trajectory and the run (the first that fails); ``s``: its
    :func:`measure` (computed here when not given)."""
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
    s = s or measure([t])[0]
    if not s.n_prompt:
        return Invalid("prompt", "empty prompt")
    if s.prompt_max >= limits.vocab or s.ids_max >= limits.vocab:
        both = np.concatenate([np.frombuffer(t.prompt_ids, "<i4"), np.frombuffer(t.completion_ids, "<i4")])
        return Invalid("token", f"token ids span [{both.min()}, {both.max()}], the policy's vocabulary is [0, {limits.vocab})")
    if limits.max_completion is not None and s.n > limits.max_completion:
        return Invalid("length", f"{s.n} completion tokens, the limit is {limits.max_completion}")
    if limits.max_row is not None and s.n_prompt + s.n > limits.max_row:
        return Invalid("length", f"{s.n_prompt} + {s.n} tokens, the model's context is {limits.max_row}")
    if s.mask_max > 1:
        return Invalid("mask", f"loss_mask values {sorted(set(t.mask().tolist()))[:4]}, only 0 and 1 mean something")
    if limits.max_completion is None and limits.max_generated is not None and s.generated > limits.max_generated:
        return Invalid("length", f"{s.generated} generated tokens, the limit is {limits.max_generated}")
    if not (s.lp_max <= LOGPROB_SLACK and s.lp_min > -math.inf):  # NaN fails both comparisons
        return Invalid("logprob", f"behaviour logprobs span [{s.lp_min}, {s.lp_max}]; they must be finite and <= 0")
    if t.routing_layout is not None and limits.routing is not None:
        return check_routing(t, *limits.routing)
    return None


def check_routing(t: Trajectory, layers: int | None, top_k: int, experts: int) -> Invalid | None:
    """The recorded routing names ``top_k`` distinct experts below ``experts`` per position and layer (``layers`` of them)."""
    layout = t.routing_layout
    assert layout is not None
    if (layout.top_k, layout.experts) != (top_k, experts) or layers not in (None, layout.layers):
        return Invalid("routing", f"routing of {layout.layers} layers x top-{layout.top_k} of {layout.experts} experts; the "
                                  f"model routes {layers or 'its'} layers x top-{top_k} of {experts}")
    ids = np.sort(layout.ids(t.routing), axis=-1)  # (positions, layers, k)
    if ids.size and int(ids[..., -1].max()) >= experts:
        return Invalid("routing", f"expert id {int(ids.max())}, the layers have {experts} experts")
    if ids.size and top_k > 1 and bool((ids[..., 1:] == ids[..., :-1]).any()):
        return Invalid("routing", "an expert twice among one position's top-k")
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


def check_versions(t: Trajectory, floor: int, newest: int, s: Stats | None = None) -> Invalid | None:
    """Token versions within the window: none newer than ``newest`` (the policy's newest announced
    version), generated ones (``loss_mask`` 1) at least ``floor`` (its task's ``min_versions``), the
    inserted ones at least -1 (tool output before any generated token carries -1)."""
    s = s or measure([t])[0]
    if not s.n:
        return None
    if s.v_max > newest:
        return Invalid("version", f"a token of v{s.v_max}, the newest announced version is v{newest}", ahead=True)
    if s.v_min >= floor:
        return None
    v = t.token_versions()
    generated = v[t.mask() == 1]
    if len(generated) and int(generated.min()) < floor:
        return Invalid("version", f"a generated token of v{int(generated.min())}, the task allows v{floor} or newer")
    if s.v_min < -1:
        return Invalid("version", f"an inserted token of v{s.v_min}")
    return None
