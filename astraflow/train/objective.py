"""What one optimizer step minimises: the recipe's policy loss plus the KL penalty.

One step = one batch, split into micro-batches whose gradients accumulate. Every micro-batch
loss is normalised by the *whole batch's* token (or sequence) count, so the micro-batch losses
and their gradients sum to exactly the full-batch loss, however the batch was split. The policy
loss is whichever ``trainer.loss`` names (``losses/registry.py``); a keep mask it takes over the
whole batch (M2PO's) is computed once (:meth:`Objective.plan`) and sliced to each micro-batch.

π_θ is the model being trained, π_behave the rollout engine that sampled the tokens (the
logprobs carried in the batch), π_prox the trust-region anchor of decoupled PPO (π_behave, or
π_θ before this step with ``recompute_prox``), π_ref the frozen version-0 policy of the KL term.

Tokens are checked against the model before they move it: a row whose behaviour logprobs the
policy's own contradict, gap = mean over its trained tokens of |log π_θ − log π_behave| above
``trainer.max_logprob_gap``, is left out of the step (its mask zeroed; the batch's normalisers
keep counting it, so the step is that much smaller) and counted in ``suspect_trajectories``.
Tokens a node fabricated, or logprobs it made up, show a gap of nats per token; honest ones,
sampled within the staleness window, a small fraction of one (``logprob_gap_max`` per step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from astraflow.config import TrainerConfig
from astraflow.train.batching import Tensors
from astraflow.train.losses.functional import LossOutput, kl_penalty
from astraflow.train.losses.registry import build_loss

SUMMED = ("loss", "pg_loss", "kl", "suspect_trajectories")  # micro-batch values add up to the batch's


@dataclass(frozen=True)
class StepPlan:
    """Whole-batch statistics every micro-batch of a step shares."""

    n_tokens: float  # counted tokens in the batch (token-mean normaliser)
    n_seqs: float  # sequences with a counted token (seq-mean normaliser)
    kept_tokens: float  # counted tokens the loss's keep mask keeps (the policy loss's normaliser); no mask: = n_tokens
    kept_seqs: float
    keep: torch.Tensor | None  # (B, T) bool keep mask over the full batch (m2po); None: every counted token


class Objective:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.policy_loss = build_loss(cfg.loss)

    @property
    def needs_logprobs_first(self) -> bool:
        """True when the plan needs π_θ's logprobs of the whole batch before any backward (M2PO)."""
        return self.policy_loss.needs_batch_logprobs

    def plan(self, full: Tensors, logprobs: torch.Tensor | None = None) -> StepPlan:
        """``logprobs`` (B, T): log π_θ of the full batch, detached (when ``needs_logprobs_first``); suspect rows
        (:meth:`without_suspects`) are left out of the keep mask's statistics too."""
        if logprobs is not None:
            full = self.without_suspects(full, logprobs)[0]
        counted = full.mask.bool()  # (B, T)
        n_tokens, n_seqs = _counts(counted)
        keep = self.policy_loss.keep_mask(full, logprobs)  # (B, T) or None
        kept_tokens, kept_seqs = (n_tokens, n_seqs) if keep is None else _counts(counted.to(keep.device) & keep)
        return StepPlan(n_tokens, n_seqs, kept_tokens, kept_seqs, keep)

    def loss(self, mb: Tensors, logprobs: torch.Tensor, plan: StepPlan, ref_logprobs: torch.Tensor | None = None) -> LossOutput:
        """Loss of micro-batch ``mb`` (its share of the batch loss) and its diagnostics.

        ``logprobs`` (b, t) are log π_θ of ``mb``'s completion tokens, differentiable;
        ``ref_logprobs`` (b, t) log π_ref when ``kl_coef`` > 0.
        """
        c = self.cfg
        mb, suspect, gap = self.without_suspects(mb, logprobs.detach())
        keep = None
        if plan.keep is not None:
            keep = plan.keep[mb.rows.to(plan.keep.device)][:, : mb.mask.shape[1]].to(logprobs.device)  # (b, t)
        out = self.policy_loss(mb, logprobs, keep, agg=c.agg, n_tokens=plan.kept_tokens, n_seqs=plan.kept_seqs)
        loss = out.loss
        parts = {"pg_loss": out.loss.detach()}
        if c.kl_coef > 0:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
            kl = kl_penalty(logprobs, ref_logprobs, mb.mask, estimator=c.kl_estimator, agg=c.agg, n_tokens=plan.n_tokens,
                            n_seqs=plan.n_seqs)
            loss = loss + c.kl_coef * kl
            parts["kl"] = kl.detach()
        parts["loss"] = loss.detach()
        parts["suspect_trajectories"] = suspect.sum()
        parts["logprob_gap_max"] = gap.max() if gap.numel() else gap.new_zeros(())
        parts["logprob_gap_mean"] = gap.mean() if gap.numel() else gap.new_zeros(())
        values = torch.stack([v.float() for v in parts.values()]).tolist()
        return LossOutput(loss=loss, metrics={**out.metrics, **dict(zip(parts, values))}, gaps=torch.where(suspect, gap, 0.0))

    def without_suspects(self, x: Tensors, logprobs: torch.Tensor) -> tuple[Tensors, torch.Tensor, torch.Tensor]:
        """``x`` with the mask of its suspect rows zeroed, which rows (b,) bool, and every row's gap (b,)."""
        gap = logprob_gap(logprobs, x.behave_logprobs.to(logprobs.device), x.mask.to(logprobs.device))
        limit = self.cfg.max_logprob_gap
        if limit is None:
            return x, torch.zeros_like(gap, dtype=torch.bool), gap
        suspect = gap > limit  # no host sync on the step's path: the mask is multiplied whether or not a row is suspect
        return replace(x, mask=x.mask * (~suspect).to(x.mask.device, x.mask.dtype).unsqueeze(-1)), suspect, gap


def logprob_gap(logprobs: torch.Tensor, behave: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) mean over each row's counted tokens of |log π_θ − log π_behave| (0 for a row with none)."""
    counted = mask.bool()
    diff = torch.where(counted, (logprobs.float() - behave.float()).abs(), torch.zeros_like(logprobs, dtype=torch.float32))
    return diff.sum(-1) / counted.sum(-1).clamp(min=1)


def combine(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Micro-batch metrics -> batch metrics: loss parts add up, ``*_max`` take the max, the rest
    are means weighted by each micro-batch's counted tokens (the weight in each pair)."""
    if len(parts) == 1:
        return dict(parts[0][0])
    total_w = sum(w for _, w in parts) or 1.0
    out: dict[str, float] = {}
    for key in parts[0][0]:
        vals = [(m[key], w) for m, w in parts if key in m]
        if key in SUMMED:
            out[key] = sum(v for v, _ in vals)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in vals)
        else:
            out[key] = sum(v * w for v, w in vals) / total_w
    return out


def _counts(counted: torch.Tensor) -> tuple[float, float]:
    """(tokens, sequences with a token) of a (B, T) bool mask, at least 1 each (empty batches give 0 loss)."""
    return max(float(counted.sum()), 1.0), max(float((counted.sum(-1) > 0).sum()), 1.0)
