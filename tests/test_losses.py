"""Losses against values worked out by hand from their formulas, on 2 x 3-ish tensors."""

from __future__ import annotations

import math

import pytest
import torch

from astraflow.registry import LOSSES, type_name
from astraflow.train.batching import Tensors
from astraflow.train.losses.functional import (
    LossOutput,
    aggregate,
    decoupled_ppo_loss,
    gather_logprobs,
    kl_penalty,
    m2po_loss,
    m2po_mask,
    ppo_clip_loss,
    token_entropy,
)
from astraflow.train.losses.registry import build_loss

F64 = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def log_t(x) -> torch.Tensor:
    """log of a table of ratios, as a leaf that collects gradients."""
    return torch.tensor(x, dtype=F64).log().requires_grad_(True)


def approx(x, rel=1e-9, abs=1e-9):
    return pytest.approx(x, rel=rel, abs=abs)


def approx_metric(x):
    """Metrics are float32 diagnostics."""
    return pytest.approx(x, rel=1e-6, abs=1e-7)


# --------------------------------------------------------------------------- aggregate


def test_aggregate_modes_by_hand():
    values = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    # token-mean: (1+2+3+4)/4
    assert aggregate(values, mask, "token-mean").item() == approx(2.5)
    # seq-mean-token-mean: ((1+2+3)/3 + 4/1) / 2
    assert aggregate(values, mask, "seq-mean-token-mean").item() == approx(3.0)
    # seq-mean-token-sum: (6 + 4) / 2
    assert aggregate(values, mask, "seq-mean-token-sum").item() == approx(5.0)
    # global normalisers replace the local ones
    assert aggregate(values, mask, "token-mean", n_tokens=10).item() == approx(1.0)
    assert aggregate(values, mask, "seq-mean-token-mean", n_seqs=4).item() == approx(1.5)


def test_aggregate_ignores_empty_sequences_and_nan_at_masked_positions():
    values = t([[1.0, 3.0], [float("nan"), float("inf")]])
    mask = t([[1, 1], [0, 0]])
    assert aggregate(values, mask, "token-mean").item() == approx(2.0)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == approx(2.0)  # S = 1
    assert aggregate(values, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(values, mask, "sum")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- PPO-clip

# ratios r = π_θ/π_old per token, with log π_old = 0 so log π_θ = log r.
RATIOS = [[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]
ADV = t([1.0, -1.0])  # per sequence
MASK = t([[1, 1, 1], [1, 1, 1]])


def test_ppo_clip_both_sides_by_hand():
    lp = log_t(RATIOS)
    out = ppo_clip_loss(lp, torch.zeros_like(lp), ADV, MASK, dual_clip=None)
    assert isinstance(out, LossOutput)
    # A=+1: max(-r, -clip(r,.8,1.28)) = [max(-.5,-.8), -1, max(-1.5,-1.28)] = [-.5, -1, -1.28]
    # A=-1: max(r, clip(r,.8,1.28))   = [max(.5,.8), 1, max(1.5,1.28)]     = [.8, 1, 1.5]
    assert out.loss.item() == approx((-0.5 - 1.0 - 1.28 + 0.8 + 1.0 + 1.5) / 6)
    out.loss.backward()
    # d/dlogπ of -A·r is -A·r; clipped tokens get 0; token-mean divides by 6
    expected = t([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]]) / 6
    torch.testing.assert_close(lp.grad, expected)
    m = out.metrics
    assert m["clip_frac"] == approx_metric(2 / 6)
    assert m["clip_frac_high"] == approx_metric(1 / 6)  # A>0, r=1.5
    assert m["clip_frac_low"] == approx_metric(1 / 6)  # A<0, r=0.5
    assert m["dual_clip_frac"] == 0.0
    # k3 = r - 1 - log r
    k3 = [r - 1 - math.log(r) for r in (0.5, 1.0, 1.5)]
    assert m["approx_kl"] == approx_metric(sum(k3) / 3)
    assert m["ratio_mean"] == approx_metric(1.0)
    assert m["ratio_max"] == approx_metric(1.5)


def test_clip_higher_is_asymmetric():
    # the same 0.25 step either side of 1: inside 1+0.28, outside 1-0.2
    lp = log_t([[1.25], [0.75]])
    out = ppo_clip_loss(lp, torch.zeros_like(lp), t([1.0, -1.0]), t([[1], [1]]), dual_clip=None)
    # A=+1, r=1.25: -1.25 (unclipped);  A=-1, r=0.75: max(.75, .8) = .8 (clipped)
    assert out.loss.item() == approx((-1.25 + 0.8) / 2)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[-1.25 / 2], [0.0]]))
    # symmetric clip (0.2, 0.2) clips the high side too: -1.2
    out_sym = ppo_clip_loss(lp, torch.zeros_like(lp), t([1.0, -1.0]), t([[1], [1]]),
                            clip_high=0.2, dual_clip=None)
    assert out_sym.loss.item() == approx((-1.2 + 0.8) / 2)


