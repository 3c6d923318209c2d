"""Policy-gradient losses for LLM RL, written to read like the papers.

Three policies appear in the docstrings:

- π_θ      the *current* policy, the one being optimised (``logprobs``, differentiable);
- π_prox   the *proximal* policy, the trust-region anchor (``old_logprobs`` /
           ``prox_logprobs``: π_θ recomputed before the first optimizer step on a batch);
- π_behave the *behaviour* policy, the rollout engine that sampled the tokens
           (``behave_logprobs``: the per-token logprobs carried in a trajectory).

Conventions: per-token tensors are ``(B, T)`` float; ``mask`` ``(B, T)`` is 1 where the token
counts in the loss (generated tokens only; prompt and tool-output tokens are 0). Every
log-difference is taken under ``torch.where(mask, ·, 0)`` *before* ``exp``, so whatever sits at
masked positions (padding, -inf, NaN) has no effect on the loss and gets exactly zero gradient.
Every log-ratio is also capped at ``LOG_RATIO_MAX`` before ``exp`` (:func:`_log_ratio`): a behaviour logprob a node
claims may be any finite value ≤ 0 (-1e30 among them), and exp of the difference must stay finite, or one such token
makes the step's gradient NaN and the step is lost. A ratio that large is far outside every clip, where the clipped
objectives take no gradient anyway; the cap only keeps inf × 0 out of the backward pass.
π_prox and π_behave logprobs are targets and are detached here. Metrics are local to the call
(masked means over this micro-batch) and come back as floats with a single device sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_MAX = 20.0  # exp(20) ≈ 4.9e8: beyond any clip, and exp() of it times any advantage stays finite in float32
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    metrics: dict[str, float]  # diagnostics, already .item()-ed
    gaps: torch.Tensor | None = None  # (b,) logprob gap of each row the token check left out, 0 for the rest (Objective.loss)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode = "token-mean",
    *,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce per-token ``values`` (B, T) over ``mask`` (B, T) to a scalar.

    - ``token-mean``:          Σ_{b,t} v·m / Σ m                (DAPO / GRPO token-level)
    - ``seq-mean-token-mean``: 1/S Σ_b (Σ_t v·m / Σ_t m)        (original GRPO)
    - ``seq-mean-token-sum``:  1/S Σ_b Σ_t v·m                  (constant per-sequence normaliser)

    S defaults to the number of sequences with at least one counted token.

    Gradient accumulation: pass the *full-batch* ``n_tokens`` (Σ m over the whole batch, for
    token-mean) or ``n_seqs`` (S over the whole batch, for the seq-mean modes). Each
    micro-batch's loss is then its share of the full-batch numerator over the global
    normaliser, so the micro-batch losses (and their gradients) sum to exactly the full-batch
    loss, however the batch was split. Without them each micro-batch normalises locally, and
    the sum (or mean) of micro-batch losses is not the full-batch loss.
    """
    m = mask.to(values.dtype)  # (B, T)
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))  # (B, T)
    if mode == "token-mean":
        denom = m.sum().clamp_min(1.0) if n_tokens is None else n_tokens
        return masked.sum() / denom
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens_per_seq = m.sum(-1)  # (B,)
        per_seq = masked.sum(-1)  # (B,)
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / tokens_per_seq.clamp_min(1.0)  # (B,)
        denom = (tokens_per_seq > 0).sum().clamp_min(1) if n_seqs is None else n_seqs
        return per_seq.sum() / denom
    raise ValueError(
        f"unknown aggregation mode {mode!r}; use 'token-mean', 'seq-mean-token-mean' "
        "or 'seq-mean-token-sum'"
    )


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg: AggMode = "token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> LossOutput:
    """PPO-clip with clip-higher (DAPO) and dual-clip (Ye et al. 2020).

    ``logprobs`` are log π_θ (B, T); ``old_logprobs`` are log π_old (B, T), the proximal
    policy π_prox (equal to π_behave when the trainer does not recompute them). ``advantages``
    are (B,) per sequence or (B, T) per token.

    Metrics (masked means over this call): ``clip_frac`` = tokens whose gradient was cut by any
    clip (= ``clip_frac_low`` + ``clip_frac_high`` + ``dual_clip_frac``, disjoint sets);
    ``approx_kl`` = k3 estimate of KL(π_old ‖ π_θ); ``ratio_mean``; ``ratio_max``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. use 3.0), got {dual_clip}")
    valid = _check(logprobs, mask)
    adv = _per_token(advantages, logprobs, valid)  # (B, T)
    log_ratio = _log_ratio(logprobs, old_logprobs.detach(), valid)  # (B, T) log π_θ/π_old
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_loss, clip_stats = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    loss = aggregate(pg_loss, mask, agg, n_tokens=n_tokens, n_seqs=n_seqs)

    with torch.no_grad():
        metrics = {
            **{k: _masked_mean(v, valid) for k, v in clip_stats.items()},
            # k3: r - 1 - log r, samples from π_old, estimates KL(π_old ‖ π_θ)
            "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, valid),
            "ratio_mean": _masked_mean(ratio, valid),
            "ratio_max": _masked_max(ratio, valid),
        }
    return LossOutput(loss=loss, metrics=_to_floats(metrics))


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor | None,
    behave_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = 2.0,
    agg: AggMode = "token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> LossOutput:
    """Decoupled PPO (Hilton et al. 2022) with truncated importance sampling.

    The trust region is taken around π_prox, the off-policy correction around π_behave:

        r = π_θ / π_prox                       (clipped, carries the gradient)
        w = min(π_prox / π_behave, tis_cap)    (truncated IS weight, detached)
        L = w · max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high))

    ``prox_logprobs=None`` means π_prox = π_behave: then w = 1 and this is plain PPO-clip
    against the behaviour policy (no dual clip). ``tis_cap=None`` disables truncation.

    Metrics: the clip metrics of :func:`ppo_clip_loss` (against π_prox), ``approx_kl``
    (k3 of KL(π_prox ‖ π_θ)), ``tis_weight_mean`` (mean of the truncated w),
    ``tis_clipped_frac`` (fraction of tokens with π_prox/π_behave > tis_cap).
    """
    valid = _check(logprobs, mask)
    behave = behave_logprobs.detach()
    prox = behave if prox_logprobs is None else prox_logprobs.detach()
    adv = _per_token(advantages, logprobs, valid)  # (B, T)
    log_ratio = _log_ratio(logprobs, prox, valid)  # (B, T) log π_θ/π_prox
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_loss, clip_stats = _clipped_surrogate(ratio, adv, clip_low, clip_high, None)
    tis_raw = torch.exp(_log_ratio(prox, behave, valid))  # (B, T) π_prox/π_behave
    tis_weight = tis_raw if tis_cap is None else tis_raw.clamp(max=tis_cap)  # (B, T)
    pg_loss = pg_loss * tis_weight  # (B, T)
    loss = aggregate(pg_loss, mask, agg, n_tokens=n_tokens, n_seqs=n_seqs)

    with torch.no_grad():
        tis_clipped = torch.zeros_like(valid) if tis_cap is None else tis_raw > tis_cap
        metrics = {
            **{k: _masked_mean(v, valid) for k, v in clip_stats.items()},
            "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, valid),
            "ratio_mean": _masked_mean(ratio, valid),
            "ratio_max": _masked_max(ratio, valid),
            "tis_weight_mean": _masked_mean(tis_weight, valid),
            "tis_clipped_frac": _masked_mean(tis_clipped, valid),
        }
    return LossOutput(loss=loss, metrics=_to_floats(metrics))


@torch.no_grad()
def m2po_mask(
    logprobs: torch.Tensor,
    behave_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau: float = 0.01,
) -> torch.Tensor:
    """M2PO keep-mask (B, T) bool (Zheng et al. 2025, second-moment trust policy optimisation).

    With r = π_θ / π_behave and M2 = (log r)² per token, tokens are *eligible* for masking when
    their ratio moves the way their advantage pushes it (A > 0 and r > 1, or A < 0 and r < 1).
    The eligible tokens with the largest M2 are masked, greedily in descending order, until the
    mean of M2 over all kept tokens (eligible or not) is ≤ tau; the smallest such count k is
    taken. If no k reaches the bound (ineligible tokens alone exceed tau) every eligible token
    is masked. Ineligible tokens are never masked.

    Compute this over the WHOLE batch of an optimizer step and pass slices to the micro-batches
    (``m2po_loss(keep_mask=...)``). The reference implementation computes it per micro-batch,
    which makes the mask, and so the update, depend on how the batch was split.
    """
    valid = _check(logprobs, mask)
    adv = _per_token(advantages, logprobs, valid)  # (B, T)
    log_r = _masked_diff(logprobs.detach(), behave_logprobs.detach(), valid).double()  # (B, T)
    m2 = log_r.square()  # (B, T)  M2_i = (log r_i)²
    eligible = valid & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))  # (B, T)

    n = valid.sum()  # N counted tokens
    total = m2.sum()  # Σ M2 over counted tokens (masked positions are 0)
    keep = valid.clone(memory_format=torch.contiguous_format)  # (B, T)
    if n == 0 or total <= tau * n:
        return keep

    flat_idx = eligible.flatten().nonzero().squeeze(-1)  # (E,)
    m2_sorted, order = torch.sort(m2.flatten()[flat_idx], descending=True, stable=True)  # (E,)
    k = torch.arange(1, m2_sorted.numel() + 1, device=m2.device)  # (E,) tokens masked
    # after masking the top k: (Σ M2 - Σ_{j≤k} M2_(j)) / (N - k) ≤ tau
    ok = (total - m2_sorted.cumsum(0)) <= tau * (n - k)  # (E,)
    n_masked = int(ok.int().argmax()) + 1 if bool(ok.any()) else m2_sorted.numel()
    keep.view(-1)[flat_idx[order[:n_masked]]] = False
    return keep


def m2po_loss(
    logprobs: torch.Tensor,
    behave_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau: float = 0.01,
    keep_mask: torch.Tensor | None = None,
    agg: AggMode = "token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> LossOutput:
    """M2PO policy gradient: L = -A · π_θ/π_behave on the tokens kept by :func:`m2po_mask`.

    No ratio clipping: the second-moment mask is the trust region. ``keep_mask`` (B, T) bool is
    the slice of a mask computed once over the full batch; without it the mask is computed over
    the tensors passed in (correct only when they are the full batch). The loss is normalised
    over kept tokens (``mask & keep``); for gradient accumulation pass the full batch's kept
    counts as ``n_tokens`` / ``n_seqs``.

    Metrics: ``m2po_masked_frac`` (masked / counted tokens), ``m2_before`` and ``m2_after``
    (mean (log r)² over counted and over kept tokens), ``ratio_mean``.
    """
    valid = _check(logprobs, mask)
    if keep_mask is None:
        keep_mask = m2po_mask(logprobs, behave_logprobs, advantages, mask, tau=tau)
    elif keep_mask.shape != valid.shape:
        raise ValueError(f"keep_mask shape {tuple(keep_mask.shape)} != mask {tuple(valid.shape)}")
    kept = valid & keep_mask.bool()  # (B, T)
    adv = _per_token(advantages, logprobs, kept)  # (B, T)
    log_ratio = _log_ratio(logprobs, behave_logprobs.detach(), kept)  # (B, T) log π_θ/π_behave
    ratio = torch.exp(log_ratio)  # (B, T)
    pg_loss = -adv * ratio  # (B, T)
    loss = aggregate(pg_loss, kept, agg, n_tokens=n_tokens, n_seqs=n_seqs)

    with torch.no_grad():
        m2 = _masked_diff(logprobs, behave_logprobs, valid).square()  # (B, T)
        metrics = {
            "m2po_masked_frac": _masked_mean(valid & ~kept, valid),
            "m2_before": _masked_mean(m2, valid),
            "m2_after": _masked_mean(m2, kept),
            "ratio_mean": _masked_mean(ratio, kept),
        }
    return LossOutput(loss=loss, metrics=_to_floats(metrics))


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: KLEstimator = "k3",
    agg: AggMode = "token-mean",
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> torch.Tensor:
    """KL(π_θ ‖ π_ref) from tokens sampled by π_θ, Schulman's estimators, aggregated.

    With d = log π_θ - log π_ref:  k1 = d;  k2 = ½ d²;  k3 = exp(-d) + d - 1  (≥ 0, unbiased).
    """
    valid = _check(logprobs, mask)
    log_ratio = _masked_diff(logprobs, ref_logprobs.detach(), valid)  # (B, T) d
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    elif estimator == "k3":
        kl = torch.exp(-log_ratio) + log_ratio - 1.0
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")
    return aggregate(kl, mask, agg, n_tokens=n_tokens, n_seqs=n_seqs)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(π_θ(·|s_t)) = -Σ_v p_v log p_v: (B, T, V) logits -> (B, T), in float32.

    Uses log_softmax (max-shifted), so large logits do not overflow; -inf logits (banned
    tokens) contribute 0 and give no NaN in the forward or backward pass.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    p = logp.exp()  # (B, T, V)
    logp_finite = logp.clamp_min(torch.finfo(logp.dtype).min)  # 0 · -inf -> 0
    return -(p * logp_finite).sum(-1)  # (B, T)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log π_θ(y_t | s_t): (B, T, V) logits, (B, T) ids -> (B, T) float32.

    log p_y = z_y - logsumexp(z), computed in float32 without materialising a second (B, T, V)
    log_softmax tensor (the float32 upcast is the only full-size copy, none for float32 input).
    """
    z = logits.float()  # (B, T, V)
    z_y = z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return z_y - torch.logsumexp(z, dim=-1)  # (B, T)


