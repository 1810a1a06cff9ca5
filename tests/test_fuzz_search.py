"""The per-seed searches, driven by hand: DFlare's acceptance rule (the paper's fitness, D) and DiffChaser's generations."""
import dataclasses
import hashlib

import mlflow_di  # noqa: F401
import numpy as np
import pytest

from mlflow_di.errors import UserError
from mlflow_di.fuzz import DFlare, DiffChaser
from mlflow_di.fuzz.dflare import DFlareSearch
from mlflow_di.fuzz.diffchaser import PixelNoise


@dataclasses.dataclass(frozen=True)
class Brighten:
    """Test operator: adds one level to the first pixel (so every mutant is a new image)."""

    name: str = "brighten"

    def __call__(self, image, rng):
        out = image.copy()
        out.flat[0] += 1
        return out


@dataclasses.dataclass(frozen=True)
class Keep:
    """Test operator: returns the image unchanged (like a 1x1 blur)."""

    name: str = "keep"

    def __call__(self, image, rng):
        return image.copy()


SEED = np.zeros((4, 4, 1), np.uint8)


def _probabilities(top_original: float, top_compressed: float, flip: bool = False):
    """Two-class probability rows; label 0 for both unless ``flip`` (then the compressed says 1)."""
    f = np.array([[top_original, 1 - top_original]])
    g = np.array([[1 - top_compressed, top_compressed]]) if flip else np.array([[top_compressed, 1 - top_compressed]])
    return f, g


def _search(strategy=None, operators=(Brighten(),), gap=0.1):
    strategy = dataclasses.replace(strategy or DFlare(fitness="gap"), operators=operators)
    f, g = _probabilities(0.9, 0.9 - gap)
    return DFlareSearch(strategy, SEED, f[0], g[0], np.random.default_rng(0))


def _step(search, top_original, top_compressed, flip=False):
    candidate = search.propose()
    assert candidate.shape == (1, *SEED.shape)
    search.observe(*_probabilities(top_original, top_compressed, flip))
    return candidate[0]


def test_larger_gap_is_accepted_smaller_rejected():
    search = _search(gap=0.1)
    _step(search, 0.9, 0.79)           # D = 0.11 >= 0.10
    assert search.best_gap == pytest.approx(0.11) and search.best.flat[0] == 1
    _step(search, 0.9, 0.795)          # D = 0.105 < 0.11, same neighbourhood: rejected
    assert search.best_gap == pytest.approx(0.11) and search.best.flat[0] == 1
    assert list(search.stats.selected) == [2] and list(search.stats.accepted) == [1]


def test_novel_state_buys_one_delta_of_gap():
    search = _search(gap=0.1)
    # far from the seed's pair ([0.9, 0.1, 0.8, 0.2]) in squared L2: novel, D = 0.0995 >= 0.1 - 0.001
    _step(search, 0.4, 0.3005)
    assert search.best.flat[0] == 1 and search.best_gap == pytest.approx(0.0995)
    # the same state again is no longer novel: D = 0.0990 < 0.0995 is rejected
    _step(search, 0.4, 0.301)
    assert search.best.flat[0] == 1


def test_without_novelty_the_same_state_is_rejected():
    search = _search(DFlare(novelty=False, fitness="gap"), gap=0.1)
    _step(search, 0.4, 0.3005)
    assert search.best.flat[0] == 0 and search.best_gap == pytest.approx(0.1)


def test_unchanged_image_is_accepted_whatever_the_floats_say():
    search = _search(operators=(Keep(),), gap=0.1)
    _step(search, 0.9, 0.9, flip=True)  # noise in re-computed floats must not matter for the same image
    assert not search.found and list(search.stats.accepted) == [1]


def test_reference_acceptance_keeps_any_change_of_the_gap_beyond_delta():
    reference = DFlare(novelty=False, acceptance="reference", fitness="gap")
    search = _search(reference, gap=0.1)
    assert search.best_gap == 0.0  # the reference code starts from D(x_max) = 0, not the seed's D
    _step(search, 0.9, 0.79)           # |0.11 - 0| > 0.001: kept
    _step(search, 0.9, 0.85)           # D drops to 0.05: the paper's rule rejects it, the reference keeps it
    assert search.best_gap == pytest.approx(0.05) and search.best.flat[0] == 2
    _step(search, 0.9, 0.8505)         # |0.0495 - 0.05| <= 0.001 and not novel: rejected
    assert search.best_gap == pytest.approx(0.05) and search.best.flat[0] == 2
    paper = _search(DFlare(novelty=False, fitness="gap"), gap=0.1)
    _step(paper, 0.9, 0.79)
    _step(paper, 0.9, 0.85)
    assert paper.best_gap == pytest.approx(0.11)


def test_reference_acceptance_judges_an_unchanged_image_by_the_models():
    search = _search(DFlare(novelty=False, acceptance="reference", fitness="gap"), operators=(Keep(),), gap=0.1)
    _step(search, 0.9, 0.9)            # |0 - 0| is no change: rejected, unlike under the paper's rule
    assert list(search.stats.accepted) == [0]


def test_unknown_acceptance_is_refused():
    with pytest.raises(UserError, match="acceptance"):
        DFlare(acceptance="greedy")


def test_trigger_stops_the_search_and_records_the_chain():
    search = _search(gap=0.1)
    _step(search, 0.9, 0.79)
    trigger = _step(search, 0.6, 0.55, flip=True)
    assert search.found and search.queries == 2
    np.testing.assert_array_equal(search.trigger, trigger)
    assert search.trigger_operators == ["brighten", "brighten"]
    labels = [p.argmax() for p in search.trigger_probabilities]
    assert labels == [0, 1]


