"""Statistics for learning benchmarks: a mean over seeds with its 95 % interval, and the evaluation's own error.

Two sources of error sit in every held-out figure, and the benchmarks report both:

- seed to seed: the same recipe with another ``model.seed`` / ``trainer.seed`` (initial weights, warm start,
  sampling) learns a different amount. ``over_seeds`` gives the mean over N seeds and a Student-t interval;
  ``paired`` does the same for per-seed differences between two variants that share the seed (and so the
  warm start), which cancels the seed's own level.
- the evaluation itself: a finite held-out set, and with ``avg@k`` finitely many samples per prompt.
  ``binomial_se`` and ``avg_at_k_se`` give its standard error, to set against the effect being claimed.

Curves from different runs are evaluated at different rollout counts; ``at`` reads each curve at common x by
linear interpolation, and ``first_reaching`` finds where a curve first crosses a bar the same way.
Pure functions; tests in tests/test_bench_stats.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from scipy.stats import t as student_t

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """A mean over ``n`` runs and the half-width of its interval (``nan`` when n < 2: no interval from one run)."""

    mean: float
    half_width: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def overlaps(self, other: Estimate) -> bool:
        return not (self.high < other.low or other.high < self.low)

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def fmt(self, digits: int = 2) -> str:
        if self.n < 2:
            return f"{self.mean:.{digits}f} (1 run)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def over_seeds(values: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """Mean and Student-t interval of independent runs.

    With sample mean m, sample standard deviation s (n - 1 in the denominator) over n runs, the interval is
    m ± t_{(1+c)/2, n-1} · s / √n. It assumes the runs' values are roughly normal; with 3 seeds t = 4.30,
    so the interval is wide unless the runs agree closely.
    """
    if not values:
        raise ValueError("over_seeds: no values")
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return Estimate(mean, math.nan, 1)
    s = statistics.stdev(values)
    return Estimate(mean, float(student_t.ppf((1 + confidence) / 2, n - 1)) * s / math.sqrt(n), n)


def paired(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> Estimate:
    """Mean and t-interval of a_i - b_i, for two variants run on the same seeds (the same warm start per seed).

    The seed's own level cancels in each difference, so this interval is the one that says whether a beats b;
    it excludes zero when the difference is significant at ``confidence``.
    """
    if len(a) != len(b):
        raise ValueError(f"paired: {len(a)} values against {len(b)}: pair the runs by seed")
    return over_seeds([x - y for x, y in zip(a, b, strict=True)], confidence)


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured once on n held-out prompts (greedy): √(p(1-p)/n).

    Each prompt is a Bernoulli draw from the task's distribution of problems; this is the error of p as an
    estimate of the accuracy on that whole distribution (0.05 at p = 0.5, n = 100; 0.022 at n = 500).
    """
    _check(p, n)
    return math.sqrt(p * (1 - p) / n)


def avg_at_k_se(p: float, n: int, k: int) -> float:
    """Upper bound on the sampling error of avg@k = p on a fixed set of n prompts, k samples each: √(p(1-p)/(nk)).

    Prompt i is answered right with probability q_i, so its k samples' mean has variance q_i(1-q_i)/k and avg@k
    has Σ q_i(1-q_i) / (n²k). As q(1-q) is concave, Σ q_i(1-q_i) ≤ n·p(1-p) (p the mean of the q_i), hence the
    bound. This is the error between two evaluations of the same weights on the same prompts; it is what
    separates variants evaluated on one held-out set (their choice of prompts is common to all of them).
    """
    _check(p, n)
    if k < 1:
        raise ValueError(f"avg_at_k_se: k must be >= 1, got {k}")
    return math.sqrt(p * (1 - p) / (n * k))


def _check(p: float, n: int) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"accuracy must be in [0, 1], got {p}")
    if n < 1:
        raise ValueError(f"need at least one prompt, got n={n}")


def at(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """The curve (xs ascending, ys) read at x by linear interpolation; None outside [xs[0], xs[-1]]."""
    if len(xs) != len(ys) or not xs:
        raise ValueError("at: xs and ys must be non-empty and of the same length")
    if x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in pairwise(zip(xs, ys, strict=True)):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def first_reaching(xs: Sequence[float], ys: Sequence[float], bar: float) -> float | None:
    """The smallest x at which the piecewise-linear curve reaches ``bar`` (None if it never does).

    Between evaluated points a and b with y_a < bar ≤ y_b: x = x_a + (bar - y_a)(x_b - x_a)/(y_b - y_a). Reading
    the crossing between points, rather than taking the first evaluated point above the bar, keeps the
    evaluation interval (every N versions) from quantising the answer.
    """
    if len(xs) != len(ys):
        raise ValueError("first_reaching: xs and ys must be of the same length")
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if y >= bar:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (bar - y0) * (x - x0) / (y - y0)
    return None
