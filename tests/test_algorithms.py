"""Data-algorithm plug-ins, one by one, on hand-checkable cases: types, curators, filters, advantages.

Servers are in test_algorithms_serving.py; config, user plug-ins, the pipeline and state round
trips in test_algorithms_config.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from astraflow.algorithms import (
    AcceptAll,
    Context,
    Curriculum,
    CurriculumConfig,
    DynamicSampling,
    DynamicSamplingConfig,
    FilterSolved,
    FilterSolvedConfig,
    Greso,
    GresoConfig,
    Group,
    Grpo,
    GrpoConfig,
    Length,
    LengthConfig,
    PromptItem,
    RawReward,
    RewardGuard,
    RewardGuardConfig,
    Rloo,
    Sample,
    Staleness,
    StalenessConfig,
)

CTX = Context(now=1000.0, versions={"solver": 10}, max_staleness=2)


def grp(
    rewards: Sequence[float | None],
    *,
    task: str = "t0",
    prompt: str = "p0",
    policy: str = "solver",
    version: int = 10,
    n_tokens: int = 100,
    truncated: bool = False,
    deadline: float | None = None,
) -> Group:
    samples = tuple(
        Sample(f"{task}-{i}", task, prompt, policy, r, version, n_tokens, truncated, 900.0 + i, deadline)
        for i, r in enumerate(rewards)
    )
    return Group(task, prompt, policy, samples)


def item(prompt: str = "p0", difficulty: float | None = None) -> PromptItem:
    return PromptItem(prompt, "solver", difficulty)


# --- types -----------------------------------------------------------------------------------


def test_group_helpers_and_round_trip():
    g = grp([1.0, 0.0, None], version=7, deadline=1200.0)
    assert g.min_version == 7 and g.deadline == 1200.0 and g.created_at == 900.0
    assert g.rewards[:2] == (1.0, 0.0) and math.isnan(g.rewards[2]) and math.isnan(g.reward_std)
    assert grp([1.0, 0.0]).reward_std == 0.5  # population std
    assert Group.from_dict(g.to_dict()).to_dict() == g.to_dict()


def test_group_rejects_empty_and_foreign_samples():
    with pytest.raises(ValueError, match="no samples"):
        Group("t", "p", "solver", ())
    s = grp([1.0], task="other").samples[0]
    with pytest.raises(ValueError, match="does not belong"):
        Group("t", "p", "solver", (s,))


def test_context_invalid_reason():
    assert CTX.invalid_reason(grp([1.0], version=8)) is None  # lag 2 == max_staleness
    assert CTX.invalid_reason(grp([1.0], version=7)) == "stale"  # lag 3
    assert CTX.invalid_reason(grp([1.0], version=7), max_staleness=3) is None
    assert CTX.invalid_reason(grp([1.0], policy="verifier", version=0)) is None  # version unknown
    assert CTX.invalid_reason(grp([1.0], deadline=999.0)) == "expired"


# --- curators --------------------------------------------------------------------------------


def test_accept_all_keeps_everything():
    assert AcceptAll().select(item(), CTX, random.Random(0)).keep


def test_greso_skip_probability_grows_with_zero_variance_streak():
    greso = Greso(GresoConfig(p_easy=0.5, p_hard=0.8, window=1000))
    assert greso.skip_probability("solver", "p0") == 0.0
    expected = [0.5, 0.75, 0.875]  # 1 - 0.5 ** z
    for _z, skip in enumerate(expected, start=1):
        greso.observe(grp([1.0, 1.0, 1.0, 1.0]), CTX)  # all correct: easy
        assert greso.skip_probability("solver", "p0") == pytest.approx(skip)
    greso.observe(grp([1.0, 0.0, 1.0, 1.0]), CTX)  # informative again: streak resets
    assert greso.skip_probability("solver", "p0") == 0.0
    for _ in range(2):
        greso.observe(grp([0.0, 0.0, 0.0, 0.0], prompt="hard"), CTX)  # all wrong: hard
    assert greso.skip_probability("solver", "hard") == pytest.approx(1 - 0.8**2)


def test_greso_skips_at_its_probability_with_reason():
    greso = Greso(GresoConfig(window=1000))
    greso.observe(grp([1.0, 1.0]), CTX)
    greso.observe(grp([1.0, 1.0]), CTX)  # z = 2, p_easy = 0.5: skip 3/4 of the time
    rng = random.Random(1)
    decisions = [greso.select(item(), CTX, rng) for _ in range(4000)]
    skipped = [d for d in decisions if not d.keep]
    assert abs(len(skipped) / 4000 - 0.75) < 0.03
    assert {d.reason for d in skipped} == {"greso_easy"}
    assert all(greso.select(item("new"), CTX, rng).keep for _ in range(100))


def test_greso_adjusts_exploration_toward_targets():
    cfg = GresoConfig(p_easy=0.5, p_hard=0.5, target_easy=0.25, target_hard=0.25, delta=0.1, window=4)
    greso = Greso(cfg)
    # window 1: 3 easy zero-variance of 4 (>= 0.25: skip more easy), 0 hard (< 0.25: skip fewer hard)
    for i, rewards in enumerate([[1, 1], [1, 1], [1, 1], [0, 1]]):
        greso.observe(grp(rewards, prompt=f"p{i}"), CTX)
    assert greso.p["solver"] == pytest.approx({"easy": 0.4, "hard": 0.6})
    # window 2: 1 hard of 4 -> hard ratio 0.25 >= target: p_hard down; no easy -> p_easy up
    for i, rewards in enumerate([[0, 0], [0, 1], [0, 1], [0, 1]]):
        greso.observe(grp(rewards, prompt=f"q{i}"), CTX)
    assert greso.p["solver"] == pytest.approx({"easy": 0.5, "hard": 0.5})
    # many all-easy windows: p_easy sinks to its floor, p_hard rises to its ceiling
    for i in range(4 * 20):
        greso.observe(grp([1, 1], prompt=f"r{i}"), CTX)
    assert greso.p["solver"] == pytest.approx({"easy": cfg.p_min, "hard": cfg.p_max})


def test_greso_holds_zero_variance_share_near_target():
    """Closed loop: 100 prompts always solved, 100 always informative; p_easy must settle so that
    the easy zero-variance share of rolled-out groups sits near target_easy."""
    cfg = GresoConfig(target_easy=0.2, target_hard=0.0, delta=0.02, window=50)
    greso, rng = Greso(cfg), random.Random(0)
    shares = []
    for _epoch in range(60):
        rolled = [p for p in range(200) if greso.select(item(f"p{p}"), CTX, rng).keep]
        for p in rolled:
            greso.observe(grp([1, 1] if p < 100 else [0, 1], prompt=f"p{p}"), CTX)
        shares.append(sum(p < 100 for p in rolled) / len(rolled))
    assert abs(sum(shares[-20:]) / 20 - 0.2) < 0.07


def test_curriculum_window_advances_with_success():
    cfg = CurriculumConfig(start=0.0, width=0.3, step=0.1, ema=0.5, patience=2, advance_at=0.7, explore=0.0)
    cur, rng = Curriculum(cfg), random.Random(0)
    assert cur.select(item(difficulty=0.2), CTX, rng).keep
    assert cur.select(item(difficulty=None), CTX, rng).keep
    assert cur.select(item(difficulty=0.5), CTX, rng).reason == "curriculum_too_hard"
    cur.observe(grp([1.0, 1.0]), CTX)
    assert cur.window("solver") == (0.0, 0.3)  # patience: only one group so far
    cur.observe(grp([1.0, 1.0]), CTX)
    assert cur.window("solver") == pytest.approx((0.1, 0.4))
    assert cur.select(item(difficulty=0.05), CTX, rng).reason == "curriculum_too_easy"
    cur.observe(grp([0.0, 0.0]), CTX)  # success ema 0.5: below advance_at, no retreat configured
    cur.observe(grp([0.0, 0.0]), CTX)
    assert cur.window("solver") == pytest.approx((0.1, 0.4))


def test_curriculum_retreats_and_explores():
    cfg = CurriculumConfig(start=0.5, width=0.2, step=0.1, ema=1.0, patience=1, retreat_at=0.2, explore=0.5)
    cur, rng = Curriculum(cfg), random.Random(3)
    cur.observe(grp([0.0, 0.0]), CTX)
    assert cur.window("solver") == pytest.approx((0.4, 0.6))
    kept = sum(cur.select(item(difficulty=0.9), CTX, rng).keep for _ in range(2000))
    assert abs(kept / 2000 - 0.5) < 0.05


def test_filter_solved_skips_after_k_solved_groups():
    fs, rng = FilterSolved(FilterSolvedConfig(k=2, threshold=0.9)), random.Random(0)
    fs.observe(grp([1.0, 1.0]), CTX)
    assert fs.select(item(), CTX, rng).keep  # one solved group is not enough
    fs.observe(grp([1.0, 0.9]), CTX)
    assert fs.select(item(), CTX, rng) == fs.select(item(), CTX, rng)
    assert fs.select(item(), CTX, rng).reason == "solved"
    fs.observe(grp([1.0, 0.0]), CTX)  # mean 0.5: not solved any more
    assert fs.select(item(), CTX, rng).keep
    fs.observe(grp([1.0, None]), CTX)
    fs.observe(grp([1.0, None]), CTX)  # a missing reward never counts as solved
    assert fs.select(item(), CTX, rng).keep


# --- filters ---------------------------------------------------------------------------------


def test_dynamic_sampling_drops_all_equal_groups():
    ds = DynamicSampling()
    assert ds.keep(grp([1.0, 1.0, 1.0, 1.0]), CTX).reason == "zero_variance"
    assert ds.keep(grp([0.0, 0.0, 0.0]), CTX).reason == "zero_variance"
    assert ds.keep(grp([0.5]), CTX).reason == "zero_variance"  # one sample: no variance
    assert ds.keep(grp([0.0, 1.0, 0.0, 0.0]), CTX).keep
    assert ds.keep(grp([1.0, None]), CTX).keep  # left to reward_guard
    assert DynamicSampling(DynamicSamplingConfig(tolerance=0.01)).keep(grp([0.5, 0.505]), CTX).reason == (
        "zero_variance"
    )


def test_staleness_filter():
    f = Staleness()
    assert f.keep(grp([1.0], version=8), CTX).keep  # lag 2
    assert f.keep(grp([1.0], version=7), CTX).reason == "stale"  # lag 3 > 2
    assert Staleness(StalenessConfig(max_staleness=3)).keep(grp([1.0], version=7), CTX).keep
    assert f.keep(grp([1.0], version=0, policy="verifier"), CTX).keep  # no trainer version yet
    assert f.keep(grp([1.0], deadline=999.0), CTX).reason == "expired"
    assert Staleness(StalenessConfig(check_deadline=False)).keep(grp([1.0], deadline=999.0), CTX).keep


def test_length_filter():
    assert Length().keep(grp([1.0, 0.0], truncated=True), CTX).reason == "truncated"
    assert Length().keep(grp([1.0, 0.0], n_tokens=10**6), CTX).keep  # no max_tokens by default
    capped = Length(LengthConfig(drop_truncated=False, max_tokens=100))
    assert capped.keep(grp([1.0, 0.0], truncated=True, n_tokens=100), CTX).keep
    assert capped.keep(grp([1.0, 0.0], n_tokens=101), CTX).reason == "too_long"


def test_reward_guard():
    guard = RewardGuard()
    for bad in (None, math.nan, math.inf, -math.inf):
        assert guard.keep(grp([1.0, bad]), CTX).reason == "bad_reward"
    assert guard.keep(grp([1.0, -5.0]), CTX).keep
    bounded = RewardGuard(RewardGuardConfig(low=0.0, high=1.0))
    assert bounded.keep(grp([1.0, -5.0]), CTX).reason == "reward_out_of_range"
    assert bounded.keep(grp([1.0, 0.0]), CTX).keep


# --- advantages ------------------------------------------------------------------------------


def test_grpo_by_hand():
    g = grp([1.0, 0.0, 0.0, 1.0])  # mean 0.5
    # unbiased std = sqrt(4 * 0.25 / 3) = 0.57735...; 0.5 / 0.57735 = 0.866025...
    assert Grpo().compute(g) == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    # population std = 0.5 -> +-1 (minus eps)
    assert Grpo(GrpoConfig(unbiased_std=False)).compute(g) == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert Grpo(GrpoConfig(scale="none")).compute(g) == [0.5, -0.5, -0.5, 0.5]  # Dr. GRPO
    assert Grpo().compute(grp([1.0, 1.0, 1.0])) == [0.0, 0.0, 0.0]
    assert Grpo().compute(grp([3.0])) == [0.0]


def test_rloo_by_hand():
    # r_0 = 1: others mean 0 -> 1; r_i = 0: others mean 1/3 -> -1/3
    assert Rloo().compute(grp([1.0, 0.0, 0.0, 0.0])) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert Rloo().compute(grp([2.0, 4.0])) == [-2.0, 2.0]
    assert Rloo().compute(grp([5.0])) == [0.0]


def test_raw_reward_and_bad_rewards_fail_loudly():
    assert RawReward().compute(grp([0.25, 1.0])) == [0.25, 1.0]
    for adv in (Grpo(), Rloo(), RawReward()):
        with pytest.raises(ValueError, match="missing or non-finite reward"):
            adv.compute(grp([1.0, None]))


@given(st.lists(st.floats(-100, 100), min_size=2, max_size=16))
def test_advantages_are_centred(rewards: list[float]):
    g = grp(rewards)
    mean = sum(rewards) / len(rewards)
    n = len(rewards)
    assert sum(Grpo().compute(g)) == pytest.approx(0.0, abs=1e-6)
    assert Rloo().compute(g) == pytest.approx([n / (n - 1) * (r - mean) for r in rewards], abs=1e-6)
