"""benchmarks/stats.py: intervals over seeds, the evaluation's standard error, curves read at common x."""

import math
import random
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from stats import Estimate, at, avg_at_k_se, binomial_se, first_reaching, over_seeds, paired


def test_over_seeds_is_the_student_t_interval():
    e = over_seeds([0.40, 0.50, 0.60])
    # mean 0.5, s = 0.1, t_{0.975, 2} = 4.3027: half-width 4.3027 · 0.1 / √3
    assert e.mean == pytest.approx(0.5)
    assert e.half_width == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    assert e.n == 3 and e.low == pytest.approx(0.5 - e.half_width)
    assert over_seeds([0.3, 0.3, 0.3]).half_width == 0.0


def test_over_seeds_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(7)
    covered = 0
    for _ in range(2000):
        e = over_seeds([rng.gauss(1.0, 0.2) for _ in range(3)])
        covered += e.low <= 1.0 <= e.high
    assert 0.93 <= covered / 2000 <= 0.97


def test_one_run_has_no_interval_and_none_is_an_error():
    e = over_seeds([0.42])
    assert e.mean == 0.42 and math.isnan(e.half_width) and e.fmt() == "0.42 (1 run)"
    with pytest.raises(ValueError, match="no values"):
        over_seeds([])


def test_paired_cancels_the_seed_level():
    # seeds differ a lot in level, the variant is 0.05 ahead on every one: unpaired intervals overlap, paired excludes 0
    base, better = [0.2, 0.5, 0.8], [0.26, 0.54, 0.85]
    assert over_seeds(better).overlaps(over_seeds(base))
    d = paired(better, base)
    assert d.mean == pytest.approx(0.05) and d.excludes_zero()
    assert not paired([0.3, 0.5, 0.6], [0.35, 0.45, 0.6]).excludes_zero()
    with pytest.raises(ValueError, match="pair the runs by seed"):
        paired([0.1, 0.2], [0.1])


def test_estimate_overlap_and_format():
    a, b = Estimate(0.5, 0.05, 3), Estimate(0.58, 0.02, 3)
    assert not a.overlaps(b) and not b.overlaps(a)
    assert a.overlaps(Estimate(0.56, 0.02, 3))
    assert a.fmt() == "0.50 ± 0.05" and b.fmt(3) == "0.580 ± 0.020"


def test_binomial_and_avg_at_k_standard_errors():
    assert binomial_se(0.5, 100) == pytest.approx(0.05)
    assert binomial_se(0.5, 500) == pytest.approx(0.02236, rel=1e-3)
    assert binomial_se(0.0, 50) == 0.0
    assert avg_at_k_se(0.5, 500, 4) == pytest.approx(math.sqrt(0.25 / 2000))
    assert avg_at_k_se(0.3, 100, 1) == binomial_se(0.3, 100)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        binomial_se(1.2, 10)
    with pytest.raises(ValueError, match="n=0"):
        binomial_se(0.5, 0)
    with pytest.raises(ValueError, match="k must be"):
        avg_at_k_se(0.5, 10, 0)


def test_avg_at_k_se_bounds_the_simulated_spread():
    rng = random.Random(3)
    q = [rng.random() for _ in range(200)]  # per-prompt probabilities of a right answer, fixed prompts
    p, k = sum(q) / len(q), 4
    evals = [sum(rng.random() < qi for qi in q for _ in range(k)) / (len(q) * k) for _ in range(400)]
    assert statistics.stdev(evals) <= avg_at_k_se(p, len(q), k) * 1.1


def test_curves_read_at_common_x_and_their_crossing():
    xs, ys = [0, 100, 200, 400], [0.3, 0.4, 0.4, 0.6]
    assert at(xs, ys, 50) == pytest.approx(0.35)
    assert at(xs, ys, 300) == pytest.approx(0.5)
    assert at(xs, ys, 400) == 0.6 and at(xs, ys, 0) == 0.3
    assert at(xs, ys, 401) is None and at(xs, ys, -1) is None
    assert first_reaching(xs, ys, 0.5) == pytest.approx(300)
    assert first_reaching(xs, ys, 0.4) == pytest.approx(100)
    assert first_reaching(xs, ys, 0.2) == 0
    assert first_reaching(xs, ys, 0.61) is None
    with pytest.raises(ValueError):
        at([0, 1], [0.1], 0.5)
