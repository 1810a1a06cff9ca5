"""Metropolis-Hastings operator selection against its closed form, and the uniform ablation."""
import mlflow_di  # noqa: F401
import numpy as np
import pytest
from scipy.stats import chisquare

from mlflow_di.fuzz.selection import (MetropolisHastingsSelector, OperatorStats, UniformSelector,
                                      acceptance_probabilities, rank_distribution, ranking)

DRAWS = 20_000


def _stats_with_ranks(count: int) -> OperatorStats:
    """Counters whose rank values are all different: operator i has value (i + 1) / 10,
    so the ranking (best first) is count-1, ..., 1, 0."""
    selected = np.full(count, 10)
    return OperatorStats(selected=selected, accepted=np.arange(1, count + 1))


def _frequencies(selector, previous: int, stats: OperatorStats, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picks = [selector.next(previous, stats, rng) for _ in range(DRAWS)]
    return np.bincount(picks, minlength=selector.count)


def test_closed_form_by_hand():
    # 7 operators, previous at rank 3: ranks 0..3 always accepted, then (6/7)^(k-3)
    accept = acceptance_probabilities(7, 3)
    np.testing.assert_allclose(accept, [1, 1, 1, 1, 6 / 7, (6 / 7) ** 2, (6 / 7) ** 3])
    np.testing.assert_allclose(rank_distribution(7, 3), accept / accept.sum())
    # reference bug: k_prev = -1 makes every rank geometric in (1 - p)
    np.testing.assert_allclose(rank_distribution(7, -1), (6 / 7) ** np.arange(7) / ((6 / 7) ** np.arange(7)).sum())


@pytest.mark.parametrize("previous", [0, 3, 6])
def test_metropolis_hastings_frequencies_match_closed_form(previous):
    count = 7
    stats = _stats_with_ranks(count)
    order = np.arange(count)[::-1]  # operator at rank k
    previous_rank = int(np.flatnonzero(order == previous)[0])
    counts = _frequencies(MetropolisHastingsSelector(count), previous, stats)
    expected = rank_distribution(count, previous_rank)[np.argsort(order)] * DRAWS  # per operator index
    assert chisquare(counts, expected).pvalue > 1e-3
    # the previous operator's rank matters: the best operator is picked more when previous is bad
    assert (counts[count - 1] / DRAWS) == pytest.approx(rank_distribution(count, previous_rank)[0], abs=0.015)


def test_previous_operator_changes_the_distribution():
    stats = _stats_with_ranks(7)
    after_best = _frequencies(MetropolisHastingsSelector(7), 6, stats)   # previous at rank 0
    after_worst = _frequencies(MetropolisHastingsSelector(7), 0, stats)  # previous at rank 6
    # after the worst-ranked operator every proposal is accepted: uniform
    assert chisquare(after_worst, np.full(7, DRAWS / 7)).pvalue > 1e-3
    # after the best-ranked one, the worst operator (index 0, rank 6) drops to (6/7)^6 / sum_k (6/7)^k
    assert after_best[0] / DRAWS == pytest.approx(rank_distribution(7, 0)[6], abs=0.01)
    assert rank_distribution(7, 0)[6] < 0.65 / 7


def test_reference_bug_ignores_the_previous_operator():
    stats = _stats_with_ranks(7)
    selector = MetropolisHastingsSelector(7, reference_bug=True)
    expected = rank_distribution(7, -1)[np.argsort(np.arange(7)[::-1])] * DRAWS
    for previous in (0, 6):
        assert chisquare(_frequencies(selector, previous, stats), expected).pvalue > 1e-3


def test_ties_are_broken_at_random():
    rng = np.random.default_rng(0)
    firsts = np.bincount([ranking(np.zeros(5), rng)[0] for _ in range(5000)], minlength=5)
    assert chisquare(firsts).pvalue > 1e-3
    np.testing.assert_array_equal(ranking(np.array([0.1, 0.9, 0.5]), rng), [1, 2, 0])


def test_rank_value_counts_successes_per_selection():
    stats = OperatorStats(selected=np.array([0, 4, 10]), accepted=np.array([0, 1, 10]))
    np.testing.assert_allclose(stats.rank_values(), [0.0, 0.25, 1.0], atol=1e-6)


def test_uniform_selector_is_uniform():
    counts = _frequencies(UniformSelector(7), 3, _stats_with_ranks(7))
    assert chisquare(counts).pvalue > 1e-3


def test_first_operator_is_uniform():
    rng = np.random.default_rng(0)
    counts = np.bincount([MetropolisHastingsSelector(7).first(rng) for _ in range(7000)], minlength=7)
    assert chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("reference_bug", [False, True])
@pytest.mark.parametrize("count", [1, 2, 7])
def test_choosing_for_many_searches_at_once_is_choosing_for_each_alone(count, reference_bug):
    # a step's searches choose together (next_many): the same choices and the same draws from each generator
    selector = MetropolisHastingsSelector(count, reference_bug)
    rng = np.random.default_rng(count)
    for trial in range(200):
        stats = [OperatorStats(rng.integers(0, 30, count), rng.integers(0, 10, count)) for _ in range(33)]
        if trial % 3 == 0:  # ties everywhere: the ranking's tie-breaks decide
            stats = [OperatorStats(np.zeros(count, np.int64), np.zeros(count, np.int64)) for _ in stats]
        previous = rng.integers(0, count, len(stats)).tolist()
        together = [np.random.default_rng([trial, i]) for i in range(len(stats))]
        alone = [np.random.default_rng([trial, i]) for i in range(len(stats))]
        chosen = selector.next_many(previous, stats, together)
        assert chosen == [selector.next(p, s, r) for p, s, r in zip(previous, stats, alone)]
        assert [r.random() for r in together] == [r.random() for r in alone]


def test_a_search_whose_first_round_keeps_no_proposal_draws_more_rounds_as_alone():
    # with the previous operator ranked first, every other rank is kept with probability < 1: a generator
    # whose first eight proposals all fail happens, and must go on drawing exactly as next() does
    selector = MetropolisHastingsSelector(7)
    stats = _stats_with_ranks(7)
    late = 0
    for seed in range(3000):
        draws = np.random.default_rng(seed).random(7 + 16)
        ranks = (draws[7::2] * 7).astype(int)
        if not (draws[8::2] < np.array(selector._acceptance[1])[ranks]).any():
            late += 1
            assert selector.next_many([6], [stats], [np.random.default_rng(seed)]) == [
                selector.next(6, stats, np.random.default_rng(seed))]
    assert late > 0


def test_uniform_choices_for_many_are_each_search_s_own():
    selector = UniformSelector(5)
    together = [np.random.default_rng(i) for i in range(10)]
    alone = [np.random.default_rng(i) for i in range(10)]
    assert selector.next_many([0] * 10, [None] * 10, together) == [selector.next(0, None, r) for r in alone]