def test_dual_clip_bounds_negative_advantage_only():
    lp = log_t([[5.0, 2.0, 1.0], [5.0, 2.0, 1.0]])
    adv = t([-2.0, 2.0])
    out = ppo_clip_loss(lp, torch.zeros_like(lp), adv, MASK, dual_clip=3.0)
    # A=-2: max(2r, 2·clip(r)) = [10, 4, 2]; dual: min(·, 2·3=6) = [6, 4, 2]
    # A=+2: max(-2r, -2·clip(r)) = [-2.56, -2.56, -2]; dual does not apply
    assert out.loss.item() == approx((6 + 4 + 2 - 2.56 - 2.56 - 2) / 6)
    assert out.metrics["dual_clip_frac"] == approx_metric(1 / 6)
    assert out.metrics["clip_frac_high"] == approx_metric(2 / 6)
    assert out.metrics["clip_frac"] == approx_metric(3 / 6)
    out.loss.backward()
    # only the unclipped tokens carry gradient -A·r/6: (A=-2, r=2) and (A=-2, r=1)
    torch.testing.assert_close(lp.grad, t([[0.0, 4.0, 2.0], [0.0, 0.0, -2.0]]) / 6)

    no_dual = ppo_clip_loss(lp, torch.zeros_like(lp), adv, MASK, dual_clip=None)
    assert no_dual.loss.item() == approx((10 + 4 + 2 - 2.56 - 2.56 - 2) / 6)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(lp, torch.zeros_like(lp), adv, MASK, dual_clip=0.5)


def test_per_token_advantages_broadcast_like_per_sequence():
    lp = log_t(RATIOS)
    per_seq = ppo_clip_loss(lp, torch.zeros_like(lp), ADV, MASK).loss
    per_tok = ppo_clip_loss(lp, torch.zeros_like(lp), ADV[:, None].expand(2, 3), MASK).loss
    assert per_tok.item() == approx(per_seq.item())


def test_masked_tokens_have_no_effect_and_no_gradient():
    mask = t([[1, 1, 0], [1, 0, 0]])
    base_lp = log_t([[0.9, 1.1, 1.0], [1.2, 1.0, 1.0]])
    ref = ppo_clip_loss(base_lp, torch.zeros_like(base_lp), ADV, mask).loss.item()
    # garbage where mask == 0: huge log-ratios (exp overflows), -inf, NaN; NaN advantages
    lp = torch.tensor([[math.log(0.9), math.log(1.1), 1000.0],
                       [math.log(1.2), float("nan"), float("-inf")]], dtype=F64,
                      requires_grad=True)
    old = t([[0.0, 0.0, -1000.0], [0.0, 0.0, float("inf")]])
    adv = t([[1.0, 1.0, float("nan")], [-1.0, float("inf"), 5.0]])
    for fn in (
        lambda: ppo_clip_loss(lp, old, adv, mask),
        lambda: decoupled_ppo_loss(lp, old, old, adv, mask),
        lambda: m2po_loss(lp, old, adv, mask, tau=1.0),
    ):
        lp.grad = None
        out = fn()
        assert math.isfinite(out.loss.item())
        assert all(math.isfinite(v) for v in out.metrics.values())
        out.loss.backward()
        assert torch.isfinite(lp.grad).all()
        assert (lp.grad[mask == 0] == 0).all()
    assert ppo_clip_loss(lp, old, adv, mask).loss.item() == approx(ref)
    k = kl_penalty(lp, old, mask, estimator="k3")
    assert math.isfinite(k.item())


