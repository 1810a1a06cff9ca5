"""The named DFlare strategies and the switches of the log-margin search: fitness, strict
acceptance, restarts, plateau-aware strength; determinism, speculation and lockstep invariance."""
import dataclasses
import hashlib
import math
import pathlib
import sys

import mlflow_di  # noqa: F401
import numpy as np
import pytest

from mlflow_di.errors import UserError
from mlflow_di.fuzz import DFlare, run_campaign
from mlflow_di.fuzz.device_mutations import with_operators_on
from mlflow_di.fuzz import dflare as dflare_module
from mlflow_di.fuzz.dflare import MAX_STRENGTH
from mlflow_di.fuzz.mutations import same_image
from mlflow_di.fuzz import fitness as fitness_module
from mlflow_di.fuzz.fitness import LIST_SCORING_MAX_CLASSES, log_margin, log_margin_list
from mlflow_di.fuzz.contract import Access
from mlflow_di.fuzz.search import Search
from mlflow_di.fuzz.strategies import STRATEGIES, declaration, make_strategy

from tests.test_fuzz_campaign import Brightness, HIGH, LOW, _comparable
from tests.test_fuzz_search import Brighten, Keep, Nudge

REPO = pathlib.Path(__file__).resolve().parents[1]
SEED = np.zeros((4, 4, 1), np.uint8)


def _start(strategy, f, g, operators=(Brighten(),)):
    strategy = dataclasses.replace(strategy, operators=operators)
    return strategy.start(SEED, np.array(f, float), np.array(g, float), np.random.default_rng(0))


def _step(search, f, g):
    candidate = search.propose()
    search.observe(np.array([f], float), np.array([g], float))
    return candidate[0]


# --- the registry ---

def test_registry_names_and_what_they_are():
    assert set(STRATEGIES) == {"dflare", "dflare-d", "dflare-r", "dflare-paper", "dflare-paper-d", "dflare-paper-r",
                               "diffchaser", "deepxplore", "boundary"}
    # white-box is said once, in the declaration: the black-box runner reads it there and refuses
    assert declaration("deepxplore").original is Access.WHITE_BOX is declaration("deepxplore").compressed
    assert declaration("boundary").original is Access.WHITE_BOX and declaration("boundary").compressed is Access.BLACK_BOX
    assert not hasattr(make_strategy("boundary"), "white_box")
    default, paper = make_strategy("dflare"), make_strategy("dflare-paper")
    assert (default.fitness, default.acceptance, default.novelty, default.selection) == (
        "margin", "paper", True, "metropolis-hastings")
    assert (paper.fitness, paper.acceptance, paper.novelty) == ("gap", "paper", True)
    assert not make_strategy("dflare-d").novelty and make_strategy("dflare-paper-d").fitness == "gap"
    assert make_strategy("dflare-r").selection == make_strategy("dflare-paper-r").selection == "uniform"
    for name in STRATEGIES:
        assert make_strategy(name).name == name
    assert "dflare-d-bug" not in STRATEGIES  # a reproduction-harness variant only


def test_bad_settings_are_refused():
    for bad in (dict(fitness="loss"), dict(restart=-1), dict(escalate=-2)):
        with pytest.raises(UserError):
            DFlare(**bad)


# --- the fitness ---

def test_log_margin_on_hand_computed_vectors():
    assert log_margin(np.array([0.7, 0.2, 0.1])) == pytest.approx(math.log(3.5), abs=1e-4)
    assert log_margin(np.array([0.5, 0.5])) == 0.0
    # both top-1 probabilities "saturated": the runner-up still carries the signal
    assert log_margin(np.array([1.0, 1e-12, 0.0], np.float32)) == pytest.approx(-math.log(1e-12), abs=1e-3)
    assert log_margin(np.array([1.0, 1e-9, 0.0], np.float32)) < log_margin(np.array([1.0, 1e-12, 0.0], np.float32))