def test_pixel_noise_respects_rate_step_and_bound():
    mutation = PixelNoise(rate=0.25, step=5, linf_bound=7)
    seed = np.resize(np.array([3, 128, 250], np.uint8), (10, 10, 1))
    limits = mutation.limits(seed)
    rng = np.random.default_rng(0)
    batch = np.repeat(seed[None], 400, axis=0)
    step = mutation(batch.copy(), limits, rng).astype(int) - seed
    assert np.abs(step).max() == 5
    # a value moves with probability rate * 10/11 (a zero draw leaves it where it is)
    assert (step != 0)[:, seed[..., 0] == 128].mean() == pytest.approx(0.25 * 10 / 11, abs=0.02)
    drifted = batch.copy()
    for _ in range(200):
        drifted = mutation(drifted, limits, rng)
    drift = drifted.astype(int) - seed
    middle, dark, bright = (drift[:, seed[..., 0] == level] for level in (128, 3, 250))
    assert middle.max() == 7 and middle.min() == -7  # the bound is reached and held
    assert dark.min() == -3 and bright.max() == 5    # and so are 0 and 255


class Threshold:
    """Two classes; the compressed model flips to class 1 when pixel (0, 0) reaches ``level``."""

    def __init__(self, level):
        self.level = level

    def pair(self, images):
        x = images[:, 0, 0, 0].astype(float) / 255
        f = np.stack([0.6 - 0.1 * x, 0.4 + 0.1 * x], axis=1)
        g = f.copy()
        flipped = images[:, 0, 0, 0] >= self.level
        g[flipped] = [0.3, 0.7]
        return f, g


def test_diffchaser_generations_and_query_count():
    strategy = DiffChaser(population_size=6, mutation=PixelNoise(rate=1.0, step=1, linf_bound=None))
    search = strategy.start(SEED, *_probabilities(0.6, 0.6), np.random.default_rng(0))
    models = Threshold(level=3)
    first = search.propose()
    assert first.shape == (6, 4, 4, 1) and first.max() <= 1
    search.observe(*models.pair(first))
    assert search.queries == 6 and not search.found
    best = search.population[np.argmax(search.fitness)].copy()
    generation = 0
    while not search.found:
        children = search.propose(limit=100)
        assert len(children) == 5  # the fittest chromosome is kept, not re-queried
        queries_before = search.queries
        p_original, p_compressed = models.pair(children)
        search.observe(p_original, p_compressed)
        generation += 1
        if search.found:
            first_trigger = int(np.flatnonzero(p_compressed.argmax(1) == 1)[0])
            assert search.queries == queries_before + first_trigger + 1
        else:
            assert any(np.array_equal(best, member) for member in search.population)
            best = search.population[np.argmax(search.fitness)].copy()
        assert generation < 50
    assert generation >= 2  # one level per mutation: three levels need three generations
    assert search.trigger[0, 0, 0] >= 3
    lineage = search.trigger_operators
    assert lineage[0] == "pixel_noise" and lineage[1:3] == ["crossover", "pixel_noise"]
    assert len(lineage) == 1 + 2 * generation


def test_diffchaser_respects_the_query_limit():
    search = DiffChaser(population_size=10).start(SEED, *_probabilities(0.6, 0.6), np.random.default_rng(0))
    assert len(search.propose(limit=4)) == 4


@dataclasses.dataclass(frozen=True)
class Nudge:
    """Test operator: moves one random pixel by a random amount in -3..3 (0 leaves the image as is)."""

    name: str = "nudge"

    def __call__(self, image, rng):
        out = image.copy()
        index = int(rng.integers(out.size))
        out.flat[index] = np.clip(int(out.flat[index]) + int(rng.integers(-3, 4)), 0, 255)
        return out


def _hashed_pair(images):
    """Two classes; the gap D and the disagreement are pseudo-random functions of the image bytes,
    so most mutants are rejected once a high D is reached, and about one image in 53 triggers."""
    f, g = [], []
    for image in images:
        h = int.from_bytes(hashlib.blake2b(image.tobytes(), digest_size=8).digest(), "little")
        gap = (h % 1000) / 10000
        f.append([0.9, 0.1])
        g.append([0.3, 0.7] if h % 53 == 0 else [0.9 - gap, 0.1 + gap])
    return np.array(f), np.array(g)


@pytest.mark.parametrize("acceptance", ["paper", "reference"])
@pytest.mark.parametrize("depth", [2, 5, 16])
def test_speculative_proposals_change_nothing_but_the_batch(depth, acceptance):
    def run(depth):
        strategy = DFlare(operators=(Nudge(), Keep(), Brighten()), acceptance=acceptance, fitness="gap")
        seed = np.zeros((8, 8, 1), np.uint8)
        f, g = _hashed_pair(seed[None])
        search = strategy.start(seed, f[0], g[0], np.random.default_rng(7))
        calls, inputs = 0, 0
        while not search.found and search.queries < 5000:
            proposal = search.propose(depth=depth)
            calls, inputs = calls + 1, inputs + len(proposal)
            search.observe(*_hashed_pair(proposal))
        state = (search.queries, search.stats.selected.tolist(), search.stats.accepted.tolist(),
                 search.trigger_operators, search.best_gap)
        return state, search.trigger, calls, inputs

    one_state, one_trigger, one_calls, _ = run(1)
    state, trigger, calls, inputs = run(depth)
    assert one_state[0] > 50 and one_trigger is not None
    assert state == one_state
    np.testing.assert_array_equal(trigger, one_trigger)
    assert calls < one_calls and inputs >= one_state[0]  # fewer, bigger calls; dropped inputs are not queries