@pytest.mark.parametrize("loss", ["ppo", "ppo_no_dual_clip", "decoupled_no_tis_cap", "m2po"])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_a_behaviour_logprob_a_node_may_claim_keeps_the_step_finite(loss: str, adv: float):
    """-1e30 is a finite logprob ≤ 0, so it passes the dataflow's value checks: on a counted token its ratio is capped
    (``LOG_RATIO_MAX``), the loss and gradient stay finite, and the other rows train as they would without the lie."""
    mask = t([[1, 1, 1], [1, 1, 0]])
    advantages = t([adv, 0.5])
    fn = {"ppo": lambda lp, old: ppo_clip_loss(lp, old, advantages, mask),
          "ppo_no_dual_clip": lambda lp, old: ppo_clip_loss(lp, old, advantages, mask, dual_clip=None),
          "decoupled_no_tis_cap": lambda lp, old: decoupled_ppo_loss(lp, old, old, advantages, mask, tis_cap=None),
          "m2po": lambda lp, old: m2po_loss(lp, old, advantages, mask, tau=1e6)}[loss]
    rows = []
    for behave in (-1e30, -2.1):
        lp = torch.full((2, 3), -2.0, dtype=F64, requires_grad=True)
        out = fn(lp, t([[-2.1, behave, -2.1], [-2.1, -2.1, -2.1]]))
        out.loss.backward()
        assert math.isfinite(out.loss.item()) and torch.isfinite(lp.grad).all(), (behave, out.metrics)
        rows.append(lp.grad[1].clone())
    if loss != "m2po":  # M2PO's mask is the whole batch's: one token that far out makes its bound unreachable (finite, still)
        assert torch.equal(rows[0], rows[1])


# --------------------------------------------------------------------------- decoupled PPO / TIS


def test_tis_weight_truncation_by_hand():
    # log π_behave = 0, π_prox/π_behave = [0.5, 1.5, 4], π_θ = π_prox (r = 1)
    prox = t([[0.5, 1.5, 4.0]]).log()
    lp = prox.clone().requires_grad_(True)
    behave = torch.zeros_like(prox)
    mask = t([[1, 1, 1]])
    out = decoupled_ppo_loss(lp, prox, behave, t([1.0]), mask, tis_cap=2.0)
    # w = min([.5, 1.5, 4], 2) = [.5, 1.5, 2];  L = w·(-A·r) = [-.5, -1.5, -2]
    assert out.loss.item() == approx(-4.0 / 3)
    assert out.metrics["tis_weight_mean"] == approx_metric(4.0 / 3)
    assert out.metrics["tis_clipped_frac"] == approx_metric(1 / 3)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[-0.5, -1.5, -2.0]]) / 3)  # -A·r·w / 3

    untruncated = decoupled_ppo_loss(lp, prox, behave, t([1.0]), mask, tis_cap=None)
    assert untruncated.loss.item() == approx(-6.0 / 3)
    assert untruncated.metrics["tis_clipped_frac"] == 0.0


def test_decoupled_clips_around_prox_and_weight_is_detached():
    prox = t([[2.0, 2.0]]).log().requires_grad_(True)  # π_prox/π_behave = 2 (at the cap)
    behave = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    lp = (prox.detach() + t([[1.5, 1.1]]).log()).requires_grad_(True)  # r vs π_prox = [1.5, 1.1]
    out = decoupled_ppo_loss(lp, prox, behave, t([1.0]), t([[1, 1]]), tis_cap=3.0)
    # w = 2; A=+1: [max(-1.5, -1.28), -1.1] = [-1.28, -1.1]
    assert out.loss.item() == approx(2 * (-1.28 - 1.1) / 2)
    assert out.metrics["clip_frac_high"] == approx_metric(0.5)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[0.0, -2 * 1.1 / 2]]))
    assert prox.grad is None and behave.grad is None


def test_decoupled_without_prox_is_ppo_against_behaviour():
    g = torch.Generator().manual_seed(0)
    lp = (0.3 * torch.randn(3, 4, generator=g, dtype=F64)).requires_grad_(True)
    behave = 0.3 * torch.randn(3, 4, generator=g, dtype=F64)
    adv = torch.randn(3, generator=g, dtype=F64)
    mask = (torch.rand(3, 4, generator=g) > 0.3).to(F64)
    dec = decoupled_ppo_loss(lp, None, behave, adv, mask)
    ppo = ppo_clip_loss(lp, behave, adv, mask, dual_clip=None)
    assert dec.loss.item() == approx(ppo.loss.item())
    assert dec.metrics["tis_weight_mean"] == approx_metric(1.0)


