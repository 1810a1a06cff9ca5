"""Trigger realism: distances and SSIM by hand and against a direct implementation, constraints the
search respects, and several campaigns sharing the original's calls with the records of separate runs."""

import numpy as np
import pytest

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz import DFlare, run_campaign
from mlflow_di.fuzz.campaign import run_campaigns
from mlflow_di.fuzz.realism import Constraint, budget_ssim, budget_ssims, distance_summary, distances, ssim, ssims
from tests.test_fuzz_campaign import HIGH, LOW, Brightness, _comparable


def direct_ssim(a, b, sigma=1.5, radius=5):
    """Wang et al.'s SSIM written out window by window (an independent check of the filtered version)."""
    offsets = np.arange(-radius, radius + 1)
    weights = np.exp(-(offsets[:, None] ** 2 + offsets[None, :] ** 2) / (2 * sigma ** 2))
    weights /= weights.sum()
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    values = []
    for channel in range(a.shape[2]):
        x, y = a[..., channel].astype(float), b[..., channel].astype(float)
        for i in range(radius, a.shape[0] - radius):
            for j in range(radius, a.shape[1] - radius):
                window = (slice(i - radius, i + radius + 1), slice(j - radius, j + radius + 1))
                wx, wy = x[window], y[window]
                mx, my = (weights * wx).sum(), (weights * wy).sum()
                vx, vy = (weights * wx * wx).sum() - mx ** 2, (weights * wy * wy).sum() - my ** 2
                cxy = (weights * wx * wy).sum() - mx * my
                values.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))
    return float(np.mean(values))