@pytest.mark.parametrize("classes", [LIST_SCORING_MAX_CLASSES + 1, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_rows_take_numpy_and_give_the_list_scan_s_margin(classes, dtype):
    rng = np.random.default_rng(classes)
    for _ in range(50):
        p = rng.dirichlet(np.full(classes, rng.choice([0.01, 1.0]))).astype(dtype)
        if rng.random() < 0.3:  # ties at the top and underflowed runners-up
            p[rng.integers(classes)] = p.max()
            p[p < 1e-3] = 0.0
        assert log_margin(p) == log_margin_list(p.tolist())


def _score_every_row_as_a_list(monkeypatch):
    """Every probability row through the plain-float path, however long."""
    for module in (fitness_module, dflare_module):
        monkeypatch.setattr(module, "LIST_SCORING_MAX_CLASSES", 10**6)


class _ManyClasses:
    """Black box with ``classes`` outputs: a softmax of random projections of the image's mean
    brightness, ``shift`` apart between the two models, so top-2 margins and gaps vary with the image."""

    def __init__(self, classes: int, shift: float):
        self.weights = np.random.default_rng(classes).standard_normal(classes)
        self.bias = shift * np.sin(np.arange(classes))

    def predict_proba(self, images):
        brightness = images.reshape(len(images), -1).mean(axis=1) / 255.0
        logits = np.outer(brightness - 0.2, self.weights) * 30 + self.bias
        logits[:, 0] += 3
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("settings", [dict(), dict(fitness="margin-both"), dict(fitness="gap"),
                                      dict(acceptance="strict"), dict(fitness="gap", novelty_threshold=0.02)],
                         ids=["margin", "margin-both", "gap", "strict", "novelty"])
def test_numpy_scoring_of_long_rows_makes_the_list_scoring_s_decisions(seeds, settings, monkeypatch):
    pair = (_ManyClasses(200, 0.0), _ManyClasses(200, 0.05))
    strategy = DFlare(**settings)

    def campaign():
        return run_campaign(*pair, seeds, strategy=strategy, max_queries=300, timeout=1e6, batch=4, progress=False)

    numpy_scored = campaign()
    _score_every_row_as_a_list(monkeypatch)
    list_scored = campaign()
    assert _comparable(numpy_scored) == _comparable(list_scored)
    assert sum(r.queries for r in numpy_scored.records) > 10 * len(seeds)
    assert any(sum(accepted for _, accepted in r.operator_counts.values()) for r in numpy_scored.records)


def test_same_image_compares_every_value():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
    assert same_image(image, image.copy())
    for index in (0, 1023, 1024, image.size - 1):  # in the head, at its edge, past it
        changed = image.copy().reshape(-1)
        changed[index] ^= 1
        assert not same_image(image, changed.reshape(image.shape))
    assert same_image(image[:, ::-1], np.ascontiguousarray(image[:, ::-1]))  # a strided view too


def test_margin_fitness_follows_the_boundary_where_the_gap_does_not():
    seed_f, seed_g = [0.9, 0.1], [0.8, 0.2]               # D = 0.1, margin log 9
    closer_f, closer_g = [0.7, 0.3], [0.69, 0.31]         # D = 0.01 (lower), margin log(7/3) (lower: closer)
    margin = _start(DFlare(novelty=False), seed_f, seed_g)
    gap = _start(DFlare(novelty=False, fitness="gap"), seed_f, seed_g)
    assert margin.best_score == pytest.approx(-math.log(9), abs=1e-4) and gap.best_score == pytest.approx(0.1)
    _step(margin, closer_f, closer_g)
    _step(gap, closer_f, closer_g)
    assert margin.best.flat[0] == 1 and margin.best_score == pytest.approx(-math.log(7 / 3), abs=1e-4)
    assert gap.best.flat[0] == 0 and gap.best_score == pytest.approx(0.1)  # D fell: the paper's fitness rejects it
    # and the other way round: a larger gap but a safer original is rejected by the margin search
    _step(margin, [0.99, 0.01], [0.5, 0.4])
    _step(gap, [0.99, 0.01], [0.5, 0.4])
    assert margin.best.flat[0] == 1  # still the closer mutant
    assert gap.best.flat[0] == 1 and gap.best_score == pytest.approx(0.49)  # this mutant of the seed: D = 0.49


def test_saturated_pairs_still_rank_under_the_margin_fitness():
    # both models' top-1 probabilities round to 1: D = 0 for both mutants, the margin still tells them apart
    seed = ([1.0, 1e-12], [1.0, 0.0])
    search = _start(DFlare(novelty=False, acceptance="strict"), *seed)
    _step(search, [1.0, 1e-8], [1.0, 0.0])
    assert search.best.flat[0] == 1
    _step(search, [1.0, 1e-10], [1.0, 0.0])  # farther from the boundary again: rejected
    assert search.best.flat[0] == 1
    gap = _start(DFlare(novelty=False, acceptance="strict", fitness="gap"), *seed)
    _step(gap, [1.0, 1e-8], [1.0, 0.0])
    assert gap.best.flat[0] == 0  # no signal: D stays 0


def test_margin_both_takes_the_compressed_model_into_account():
    seed_f, seed_g = [0.9, 0.1], [0.9, 0.1]
    both = _start(DFlare(novelty=False, fitness="margin-both", acceptance="strict"), seed_f, seed_g)
    only = _start(DFlare(novelty=False, acceptance="strict"), seed_f, seed_g)
    for search in (both, only):
        _step(search, [0.9, 0.1], [0.6, 0.4])  # only the compressed model moved towards its boundary
    assert both.best.flat[0] == 1 and only.best.flat[0] == 0


def test_strict_acceptance_rejects_ties_and_unchanged_images():
    paper = _start(DFlare(novelty=False), [0.9, 0.1], [0.9, 0.1], operators=(Keep(),))
    strict = _start(DFlare(novelty=False, acceptance="strict"), [0.9, 0.1], [0.9, 0.1], operators=(Keep(),))
    for search in (paper, strict):
        _step(search, [0.9, 0.1], [0.9, 0.1])
    assert paper.stats.accepted.tolist() == [1] and strict.stats.accepted.tolist() == [0]


# --- plateaus: restarts and strength ---

def test_restart_returns_to_the_seed_after_rejections_in_a_row():
    search = _start(DFlare(novelty=False, restart=3), [0.9, 0.1], [0.9, 0.1])
    _step(search, [0.8, 0.2], [0.8, 0.2])  # accepted: x_max = seed + 1
    assert search.best.flat[0] == 1
    for _ in range(2):
        _step(search, [0.95, 0.05], [0.95, 0.05])  # rejected
    assert search.best.flat[0] == 1
    _step(search, [0.95, 0.05], [0.95, 0.05])  # third rejection in a row: back to the seed
    assert search.best.flat[0] == 0 and search.best_score == pytest.approx(-math.log(9), abs=1e-4)
    without = _start(DFlare(novelty=False), [0.9, 0.1], [0.9, 0.1])
    _step(without, [0.8, 0.2], [0.8, 0.2])
    for _ in range(5):
        _step(without, [0.95, 0.05], [0.95, 0.05])
    assert without.best.flat[0] == 1


def test_escalate_applies_the_operator_more_often_on_a_plateau():
    search = _start(DFlare(novelty=False, escalate=2), [0.9, 0.1], [0.9, 0.1])
    increments = []
    for _ in range(8):
        candidate = _step(search, [0.95, 0.05], [0.95, 0.05])  # always rejected: x_max stays the seed
        increments.append(int(candidate.flat[0]))
    assert increments == [1, 1, 2, 2, 3, 3, 4, 4]  # 1 + rejections so far // 2
    long = _start(DFlare(novelty=False, escalate=1), [0.9, 0.1], [0.9, 0.1])
    for _ in range(3 * MAX_STRENGTH):
        candidate = _step(long, [0.95, 0.05], [0.95, 0.05])
    assert int(candidate.flat[0]) == MAX_STRENGTH
    plain = _start(DFlare(novelty=False), [0.9, 0.1], [0.9, 0.1])
    assert {int(_step(plain, [0.95, 0.05], [0.95, 0.05]).flat[0]) for _ in range(6)} == {1}


# --- invariance: speculation, batch, determinism ---

def _hashed_pair(images):
    """Pseudo-random margins and gaps from the image bytes; about one image in 97 triggers."""
    f, g = [], []
    for image in images:
        h = int.from_bytes(hashlib.blake2b(image.tobytes(), digest_size=8).digest(), "little")
        top = 0.55 + (h % 4000) / 10000
        gap = ((h >> 16) % 1000) / 20000
        f.append([top, 1 - top])
        g.append([0.3, 0.7] if h % 97 == 0 else [top - gap, 1 - top + gap])
    return np.array(f), np.array(g)


@pytest.mark.parametrize("settings", [dict(), dict(restart=4), dict(escalate=3), dict(restart=5, escalate=2),
                                      dict(acceptance="strict", restart=4, escalate=2),
                                      dict(fitness="gap", restart=3, escalate=2)],
                         ids=["margin", "restart", "escalate", "both", "strict", "gap"])
@pytest.mark.parametrize("depth", [3, 16])
def test_speculation_changes_nothing_with_restarts_and_strength(depth, settings):
    def run(depth):
        strategy = DFlare(operators=(Nudge(), Keep(), Brighten()), **settings)
        seed = np.zeros((8, 8, 1), np.uint8)
        f, g = _hashed_pair(seed[None])
        search = strategy.start(seed, f[0], g[0], np.random.default_rng(11))
        while not search.found and search.queries < 3000:
            proposal = search.propose(depth=depth)
            search.observe(*_hashed_pair(proposal))
        return (search.queries, search.stats.selected.tolist(), search.stats.accepted.tolist(),
                search.trigger_operators, search.best_score), search.trigger

    one_state, one_trigger = run(1)
    state, trigger = run(depth)
    assert one_state[0] > 20 and one_trigger is not None
    assert state == one_state
    np.testing.assert_array_equal(trigger, one_trigger)


@pytest.fixture()
def seeds():
    from mlflow_di.data import ImageSet
    rng = np.random.default_rng(3)
    return ImageSet(rng.integers(0, 100, (10, 8, 8, 1), dtype=np.uint8), rng.integers(0, 2, 10), "dark")


@pytest.mark.parametrize("strategy", ["dflare", "dflare-d", "dflare-r", "dflare-paper",
                                      DFlare(name="plateaus", restart=5, escalate=3),
                                      DFlare(name="strict", acceptance="strict"),
                                      with_operators_on(DFlare(name="device-operators"), "cpu")],
                         ids=["dflare", "dflare-d", "dflare-r", "dflare-paper", "plateaus", "strict", "device-operators"])
def test_each_strategy_is_deterministic_and_independent_of_batch(seeds, strategy):
    pair = (Brightness(LOW, classes=3), Brightness(HIGH, classes=3))
    runs = [run_campaign(*pair, seeds, strategy=strategy, max_queries=400, timeout=1e6, batch=batch, seed=2,
                         progress=False) for batch in (1, 4, 4)]
    assert _comparable(runs[0]) == _comparable(runs[1]) == _comparable(runs[2])
    assert runs[0].summary.triggers > 0
    other_seed = run_campaign(*pair, seeds, strategy=strategy, max_queries=400, timeout=1e6, batch=4, seed=3,
                              progress=False)
    assert [r.queries for r in other_seed.records] != [r.queries for r in runs[0].records]


# --- the bug-faithful DFlare_D of the reproduction harness ---

def test_dflare_d_bug_never_accepts_a_mutant():
    sys.path.insert(0, str(REPO))
    from benchmarks.reproduce.dflare_variants import DFlareDBug, harness_strategy

    strategy = harness_strategy("dflare-d-bug")
    assert isinstance(strategy, DFlareDBug) and harness_strategy("dflare-paper") == "dflare-paper"
    search = _start(strategy, [0.9, 0.1], [0.9, 0.1])
    for top in (0.5, 0.6, 0.99):  # far larger gaps than the seed's, and a novel pair: still rejected
        candidate = _step(search, [0.95, 0.05], [top, 1 - top])
        assert candidate.flat[0] == 1  # every mutant is one mutation of the seed itself
    assert search.best.flat[0] == 0 and search.stats.accepted.sum() == 0
    assert strategy.options()["never_accepts"] and not strategy.novelty


@pytest.mark.parametrize("fitness", ["margin-both", "gap"])
def test_rows_holding_nan_are_scored_as_the_list_scan_scores_them(monkeypatch, fitness):
    """A NaN (an infinite logit through a softmax) sorts last in a partition but is skipped by the list scan."""
    rng = np.random.default_rng(5)
    p_original, p_compressed = rng.dirichlet(np.ones(100)), rng.dirichlet(np.ones(100))
    p_compressed[7] = np.nan
    p_original[3] = np.nan
    assert log_margin(p_original) == log_margin_list(p_original.tolist())

    def scores():
        search = DFlare(fitness=fitness).start(SEED, p_original, p_compressed, np.random.default_rng(0))
        return search._score(p_original, p_compressed), search.best_score

    numpy_scored = scores()
    _score_every_row_as_a_list(monkeypatch)
    assert numpy_scored == scores()


@pytest.mark.parametrize("strategy", ["dflare", "dflare-paper", "dflare-r", DFlare(name="strict", acceptance="strict"),
                                      with_operators_on(DFlare(name="device-operators"), "cpu"),
                                      with_operators_on(DFlare(name="device-gap", fitness="gap"), "cpu")],
                         ids=["dflare", "dflare-paper", "dflare-r", "strict", "device-operators", "device-gap"])
def test_a_population_s_step_gives_each_search_s_records(seeds, strategy, monkeypatch):
    # the lockstep draws every search's mutation, makes them per operator and scores the step together;
    # with plan() off, each search makes and scores its own inputs: the records must be the same
    from mlflow_di.fuzz.dflare import DFlareSearch

    pair = (Brightness(LOW, classes=3), Brightness(HIGH, classes=3))
    together = run_campaign(*pair, seeds, strategy=strategy, max_queries=300, timeout=1e6, batch=10, seed=4,
                            progress=False)
    monkeypatch.setattr(DFlareSearch, "plan", lambda self: None)
    monkeypatch.setattr(DFlareSearch, "observe_all", classmethod(Search.observe_all.__func__))
    alone = run_campaign(*pair, seeds, strategy=strategy, max_queries=300, timeout=1e6, batch=10, seed=4,
                         progress=False)
    assert _comparable(together) == _comparable(alone)
    np.testing.assert_array_equal(together.triggers, alone.triggers)
    assert together.summary.triggers > 0
