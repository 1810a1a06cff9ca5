"""The bounded int8 search (compression/bounded.py): the search on hand-made and random measure
functions, the binomial upper bound against scipy's own exact interval, and the bounds' checks."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mlflow_di.compression.bounded import (
    Bounds,
    BoundedSearch,
    Scores,
    UnreachableBounds,
    clopper_pearson_upper,
    scores,
    search_float_layers,
)
from mlflow_di.errors import UserError

IMAGES = 1000


def additive(costs: dict, interactions: dict | None = None):
    """A measure: each quantized layer adds its cost in disagreements (and a pair its interaction), and
    records which sets were asked for."""
    asked = []

    def measure(kept):
        asked.append(frozenset(kept))
        quantized = [name for name in costs if name not in kept]
        total = sum(costs[name] for name in quantized)
        total += sum(extra for pair, extra in (interactions or {}).items() if set(pair) <= set(quantized))
        return Scores(IMAGES, total, 900, 900)

    return measure, asked


def test_a_hand_computed_search_walks_all_int8_all_but_one_bisection_then_elimination():
    # ranked worst first; c is needed, a is not (the ranking is misleading on purpose), b and d are free
    measure, asked = additive({"a": 1, "b": 0, "c": 5, "d": 0})
    search = search_float_layers(["a", "c", "b", "d"], measure, Bounds(max_disagreement_rate=0.002))
    assert [t.step for t in search.trials] == ["all int8", "all but one", "bisection", "bisection", "elimination"]
    # bisection: 1 layer (a: misses, c costs 5), 2 layers (a, c: meets); elimination: c back is [a] (known
    # to miss, not measured again), a back is [c] (meets)
    assert [sorted(t.kept_float) for t in search.trials] == [[], ["a", "b", "c"], ["a"], ["a", "c"], ["c"]]
    assert search.kept_float == ["c"] and search.chosen.search.disagreements == 1
    assert len(asked) == len(set(asked)) == search.exports == 5


def test_a_fully_quantized_export_that_meets_the_bounds_keeps_nothing_in_float():
    measure, asked = additive({"a": 1, "b": 1})
    search = search_float_layers(["a", "b"], measure, Bounds(max_accuracy_drop=0.0, max_disagreement_rate=0.01))
    assert search.kept_float == [] and search.exports == 1 and asked == [frozenset()]


def test_an_unreachable_bound_names_it_and_keeps_what_was_measured():
    measure, _ = additive({"a": 3, "b": 4, "c": 2})
    with pytest.raises(UnreachableBounds, match=r"even with 2 of 3 layers in float \(only c quantized\) disagreement "
                                                r"rate 0.20% \(2 of 1000\) > --max-disagreement-rate 0.001") as caught:
        search_float_layers(["a", "b", "c"], measure, Bounds(max_disagreement_rate=0.001))
    assert [t.step for t in caught.value.search.trials] == ["all int8", "all but one"]
    assert isinstance(caught.value, UserError)


def test_a_one_layer_model_cannot_keep_anything_in_float():
    measure, _ = additive({"a": 3})
    with pytest.raises(UnreachableBounds, match="1 quantizable layer, so none can stay in float"):
        search_float_layers(["a"], measure, Bounds(max_disagreement_rate=0.001))


def test_no_bound_is_refused():
    with pytest.raises(UserError, match="needs a bound"):
        search_float_layers(["a"], additive({"a": 1})[0], Bounds())


@pytest.mark.parametrize("value", [float("nan"), -0.1, 1.5, float("inf")])
def test_bounds_outside_zero_one_are_refused(value):
    with pytest.raises(UserError, match="fraction between 0 and 1"):
        Bounds(max_disagreement_rate=value)


@settings(max_examples=150, deadline=None)
@given(costs=st.lists(st.integers(0, 6), min_size=2, max_size=7),
       pairs=st.dictionaries(st.tuples(st.integers(0, 6), st.integers(0, 6)), st.integers(0, 4), max_size=4),
       allowed=st.integers(0, 12), order=st.randoms(use_true_random=False))
def test_the_choice_meets_the_bound_is_one_minimal_and_every_set_is_measured_once(costs, pairs, allowed, order):
    names = [f"layer{i}" for i in range(len(costs))]
    interactions = {(names[i], names[j]): extra for (i, j), extra in pairs.items() if i < len(names) and j < len(names)}
    measure, asked = additive(dict(zip(names, costs)), interactions)
    ranking = names[:]
    order.shuffle(ranking)
    bounds = Bounds(max_disagreement_rate=allowed / IMAGES)
    try:
        search = search_float_layers(ranking, measure, bounds)
    except UnreachableBounds as unreachable:
        # then keeping all but the last-ranked layer in float misses, as the message says
        assert not bounds.met_by(measure(tuple(ranking[:-1])))
        assert unreachable.search.trials[-1].step in ("all int8", "all but one")
        return
    assert len(asked) == len(set(asked)) == search.exports
    assert bounds.met_by(measure(tuple(search.kept_float)))
    assert len(search.kept_float) < len(names)
    for layer in search.kept_float:  # no single kept layer can go back to int8
        assert not bounds.met_by(measure(tuple(name for name in search.kept_float if name != layer)))
    if not search.kept_float:
        assert search.exports == 1


@pytest.mark.parametrize("k, n", [(0, 10), (1, 10), (2, 5000), (40, 5000), (9, 9), (0, 1)])
def test_the_upper_bound_is_scipys_exact_interval(k, n):
    from scipy.stats import binomtest

    # the one-sided 95% bound is the upper end of the two-sided 90% Clopper-Pearson interval
    expected = 1.0 if k == n else binomtest(k, n).proportion_ci(confidence_level=0.90, method="exact").high
    assert clopper_pearson_upper(k, n) == pytest.approx(expected, rel=1e-9)


def test_scores_count_disagreements_and_the_accuracy_drop():
    labels = np.array([0, 1, 2, 3, 4])
    measured = scores([0, 1, 2, 0, 4], [0, 1, 1, 3, 0], labels)
    assert (measured.images, measured.disagreements, measured.original_correct, measured.compressed_correct) == (5, 3, 4, 3)
    assert measured.accuracy_drop == pytest.approx(0.2) and measured.disagreement_rate == pytest.approx(0.6)
    assert Bounds(max_accuracy_drop=0.2).met_by(measured) and not Bounds(max_accuracy_drop=0.19).met_by(measured)


def test_the_search_record_round_trips_through_json():
    measure, _ = additive({"a": 1, "b": 0, "c": 5})
    search = search_float_layers(["c", "a", "b"], measure, Bounds(max_disagreement_rate=0.001))
    search.held_out = Scores(500, 1, 480, 481)
    again = BoundedSearch.from_json(search.to_json())
    assert again == search and again.chosen.kept_float == search.kept_float
    assert [row["chosen"] for row in again.rows()].count("<-") == 1


def test_exhaustively_on_three_layers_the_choice_is_as_small_as_any_meeting_set_when_costs_add_up():
    costs = {"a": 2, "b": 3, "c": 1}
    measure, _ = additive(costs)
    bounds = Bounds(max_disagreement_rate=0.003)
    search = search_float_layers(["b", "a", "c"], measure, bounds)
    meeting = [set(kept) for size in range(3) for kept in itertools.combinations(costs, size)
               if bounds.met_by(measure(kept))]
    assert len(search.kept_float) == min(len(kept) for kept in meeting)


def test_a_realistic_success_bound_judges_the_fuzzed_seeds():
    bounds = Bounds(max_realistic_success_rate=0.1)
    assert bounds.met_by(Scores(100, 50, 90, 40, fuzzed=20, realistic=2))
    missed = bounds.failures(Scores(100, 0, 90, 90, fuzzed=20, realistic=3))
    assert missed == ["realistic success rate 15.00% (3 of 20 seeds) > --max-realistic-success-rate 0.1"]
    assert "realistic triggers on 3 of 20 fuzzed seeds" in Scores(100, 0, 90, 90, fuzzed=20, realistic=3).describe()
    assert bounds.describe() == "realistic success rate <= 0.1"
