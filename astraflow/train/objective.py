"""What one optimizer step minimises: the recipe's policy loss plus the KL penalty.

One step = one batch, split into micro-batches whose gradients accumulate. Every micro-batch
loss is normalised by the *whole batch's* token (or sequence) count, so the micro-batch losses
and their gradients sum to exactly the full-batch loss, however the batch was split. M2PO's
mask is a statistic of the whole batch: it is computed once (:meth:`Objective.plan`) and
sliced to each micro-batch.

π_θ is the model being trained, π_behave the rollout engine that sampled the tokens (the
logprobs carried in the batch), π_prox the trust-region anchor of decoupled PPO (π_behave, or
π_θ before this step with ``recompute_prox``), π_ref the frozen version-0 policy of the KL term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astraflow.config import TrainerConfig
from astraflow.train.batching import Tensors
from astraflow.train.losses import LossOutput, decoupled_ppo_loss, kl_penalty, m2po_loss, m2po_mask, ppo_clip_loss

SUMMED = ("loss", "pg_loss", "kl")  # loss parts: micro-batch values add up to the batch's


@dataclass(frozen=True)
class StepPlan:
    """Whole-batch statistics every micro-batch of a step shares."""

    n_tokens: float  # counted tokens in the batch (token-mean normaliser)
    n_seqs: float  # sequences with a counted token (seq-mean normaliser)
    kept_tokens: float  # m2po: counted tokens the mask keeps; else = n_tokens
    kept_seqs: float
    keep: torch.Tensor | None  # (B, T) bool, m2po keep mask over the full batch


class Objective:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg

    @property
    def needs_logprobs_first(self) -> bool:
        """True when the plan needs π_θ's logprobs of the whole batch before any backward (M2PO)."""
        return self.cfg.loss == "m2po"

    def plan(self, full: Tensors, logprobs: torch.Tensor | None = None) -> StepPlan:
        """``logprobs`` (B, T): log π_θ of the full batch, detached (M2PO only)."""
        counted = full.mask.bool()  # (B, T)
        n_tokens, n_seqs = _counts(counted)
        keep = None
        kept_tokens, kept_seqs = n_tokens, n_seqs
        if self.cfg.loss == "m2po":
            if logprobs is None:
                raise ValueError("m2po needs the full batch's logprobs to plan a step")
            keep = m2po_mask(logprobs, full.behave_logprobs.to(logprobs.device), full.advantages.to(logprobs.device),
                             full.mask.to(logprobs.device), tau=self.cfg.tau)  # (B, T)
            kept_tokens, kept_seqs = _counts(counted.to(keep.device) & keep)
        return StepPlan(n_tokens, n_seqs, kept_tokens, kept_seqs, keep)

    def loss(self, mb: Tensors, logprobs: torch.Tensor, plan: StepPlan, ref_logprobs: torch.Tensor | None = None) -> LossOutput:
        """Loss of micro-batch ``mb`` (its share of the batch loss) and its diagnostics.

        ``logprobs`` (b, t) are log π_θ of ``mb``'s completion tokens, differentiable;
        ``ref_logprobs`` (b, t) log π_ref when ``kl_coef`` > 0.
        """
        c = self.cfg
        n_tokens, n_seqs = plan.n_tokens, plan.n_seqs
        if c.loss == "ppo":
            out = ppo_clip_loss(logprobs, mb.behave_logprobs, mb.advantages, mb.mask, clip_low=c.clip_low,
                                clip_high=c.clip_high, dual_clip=c.dual_clip, agg=c.agg, n_tokens=n_tokens, n_seqs=n_seqs)
        elif c.loss == "decoupled_ppo":
            # one optimizer step per batch: π_θ before the step is this forward's own logprobs
            prox = logprobs.detach() if c.recompute_prox else None
            out = decoupled_ppo_loss(logprobs, prox, mb.behave_logprobs, mb.advantages, mb.mask, clip_low=c.clip_low,
                                     clip_high=c.clip_high, tis_cap=c.tis_cap, agg=c.agg, n_tokens=n_tokens, n_seqs=n_seqs)
        elif c.loss == "m2po":
            assert plan.keep is not None
            keep = plan.keep[mb.rows.to(plan.keep.device)][:, : mb.mask.shape[1]].to(logprobs.device)  # (b, t)
            out = m2po_loss(logprobs, mb.behave_logprobs, mb.advantages, mb.mask, tau=c.tau, keep_mask=keep, agg=c.agg,
                            n_tokens=plan.kept_tokens, n_seqs=plan.kept_seqs)
        else:
            raise ValueError(f"unknown loss {c.loss!r}; use ppo, decoupled_ppo or m2po")
        loss = out.loss
        parts = {"pg_loss": out.loss.detach()}
        if c.kl_coef > 0:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
            kl = kl_penalty(logprobs, ref_logprobs, mb.mask, estimator=c.kl_estimator, agg=c.agg, n_tokens=n_tokens, n_seqs=n_seqs)
            loss = loss + c.kl_coef * kl
            parts["kl"] = kl.detach()
        parts["loss"] = loss.detach()
        values = torch.stack([v.float() for v in parts.values()]).tolist()
        return LossOutput(loss=loss, metrics={**out.metrics, **dict(zip(parts, values))})


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
