"""The intervals the gate judges: hand-computed edges, published values, scipy's independent implementations,
and the three outcomes at their edges."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy.stats import binomtest

from mlflow_di import intervals as I


# ------------------------------------------------------------------------------------ one rate
@pytest.mark.parametrize("n", [1, 10, 497, 4000])
def test_clopper_pearson_at_zero_and_at_n_is_the_closed_form(n):
    """0 of n: [0, 1 - (alpha/2)^(1/n)]; n of n: [(alpha/2)^(1/n), 1] (the exact interval's closed forms)."""
    none = I.clopper_pearson(0, n)
    assert none.low == 0.0 and none.high == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-12)
    every = I.clopper_pearson(n, n)
    assert every.high == 1.0 and every.low == pytest.approx(0.025 ** (1 / n), rel=1e-12)
    assert none.n == every.n == n and none.method == I.CLOPPER_PEARSON


def test_zero_disagreements_in_4000_images_prove_at_most_about_0_0009():
    """The issue's example: a bound 'met' with 0 of 4,000 held-out images has proven only this much."""
    assert I.clopper_pearson(0, 4000).high == pytest.approx(0.000922, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), data=st.data())
def test_clopper_pearson_and_wilson_agree_with_scipy(n, data):
    k = data.draw(st.integers(0, n))
    exact = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    ours = I.clopper_pearson(k, n)
    assert ours.low == pytest.approx(exact.low, abs=1e-10) and ours.high == pytest.approx(exact.high, abs=1e-10)
    wilson = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    theirs = I.wilson(k, n)
    assert theirs.low == pytest.approx(wilson.low, abs=1e-10) and theirs.high == pytest.approx(wilson.high, abs=1e-10)
    assert ours.contains(k / n) and theirs.contains(k / n)


def test_a_rate_of_no_sample_is_anything():
    assert (I.clopper_pearson(0, 0).low, I.clopper_pearson(0, 0).high) == (0.0, 1.0)
    with pytest.raises(ValueError):
        I.clopper_pearson(5, 4)


# ------------------------------------------------------------------------------- paired difference
def test_newcombe_paired_interval_matches_the_published_example():
    """Fagerland, Lydersen and Laake, 'Statistical Analysis of Contingency Tables' (2017), Cavo et al. (2012):
    the paired table [[59, 6], [16, 80]], difference -0.0621, Newcombe square-and-add 95% CI -0.1186 to -0.0046."""
    interval = I.paired_difference(59, 6, 16, 80)
    assert (round(interval.low, 4), round(interval.high, 4)) == (-0.1186, -0.0046)
    assert interval.n == 161 and interval.method == I.NEWCOMBE_PAIRED


