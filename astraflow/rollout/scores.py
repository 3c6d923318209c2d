"""Held-out scores from sampled rewards: pass@k and avg@k (shared by the evaluator and team workflows)."""

from __future__ import annotations

import math
from collections.abc import Sequence

PASS_THRESHOLD = 1.0  # a sample "passes" when its reward is at least this


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` passing samples out of ``n``: ``1 - C(n-c, k) / C(n, k)``.

    With ``n == k`` (what the evaluator draws) it is 1 if any sample passed, else 0."""
    if n <= 0 or c <= 0:
        return 0.0
    k = min(k, n)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_metrics(samples: Sequence[Sequence[float]], k: int, threshold: float = PASS_THRESHOLD) -> dict[str, float]:
    """``avg@k`` (mean reward over every sample of every prompt) and ``pass@k`` (mean over prompts of
    :func:`pass_at_k`, a sample passing when its reward >= ``threshold``) from each prompt's sample rewards."""
    rewards = [r for s in samples for r in s]
    if not samples or not rewards:
        return {"avg@k": 0.0, "pass@k": 0.0}
    passes = [pass_at_k(len(s), sum(r >= threshold for r in s), k) for s in samples]
    return {"avg@k": sum(rewards) / len(rewards), "pass@k": sum(passes) / len(passes)}