# --------------------------------------------------------------------------- helpers


def _check(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Validate shapes; return the mask as bool (B, T)."""
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise ValueError(
            f"expected logprobs and mask of the same (B, T) shape, got "
            f"{tuple(logprobs.shape)} and {tuple(mask.shape)}"
        )
    return mask.bool()


def _per_token(advantages: torch.Tensor, like: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) or (B, T) advantages -> (B, T), zero (not NaN) at masked positions."""
    adv = advantages.detach().to(like.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # (B, 1)
    adv = adv.expand_as(like)  # (B, T)
    return torch.where(valid, adv, torch.zeros_like(adv))


def _masked_diff(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """a - b where valid, exactly 0 elsewhere (so exp() of it is finite, its gradient 0)."""
    return torch.where(valid, a - b, torch.zeros_like(a))


def _log_ratio(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log(π_a / π_b) where valid (0 elsewhere), capped at ``LOG_RATIO_MAX`` (no gradient beyond): its exp is finite."""
    return _masked_diff(a, b, valid).clamp(max=LOG_RATIO_MAX)


def _clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip loss (B, T) and its (B, T) bool clip indicators."""
    pg_loss1 = -adv * ratio  # (B, T)
    pg_loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # (B, T)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)  # (B, T) pessimistic bound
    clipped = pg_loss2 > pg_loss1  # (B, T) the clipped branch won: no gradient
    if dual_clip is not None:
        pg_loss3 = -adv * dual_clip  # (B, T) bound for A < 0 and r ≫ 1
        dual = (adv < 0) & (pg_loss3 < pg_loss)  # (B, T)
        pg_loss = torch.where(adv < 0, torch.minimum(pg_loss, pg_loss3), pg_loss)  # (B, T)
    else:
        dual = torch.zeros_like(clipped)
    low = clipped & (ratio < 1.0 - clip_low)  # (B, T) A < 0
    high = clipped & (ratio > 1.0 + clip_high)  # (B, T) A > 0
    stats = {
        "clip_frac": low | high | dual,
        "clip_frac_low": low,
        "clip_frac_high": high,
        "dual_clip_frac": dual,
    }
    return pg_loss, stats


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)
    return torch.where(valid, x, torch.zeros_like(x)).sum() / valid.sum().clamp_min(1)


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Max over valid entries; 0 when there are none."""
    x = x.to(torch.float32)
    if valid.numel() == 0:
        return x.new_zeros(())
    out = torch.where(valid, x, torch.full_like(x, float("-inf"))).max()
    return torch.where(valid.any(), out, torch.zeros_like(out))


def _to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One device sync for all metrics."""
    values = torch.stack([v.reshape(()).float() for v in metrics.values()]).tolist()
    return dict(zip(metrics.keys(), values))