# --------------------------------------------------------------------------- M2PO

# log π_behave = 0, so log r = log π_θ.  Position 5 is padding (mask 0) with a huge eligible
# log-ratio that must be ignored.
M2_LOGR = [[0.4, 0.2, -0.1, 0.0, 5.0], [-0.3, 0.1, -0.05, 0.0, -5.0]]
M2_ADV = t([1.0, -1.0])
M2_MASK = t([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])


def test_m2po_mask_masks_exactly_the_largest_eligible_tokens():
    lp = t(M2_LOGR)
    keep = m2po_mask(lp, torch.zeros_like(lp), M2_ADV, M2_MASK, tau=0.01)
    # M2 = (log r)^2: [.16, .04, .01, 0 | .09, .01, .0025, 0], N = 8, mean .0390625 > .01
    # eligible (A>0, r>1 | A<0, r<1): .16, .04 (seq 0); .09, .0025 (seq 1)
    # mask top 1: (.3125-.16)/7 = .0218;  top 2: (.1525-.09)/6 = .0104;  top 3: .0225/5 = .0045
    expected = torch.tensor([[False, False, True, True, False], [False, True, True, True, False]])
    assert torch.equal(keep, expected)
    out = m2po_loss(lp, torch.zeros_like(lp), M2_ADV, M2_MASK, tau=0.01)
    assert out.metrics["m2_before"] == approx_metric(0.3125 / 8)
    assert out.metrics["m2_after"] == approx_metric(0.0225 / 5)
    assert out.metrics["m2_after"] <= 0.01
    assert out.metrics["m2po_masked_frac"] == approx_metric(3 / 8)


def test_m2po_loss_by_hand():
    lp = t(M2_LOGR).requires_grad_(True)
    out = m2po_loss(lp, torch.zeros_like(lp), M2_ADV, M2_MASK, tau=0.01)
    # kept: seq 0 log r [-.1, 0] with A=+1 -> -r;  seq 1 log r [.1, -.05, 0] with A=-1 -> +r
    terms = [-math.exp(-0.1), -1.0, math.exp(0.1), math.exp(-0.05), 1.0]
    assert out.loss.item() == approx(sum(terms) / 5)
    out.loss.backward()
    # no clipping: every kept token gets -A·r / 5, masked-out tokens 0
    expected = t([[0, 0, -math.exp(-0.1), -1.0, 0], [0, math.exp(0.1), math.exp(-0.05), 1.0, 0]])
    torch.testing.assert_close(lp.grad, expected / 5)


def test_m2po_no_masking_when_already_under_tau():
    lp = t([[0.05, -0.05, 0.08], [0.02, 0.0, -0.09]])
    keep = m2po_mask(lp, torch.zeros_like(lp), t([1.0, -1.0]), MASK, tau=0.01)
    assert keep.all()


def test_m2po_never_masks_ineligible_tokens():
    # every ratio moves against its advantage: M2 mean 0.25 > tau, but nothing is eligible
    lp = t([[-0.5, -0.5, 0.0], [0.5, 0.5, 0.0]])
    keep = m2po_mask(lp, torch.zeros_like(lp), t([1.0, -1.0]), MASK, tau=0.01)
    assert keep.all()
    # zero advantage is never eligible either
    keep0 = m2po_mask(lp, torch.zeros_like(lp), t([0.0, 0.0]), MASK, tau=0.01)
    assert keep0.all()
    # mixed: the eligible outlier goes, the larger ineligible one stays (bound unreachable)
    lp2 = t([[1.0, 0.3, 0.0]])
    keep2 = m2po_mask(lp2, torch.zeros_like(lp2), t([-1.0]), t([[1, 1, 1]]), tau=0.01)
    assert keep2.tolist() == [[True, True, True]]  # A<0: r>1 tokens are ineligible
    keep3 = m2po_mask(lp2, torch.zeros_like(lp2), t([1.0]), t([[1, 1, 1]]), tau=0.01)
    assert keep3.tolist() == [[False, False, True]]


# --------------------------------------------------------------------------- gradient accumulation


