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


def additive(costs: dict, interactions: dict | None = None, recipe_costs: dict | None = None):
    """A measure: each quantized layer adds its cost in disagreements (and a pair its interaction, and a
    recipe its own cost when any layer is quantized), and records which sets were asked for."""
    asked = []

    def measure(kept, recipe=None):
        asked.append(frozenset(kept) if recipe is None else (recipe, frozenset(kept)))
        quantized = [name for name in costs if name not in kept]
        total = sum(costs[name] for name in quantized) + (recipe_costs or {}).get(recipe, 0)
        total += sum(extra for pair, extra in (interactions or {}).items() if set(pair) <= set(quantized))
        return Scores(IMAGES, total, 900, 900)

    return measure, asked


def test_a_layer_alone_in_float_that_meets_the_bound_is_found_whatever_the_hint_order():
    # the hint puts c, the layer that matters, second to last: the measured ranking finds it anyway
    measure, asked = additive({"a": 1, "b": 0, "c": 5, "d": 0})
    search = search_float_layers(["a", "b", "c", "d"], measure, Bounds(max_disagreement_rate=0.002))
    assert [t.step for t in search.trials] == ["all int8"] + ["one in float"] * 4
    assert search.kept_float == ["c"] and search.chosen.search.disagreements == 1
    assert len(asked) == len(set(asked)) == search.exports == 5


def test_a_hand_computed_search_walks_all_int8_singles_all_but_one_bisection_then_elimination():
    # a, b, c cost 3 each, d nothing; at most 3 disagreements: no single layer in float is enough
    measure, asked = additive({"a": 3, "b": 3, "c": 3, "d": 0})
    search = search_float_layers(["a", "b", "c", "d"], measure, Bounds(max_disagreement_rate=0.003))
    steps = [t.step for t in search.trials]
    assert steps == ["all int8"] + ["one in float"] * 4 + ["all but one", "bisection"]
    # ranking: a, b, c (6 each, hint order), d (9); all but d meets (0); bisection at 2 layers: a, b (3)
    # meets; elimination asks for [a] and [b], both measured already as singles
    assert search.ranking == ["a", "b", "c", "d"]
    assert [sorted(t.kept_float) for t in search.trials[-2:]] == [["a", "b", "c"], ["a", "b"]]
    assert search.kept_float == ["a", "b"] and search.chosen.search.disagreements == 3
    assert len(asked) == len(set(asked)) == search.exports == 7


def test_recipes_are_tried_before_any_layer_stays_in_float():
    measure, asked = additive({"a": 1, "b": 1}, recipe_costs={"s8s8": 20})
    search = search_float_layers(["a", "b"], measure, Bounds(max_disagreement_rate=0.002), ["s8s8", "u8u8"])
    assert [(t.recipe, t.step, t.kept_float) for t in search.trials] == [("s8s8", "all int8", []),
                                                                        ("u8u8", "all int8", [])]
    assert search.kept_float == [] and search.recipe == "u8u8" and search.recipes_tried == ["s8s8", "u8u8"]
    assert [row["chosen"] for row in search.rows()] == ["", "<-"]


def test_when_no_recipe_meets_the_closest_one_is_searched():
    measure, _ = additive({"a": 2, "b": 2, "c": 0}, recipe_costs={"s8s8": 20, "u8u8": 1})
    search = search_float_layers(["a", "b", "c"], measure, Bounds(max_disagreement_rate=0.001), ["s8s8", "u8u8"])
    assert search.recipe == "u8u8" and all(t.recipe == "u8u8" for t in search.trials[2:])
    assert sorted(search.kept_float) == ["a", "b"]


def test_a_fully_quantized_export_that_meets_the_bounds_keeps_nothing_in_float():
    measure, asked = additive({"a": 1, "b": 1})
    search = search_float_layers(["a", "b"], measure, Bounds(max_accuracy_drop=0.0, max_disagreement_rate=0.01))
    assert search.kept_float == [] and search.exports == 1 and asked == [frozenset()]


def test_an_unreachable_bound_is_declared_only_after_every_layer_alone_quantized_was_measured():
    measure, _ = additive({"a": 3, "b": 4, "c": 2})
    with pytest.raises(UnreachableBounds, match=r"each layer alone in float and each layer alone quantized; the "
                                                r"closest \(only c quantized\) has disagreement rate 0.20% \(2 of "
                                                r"1000\) > --max-disagreement-rate 0.001") as caught:
        search_float_layers(["a", "b", "c"], measure, Bounds(max_disagreement_rate=0.001))
    trials = caught.value.search.trials
    assert [t.step for t in trials] == ["all int8"] + ["one in float"] * 3 + ["all but one"] * 3
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
    """In the gate's words: a bound is its check's threshold."""
    with pytest.raises(UserError, match="is a fraction between 0 and 1|must be a finite number"):
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
    except UnreachableBounds:
        # then no export with exactly one layer quantized meets it (each was measured)
        assert not any(bounds.met_by(measure(tuple(n for n in names if n != layer))) for layer in names)
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


def test_recipes_that_come_equally_close_are_each_searched_one_layer_in_float_at_a_time():
    costs = {"u8u8": {"a": 1, "b": 1, "c": 1}, "s8s8": {"a": 0, "b": 0, "c": 3}}  # 3 disagreements either way

    def measure(kept, recipe):
        return Scores(IMAGES, sum(cost for name, cost in costs[recipe].items() if name not in kept), 900, 900)

    search = search_float_layers(["a", "b", "c"], measure, Bounds(max_disagreement_rate=0.001), ["u8u8", "s8s8"])
    assert search.recipe == "s8s8" and search.kept_float == ["c"] and search.ranking[0] == "c"
    assert [t.step for t in search.trials] == ["all int8"] * 2 + ["one in float"] * 6