def test_a_paired_difference_by_hand():
    """Newcombe's method 10 written out for a small table: a=40, b=3 (first only), c=1, d=6 (n 50)."""
    a, b, c, d = 40, 3, 1, 6
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    z = 1.959963984540054

    def wilson(k):
        p = k / n
        centre, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)

    (l1, u1), (l2, u2) = wilson(a + b), wilson(a + c)
    excess = a * d - b * c  # 237 > n/2: corrected by n/2
    phi = (excess - n / 2) / math.sqrt((a + b) * (c + d) * (a + c) * (b + d))
    low = (p1 - p2) - math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    high = (p1 - p2) + math.sqrt((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2)
    ours = I.paired_difference(a, b, c, d)
    assert ours.low == pytest.approx(low, abs=1e-12) and ours.high == pytest.approx(high, abs=1e-12)


def test_no_discordant_pair_gives_an_interval_around_zero():
    interval = I.paired_difference(470, 0, 0, 27)
    assert interval.low < 0 < interval.high and interval.low == pytest.approx(-interval.high, abs=1e-12)


# ------------------------------------------------------------------------------ extremes, means, MOVER
def test_the_extreme_of_several_figures_holds_them_all_at_once():
    """Bonferroni over m figures: each at 1 - alpha/m; the largest's interval spans the extremes of the ends."""
    counts = [(2, 50), (9, 50), (1, 50)]
    index, interval = I.extreme([(k / n, lambda c, k=k, n=n: I.clopper_pearson(k, n, c)) for k, n in counts])
    each = [I.clopper_pearson(k, n, 1 - 0.05 / 3) for k, n in counts]
    assert index == 1 and interval.low == max(i.low for i in each) and interval.high == max(i.high for i in each)
    smallest_index, smallest = I.extreme([(k / n, lambda c, k=k, n=n: I.clopper_pearson(k, n, c)) for k, n in counts],
                                         largest=False)
    assert smallest_index == 2 and smallest.low == min(i.low for i in each) and "Bonferroni over 3" in smallest.method
    alone = I.extreme([(0.1, lambda c: I.clopper_pearson(5, 50, c))])[1]
    assert (alone.low, alone.high) == (I.clopper_pearson(5, 50).low, I.clopper_pearson(5, 50).high)


def test_the_bootstrap_mean_is_seeded_and_needs_two_values():
    queries = [3, 8, 20, 41, 2, 90, 15]
    first, again = I.bootstrap_mean(queries), I.bootstrap_mean(queries)
    assert first == again and first.low < np.mean(queries) < first.high and first.n == 7
    assert I.bootstrap_mean([12]) is None and I.bootstrap_mean([]) is None


def test_mover_with_wilson_intervals_is_newcombes_hybrid_score():
    """Perondi et al. (2004) in the same book: 7 of 34 vs 1 of 34, difference 0.1765, hybrid score 0.0189 to 0.3404."""
    interval = I.mover(7 / 34, I.wilson(7, 34), 1 / 34, I.wilson(1, 34))
    assert (round(interval.low, 4), round(interval.high, 4)) == (0.0189, 0.3404)
    ratio = I.mover(120.0, I.Interval(100.0, 150.0, 40, "b"), 100.0, I.Interval(80.0, 120.0, 40, "b"), kind="ratio")
    assert ratio.low < 1.2 < ratio.high


# ------------------------------------------------------------------------------------ outcomes
@pytest.mark.parametrize("low, high, limit, greater, outcome", [
    (0.01, 0.02, 0.02, False, "PASS"),  # the high end on the limit: all on the right side
    (0.02, 0.03, 0.02, False, "INCONCLUSIVE"),  # the low end on the limit: the limit is still possible
    (0.021, 0.03, 0.02, False, "FAIL"),
    (0.01, 0.03, 0.02, False, "INCONCLUSIVE"),
    (0.5, 0.6, 0.5, True, "PASS"),
    (0.4, 0.5, 0.5, True, "INCONCLUSIVE"),
    (0.4, 0.49, 0.5, True, "FAIL"),
])
def test_three_outcomes_at_their_edges(low, high, limit, greater, outcome):
    assert I.judge(I.Interval(low, high, 100, "t"), (low + high) / 2, limit, greater) == outcome


def test_an_exact_figure_is_judged_by_its_value():
    assert I.judge(None, 0.02, 0.02, False) == "PASS" and I.judge(None, 0.021, 0.02, False) == "FAIL"


def test_a_rate_equal_to_its_limit_is_inconclusive_and_no_sample_decides_it():
    """10 of 500 against 0.02: the interval holds the limit, and at that rate no sample ever moves off it."""
    assert I.judge(I.clopper_pearson(10, 500), 0.02, 0.02, False) == "INCONCLUSIVE"
    assert I.rate_sample_to_decide(10, 500, 0.02, False) is None


def test_the_sample_that_would_decide_a_rate_is_the_first_that_does():
    needed = I.rate_sample_to_decide(5, 497, 0.02, False)
    rate = 5 / 497
    assert I.judge(I.clopper_pearson(round(rate * needed), needed), rate, 0.02, False) == "PASS"
    assert I.judge(I.clopper_pearson(round(rate * (needed - 1)), needed - 1), rate, 0.02, False) == "INCONCLUSIVE"
    assert I.rate_sample_to_decide(0, 400, 0.02, False) == 400  # already decided
    assert I.rate_sample_to_decide(0, 100, 0.02, False) == 183  # 0 of 183: upper end 0.01996


def test_a_bootstrap_figure_needs_about_its_width_squared():
    interval = I.Interval(0.45, 0.65, 1000, "boot")
    assert I.sample_to_decide(interval, 0.55, 0.5, True) == math.ceil(1000 * (0.1 / 0.05) ** 2)
    assert I.sample_to_decide(interval, 0.5, 0.5, True) is None