def _random_batch(seed: int, B: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    lp = (-1.0 + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    behave = old + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(F64)
    mask[:, 0] = 1.0  # no empty sequence
    return lp, old, behave, adv, mask


SPLITS = [slice(0, 1), slice(1, 4), slice(4, 6)]  # uneven micro-batches


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "m2po", "kl"])
def test_micro_batches_with_global_normaliser_sum_to_full_batch(name, agg):
    lp, old, behave, adv, mask = _random_batch(seed=1)

    if name == "ppo":
        def run(s, **kw):
            return ppo_clip_loss(lp[s], old[s], adv[s], mask[s], agg=agg, **kw).loss
        count = mask
    elif name == "decoupled_ppo":
        def run(s, **kw):
            return decoupled_ppo_loss(lp[s], old[s], behave[s], adv[s], mask[s], agg=agg,
                                      **kw).loss
        count = mask
    elif name == "kl":
        def run(s, **kw):
            return kl_penalty(lp[s], old[s], mask[s], agg=agg, **kw)
        count = mask
    else:
        keep = m2po_mask(lp, behave, adv, mask, tau=0.01)  # once, over the full batch
        assert 0 < (mask.bool() & ~keep).sum() < mask.sum()  # the mask is doing something

        def run(s, **kw):
            return m2po_loss(lp[s], behave[s], adv[s], mask[s], keep_mask=keep[s], agg=agg,
                             **kw).loss
        count = (mask.bool() & keep).to(F64)

    full = run(slice(None))  # local normalisers == global ones for the full batch
    (g_full,) = torch.autograd.grad(full, lp)
    n_tokens, n_seqs = count.sum().item(), (count.sum(-1) > 0).sum().item()
    micro = sum(run(s, n_tokens=n_tokens, n_seqs=n_seqs) for s in SPLITS)
    (g_micro,) = torch.autograd.grad(micro, lp)
    assert micro.item() == approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_micro, g_full, rtol=1e-12, atol=1e-12)
    # local normalisation per micro-batch is not the full-batch loss
    local = sum(run(s) for s in SPLITS)
    assert local.item() != approx(full.item(), rel=1e-6)