def test_ssim_matches_the_window_by_window_formula_and_is_one_on_equal_images():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (16, 18, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    assert ssim(a, b) == pytest.approx(direct_ssim(a, b), abs=1e-9)
    assert ssim(a, b) == pytest.approx(ssim(b, a))
    assert ssim(a, a) == pytest.approx(1.0)
    noisier = np.clip(a.astype(int) + rng.integers(-120, 120, a.shape), 0, 255).astype(np.uint8)
    assert ssim(a, noisier) < ssim(a, b) < 1.0


def test_whole_image_ssim_is_the_formula_on_windows_at_every_pixel_and_sees_a_painted_frame():
    """``whole=True``: the window-by-window formula on the image mirrored at its edges (numpy's
    'symmetric' pad is scipy's 'reflect'), so windows sit on every pixel. A white ring around the
    image (108 pixels at 255) keeps the standard SSIM above 0.9 (its windows barely weigh the
    outermost pixels); the whole-image SSIM falls below 0.5."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (16, 18, 2), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    mirrored = [np.pad(x, ((5, 5), (5, 5), (0, 0)), mode="symmetric") for x in (a, b)]
    assert ssim(a, b, whole=True) == pytest.approx(direct_ssim(*mirrored), abs=1e-9)
    assert ssim(a, a, whole=True) == pytest.approx(1.0)
    digit = np.zeros((28, 28, 1), np.uint8)
    digit[8:20, 12:16] = 255
    framed = digit.copy()
    framed[[0, -1]] = framed[:, [0, -1]] = 255
    assert ssim(framed, digit) > 0.9 > 0.5 > ssim(framed, digit, whole=True)


def test_min_ssim_bounds_the_whole_image_too_so_a_painted_frame_is_outside_the_budget():
    """The painted ring of the test above: the paper's SSIM alone lets it in, the budget does not; a
    stroke thickened inside the image, where the paper's SSIM is the lower one, is judged by it. The
    trigger's record carries both, and a record saved before ``ssim_whole`` existed is judged by the
    paper's SSIM alone."""
    digit = np.zeros((28, 28, 1), np.uint8)
    digit[8:20, 12:16] = 255
    framed = digit.copy()
    framed[[0, -1]] = framed[:, [0, -1]] = 255
    thicker = digit.copy()
    thicker[8:20, 16] = 120
    budget = Constraint(min_ssim=0.9)
    assert ssim(framed, digit) > 0.9 and not budget.allows(framed, digit)
    assert budget_ssim(framed, digit) == ssim(framed, digit, whole=True)
    assert budget_ssim(thicker, digit) == ssim(thicker, digit) < ssim(thicker, digit, whole=True)
    assert budget_ssims(np.stack([framed, thicker]), digit).tolist() == [budget_ssim(framed, digit),
                                                                         budget_ssim(thicker, digit)]
    d = distances(framed, digit)
    assert d["ssim"] == ssim(framed, digit) and d["ssim_whole"] == ssim(framed, digit, whole=True)
    assert not budget.met_by(d) and budget.met_by({"linf": 255, "ssim": d["ssim"]})
    assert budget.options() == {"constraint": {"max_linf": None, "min_ssim": 0.9}, "ssim_bound": "paper and whole image"}
    assert Constraint(max_linf=8).options() == {"constraint": {"max_linf": 8, "min_ssim": None}}
    assert Constraint().options() == {}


def test_ssims_and_allows_each_give_what_each_image_gives_alone():
    rng = np.random.default_rng(4)
    seed = rng.integers(0, 256, (20, 17, 3), dtype=np.uint8)
    images = np.clip(seed.astype(int) + rng.integers(-90, 90, (6, 20, 17, 3)) * rng.random((6, 1, 1, 1)),
                     0, 255).astype(np.uint8)
    images[0, [0, -1]] = 255  # a painted frame: the whole-image SSIM decides
    assert ssims(images, seed).tolist() == [ssim(image, seed) for image in images]
    assert ssims(images, seed, whole=True).tolist() == [ssim(image, seed, whole=True) for image in images]
    for constraint in (Constraint(min_ssim=0.6), Constraint(max_linf=60), Constraint(min_ssim=0.5, max_linf=80), Constraint()):
        assert constraint.allows_each(images, seed).tolist() == [constraint.allows(image, seed) for image in images]


def test_hand_computed_distances():
    seed = np.zeros((12, 12, 2), np.uint8)
    image = seed.copy()
    image[0, 0, 0] = 30   # one pixel, one channel
    image[5, 5, :] = 40   # one pixel, both channels
    d = distances(image, seed)
    assert d["l0"] == 2 and d["l0_fraction"] == pytest.approx(2 / 144)
    assert d["linf"] == 40
    assert d["l2"] == pytest.approx(np.sqrt((30 / 255) ** 2 + 2 * (40 / 255) ** 2))
    assert d["ssim"] < 1.0 and d["ssim_whole"] < 1.0
    small = distances(seed[:8, :8], seed[:8, :8])
    assert small["ssim"] is None and small["ssim_whole"] is None  # too small for the 11x11 window


@pytest.mark.parametrize("kwargs, message", [({"max_linf": 0}, "1-255"), ({"max_linf": 300}, "1-255"),
                                             ({"min_ssim": 1.0}, "between -1 and 1")])
def test_bad_constraints_are_user_errors(kwargs, message):
    with pytest.raises(UserError, match=message):
        Constraint(**kwargs)


def test_min_ssim_on_images_too_small_for_the_window_is_refused():
    with pytest.raises(UserError, match="--min-ssim needs images of at least 11x11"):
        Constraint(min_ssim=0.5).check_seed(np.zeros((8, 8, 1), np.uint8))


class Recording(Brightness):
    """A Brightness model that keeps every image it was asked about."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def predict_proba(self, images):
        self.seen.append(images.copy())
        return super().predict_proba(images)


@pytest.fixture()
def seeds16() -> ImageSet:
    rng = np.random.default_rng(3)
    return ImageSet(rng.integers(0, 100, (6, 16, 16, 1), dtype=np.uint8), rng.integers(0, 2, 6), "dark16")


@pytest.mark.parametrize("constraint", [Constraint(max_linf=60), Constraint(min_ssim=0.3), Constraint(max_linf=80, min_ssim=0.2)])
def test_no_input_outside_the_constraint_is_ever_queried(seeds16, constraint):
    shape = (16, 16, 1)
    original, compressed = Recording(LOW, shape=shape), Brightness(HIGH, shape=shape)
    strategy = DFlare(constraint=constraint)
    result = run_campaign(original, compressed, seeds16, strategy=strategy, max_queries=3000, timeout=60, progress=False)
    by_seed = {tuple(seeds16.images[i].ravel()): i for i in range(len(seeds16))}
    queried = np.concatenate(original.seen[1:])  # [0] is the seed check
    seed_images = seeds16.images[:]
    for image in queried:  # each queried mutant is within the constraint of its own seed (some seed)
        assert any(constraint.allows(image, seed) for seed in seed_images)
    assert by_seed
    for record in result.records:
        if record.success:
            d = record.trigger_distances
            assert constraint.max_linf is None or d["linf"] <= constraint.max_linf
            assert constraint.min_ssim is None or min(d["ssim"], d["ssim_whole"]) >= constraint.min_ssim
    assert sum(r.constraint_rejections for r in result.records) > 0, "the constraint rejected some mutants"
    assert result.summary.triggers > 0


class Brighten:
    """An operator that always moves every value by 50 levels."""

    name = "brighten"

    def __call__(self, image, rng):
        return np.clip(image.astype(int) + 50, 0, 255).astype(np.uint8)


def test_an_ssim_campaign_saved_when_min_ssim_bounded_the_papers_ssim_alone_refuses_to_resume(seeds16, tmp_path):
    """Its records were judged by a looser budget (a painted frame passed): mixing them with records
    judged by both SSIMs would make one campaign's realism count two things."""
    import json

    from mlflow_di.fuzz.store import CONFIG

    shape = (16, 16, 1)
    pair = Brightness(LOW, shape=shape), Brightness(HIGH, shape=shape)
    strategy = DFlare(constraint=Constraint(min_ssim=0.3))
    run_campaign(*pair, seeds16, strategy=strategy, max_queries=200, out_dir=tmp_path, progress=False)
    config = json.loads((tmp_path / CONFIG).read_text())
    assert config["strategy_options"]["ssim_bound"] == "paper and whole image"
    del config["strategy_options"]["ssim_bound"]  # as a campaign saved before the budget saw the whole image
    (tmp_path / CONFIG).write_text(json.dumps(config))
    with pytest.raises(UserError, match="cannot resume .* strategy_options differ"):
        run_campaign(*pair, seeds16, strategy=strategy, max_queries=200, out_dir=tmp_path, resume=True, progress=False)


def test_a_constraint_no_mutant_can_meet_ends_the_seed_as_constrained(seeds16):
    shape = (16, 16, 1)
    strategy = DFlare(constraint=Constraint(max_linf=1), operators=(Brighten(),))
    result = run_campaign(Brightness(LOW, shape=shape), Brightness(HIGH, shape=shape), seeds16, strategy=strategy,
                          max_queries=100, timeout=60, progress=False)
    assert {str(r.stop) for r in result.records} == {"constrained"}
    assert all(r.queries == 0 and not r.success for r in result.records)


def test_constrained_campaigns_do_not_depend_on_the_batch(seeds16):
    shape = (16, 16, 1)
    strategy = DFlare(constraint=Constraint(max_linf=70))
    runs = [run_campaign(Brightness(LOW, shape=shape), Brightness(HIGH, shape=shape), seeds16, strategy=strategy,
                         max_queries=500, batch=batch, progress=False) for batch in (1, 4)]
    assert _comparable(runs[0]) == _comparable(runs[1])


def test_distance_summary_reads_the_triggers(seeds16):
    shape = (16, 16, 1)
    result = run_campaign(Brightness(LOW, shape=shape), Brightness(HIGH, shape=shape), seeds16, max_queries=3000,
                          progress=False)
    summary = distance_summary(result.records)
    linf = [r.trigger_distances["linf"] for r in result.records if r.success]
    assert summary["trigger_linf_max"] == max(linf) and summary["trigger_linf_median"] == pytest.approx(np.median(linf))
    assert -1 <= summary["trigger_ssim_min"] <= summary["trigger_ssim_median"] <= 1  # SSIM can go below 0 on noise


@pytest.mark.parametrize("strategy", ["dflare", "dflare-paper", "diffchaser"])
def test_shared_campaigns_give_the_records_of_separate_runs_with_fewer_original_inputs(seeds16, strategy):
    shape = (16, 16, 1)
    exports = [Brightness(HIGH, shape=shape, name="a"), Brightness(0.33, shape=shape, name="b"),
               Brightness(HIGH, shape=shape, name="c")]
    alone = []
    for export in exports:
        original = Brightness(LOW, shape=shape)
        alone.append(run_campaign(original, export, seeds16, strategy=strategy, max_queries=1500, batch=4, progress=False))
    original = Recording(LOW, shape=shape)
    shared = run_campaigns(original, exports, seeds16, strategy=strategy, max_queries=1500, batch=4, progress=False)
    for one, together in zip(alone, shared):
        assert _comparable(one) == _comparable(together)
    separate_inputs = sum(r.run_stats.inputs for r in alone)
    evaluated = shared[0].run_stats.shared_original_inputs
    assert evaluated == sum(len(batch) for batch in original.seen[1:])
    # a and c are the same model, so their searches propose identical inputs: at most 2/3 of the separate cost
    assert evaluated <= 2 / 3 * separate_inputs + 1
    assert sum(r.run_stats.original_inputs for r in shared) == pytest.approx(evaluated)


def test_shared_campaigns_check_their_arguments(seeds16):
    shape = (16, 16, 1)
    with pytest.raises(UserError, match="no compressed model"):
        run_campaigns(Brightness(LOW, shape=shape), [], seeds16, progress=False)
    with pytest.raises(UserError, match="2 compressed models but 1 output folders"):
        run_campaigns(Brightness(LOW, shape=shape), [Brightness(HIGH, shape=shape)] * 2, seeds16, out_dirs=["x"],
                      progress=False)


def test_per_class_rows_and_trigger_matrix_by_hand():
    from mlflow_di.fuzz.per_class import class_rows, trigger_matrix
    from mlflow_di.fuzz.results import SeedRecord

    def record(index, label, stop, queries=0, trigger=None):
        return SeedRecord(index=index, label=label, success=stop == "trigger", stop=stop, queries=queries, seconds=0.0,
                          seed_labels=(label, label), seed_probabilities=(1.0, 1.0), trigger_labels=trigger)
    records = [record(0, 0, "trigger", 10, (0, 2)), record(1, 0, "trigger", 30, (0, 2)), record(2, 0, "timeout", 99),
               record(3, 1, "already_deviating"), record(4, 1, "trigger", 5, (1, 0)), record(5, 2, "max_queries", 50)]
    rows = class_rows(records)
    assert rows[0] == {"class": 0, "seeds": 3, "already_deviating": 0, "fuzzed": 3, "triggers": 2,
                       "success_rate": pytest.approx(2 / 3), "mean_queries": 20.0}
    assert rows[1]["fuzzed"] == 1 and rows[1]["success_rate"] == 1.0
    assert rows[2]["success_rate"] == 0.0 and rows[2]["mean_queries"] is None
    matrix = trigger_matrix(records)
    assert matrix.shape == (3, 3) and matrix[0, 2] == 2 and matrix[1, 0] == 1 and matrix.sum() == 3


def test_the_realism_budget_counts_triggers_within_every_measurable_bound():
    """Hand-made records: a trigger counts as realistic when L-inf and (where measurable) SSIM meet the
    budget; the campaign's own bounds replace the default's where it set them."""
    from types import SimpleNamespace

    from mlflow_di.fuzz.realism import (DEFAULT_BUDGET, Constraint, campaign_budget, distribution_rows,
                                        realism_summary)

    def record(linf, ssim, success=True, index=0):
        distances = {"l0": 3, "l0_fraction": 0.1, "l2": 0.5, "linf": linf, "ssim": ssim}
        return SimpleNamespace(success=success, index=index, trigger_distances=distances if success else None)

    within_budget = DEFAULT_BUDGET.met_by
    assert within_budget({"linf": 32, "ssim": 0.9}) and not within_budget({"linf": 33, "ssim": 0.99})
    assert not within_budget({"linf": 4, "ssim": 0.89}) and within_budget({"linf": 4, "ssim": None})
    assert not within_budget(None)
    assert campaign_budget(None) == DEFAULT_BUDGET
    assert campaign_budget(Constraint(max_linf=8)) == Constraint(max_linf=8)
    records = [record(10, 0.95, index=0), record(200, 0.2, index=1), record(30, None, index=2),
               record(0, 1.0, success=False, index=3)]
    summary = realism_summary(records, fuzzed=4)
    assert summary == {"realistic_triggers": 2, "realistic_success_rate": 0.5, "realism_max_linf": 32,
                       "realism_min_ssim": 0.9}
    assert realism_summary(records, fuzzed=4, budget=Constraint(max_linf=20))["realistic_triggers"] == 1
    rows = {row["distance"]: row for row in distribution_rows(records)}
    assert rows["linf"] == {"distance": "linf", "triggers": 3, "min": 10.0, "p25": 20.0, "median": 30.0,
                            "p75": 115.0, "max": 200.0}
    assert rows["ssim"]["triggers"] == 2 and rows["ssim"]["median"] == pytest.approx(0.575)