def test_per_micro_batch_m2po_mask_differs_from_full_batch_mask():
    # tau = .011: seq 0 alone has M2 mean .02 > tau; seq 1 (ratios 1) dilutes it to .01 <= tau
    lp = t([[0.2, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    behave = torch.zeros_like(lp)
    adv, mask = t([1.0, 1.0]), torch.ones_like(lp)
    full_keep = m2po_mask(lp, behave, adv, mask, tau=0.011)
    assert full_keep.all()
    micro_keep = torch.cat([m2po_mask(lp[s], behave[s], adv[s], mask[s], tau=0.011)
                            for s in (slice(0, 1), slice(1, 2))])
    # seq 0 alone: top 1 -> .04/3 = .0133 > .011; top 2 -> 0 <= .011
    assert micro_keep.tolist() == [[False, False, True, True], [True, True, True, True]]

    n_tokens = 8.0  # kept tokens of the full batch
    full = m2po_loss(lp, behave, adv, mask, tau=0.011).loss
    per_micro = sum(m2po_loss(lp[s], behave[s], adv[s], mask[s], tau=0.011, n_tokens=n_tokens).loss
                    for s in (slice(0, 1), slice(1, 2)))
    # full: -(2·e^.2 + 6)/8;  per micro-batch masks: -(2 + 4)/8
    assert full.item() == approx(-(2 * math.exp(0.2) + 6) / 8)
    assert per_micro.item() == approx(-6 / 8)


# --------------------------------------------------------------------------- KL, entropy, logprobs


def test_kl_estimators_by_hand():
    ref = t([[0.0, 0.0, 0.0, 0.0]])
    lp = t([[0.5, -0.5, 1.0, 7.0]])  # d = log π - log π_ref; last token masked
    mask = t([[1, 1, 1, 0]])
    assert kl_penalty(lp, ref, mask, estimator="k1").item() == approx((0.5 - 0.5 + 1.0) / 3)
    assert kl_penalty(lp, ref, mask, estimator="k2").item() == approx((0.125 + 0.125 + 0.5) / 3)
    k3 = [math.exp(-d) + d - 1 for d in (0.5, -0.5, 1.0)]  # [0.10653, 0.14872, 0.36788]
    assert kl_penalty(lp, ref, mask).item() == approx(sum(k3) / 3)
    assert kl_penalty(lp, ref, mask).item() == approx(0.2077105, rel=1e-6)
    with pytest.raises(ValueError, match="k3"):
        kl_penalty(lp, ref, mask, estimator="k4")  # type: ignore[arg-type]


def test_entropy_uniform_is_log_v_and_stable():
    V = 7
    assert torch.allclose(token_entropy(torch.zeros(2, 3, V)), torch.full((2, 3), math.log(V)))
    big = torch.full((1, 2, V), 1e4, dtype=torch.bfloat16)
    assert torch.allclose(token_entropy(big), torch.full((1, 2), math.log(V)))
    # two equal tokens, the rest banned with -inf: log 2, finite gradient
    z = torch.tensor([[[3.0, 3.0, float("-inf"), float("-inf")]]], requires_grad=True)
    h = token_entropy(z)
    assert h.item() == pytest.approx(math.log(2), rel=1e-6)
    h.sum().backward()
    assert torch.isfinite(z.grad).all()
    # one-hot: 0
    assert token_entropy(torch.tensor([[[0.0, -1e9, -1e9]]])).item() == pytest.approx(0.0)


def test_gather_logprobs_matches_log_softmax_in_float32():
    g = torch.Generator().manual_seed(0)
    logits = (5 * torch.randn(2, 3, 11, generator=g)).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    lp = gather_logprobs(logits, ids)
    assert lp.shape == (2, 3) and lp.dtype == torch.float32
    want = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, want)
    lp.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_every_registered_loss_has_an_option_model():
    assert {"ppo", "decoupled_ppo", "m2po"} <= set(LOSSES)  # plug-ins may add more
    assert all(type_name(LOSSES.options(name)) == name for name in LOSSES)


def _micro_batch(lp_behave: list[list[float]], adv: list[float], mask: list[list[int]]) -> Tensors:
    b, T = len(mask), len(mask[0])
    zeros = torch.zeros(b, T, dtype=torch.long)
    return Tensors(input_ids=zeros, attention_mask=zeros, logit_index=zeros, targets=zeros, behave_logprobs=t(lp_behave),
                   mask=torch.tensor(mask), advantages=t(adv), rewards=t(adv), versions=zeros, comp_lens=torch.tensor([T] * b),
                   rows=torch.arange(b))


@pytest.mark.parametrize("options", [
    {"type": "ppo", "clip_low": 0.1, "clip_high": 0.15, "dual_clip": 2.0},
    {"type": "decoupled_ppo", "clip_low": 0.1, "tis_cap": 1.2, "recompute_prox": True},
    {"type": "m2po", "tau": 0.005},
])
def test_registry_dispatches_to_the_loss_with_its_options(options):
    """``trainer.loss`` picks the function and passes its options: the registered loss equals the direct call."""
    mb = _micro_batch([[-1.0, -0.5, -2.0], [-0.7, -0.1, -3.0]], [1.0, -1.0], [[1, 1, 1], [1, 1, 0]])
    logprobs = t([[-0.6, -0.9, -1.5], [-0.2, -0.4, -2.0]]).requires_grad_(True)
    loss = build_loss(LOSSES.parse(options))
    keep = loss.keep_mask(mb, logprobs.detach()) if loss.needs_batch_logprobs else None
    got = loss(mb, logprobs, keep, agg="token-mean", n_tokens=5.0, n_seqs=2.0)
    args = (mb.behave_logprobs, mb.advantages, mb.mask)
    kind = {k: v for k, v in options.items() if k != "type"}
    if options["type"] == "ppo":
        want = ppo_clip_loss(logprobs, *args, **kind, n_tokens=5.0, n_seqs=2.0)
    elif options["type"] == "decoupled_ppo":
        kind.pop("recompute_prox")
        want = decoupled_ppo_loss(logprobs, logprobs.detach(), *args, **kind, n_tokens=5.0, n_seqs=2.0)
    else:
        assert keep is not None and int((keep & mb.mask.bool()).sum()) < int(mb.mask.sum())  # tau this small masks tokens
        want = m2po_loss(logprobs, *args, tau=0.005, keep_mask=m2po_mask(logprobs, *args, tau=0.005), n_tokens=5.0, n_seqs=2.0)
    assert got.loss.item() == pytest.approx(want.loss.item()) and got.metrics == pytest.approx(want.metrics)
