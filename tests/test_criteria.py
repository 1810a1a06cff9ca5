"""The classic coverage criteria (NC, KMNC, NBC, SNAC, TKNC, LSC, DSC): hand-computed values,
edge cases, the estimator's one-pass fit/score, persistence, merging and monotonicity."""
import json
import math

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.stats import gaussian_kde
from torch import nn

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.coverage.criteria import CRITERIA, CRITERION, ClassicCoverage, CriteriaReport, criterion_settings
from mlflow_di.coverage.criteria_neuron import (
    boundary_cells,
    multisection_cells,
    nc_scaled_means,
    neuron_bounds,
    neuron_coverage_cells,
    top_k_cells,
)
from mlflow_di.coverage.criteria_surprise import (
    DistanceSurprise,
    LikelihoodSurprise,
    distance_surprise_naive,
    nearest_neighbours,
    sadl_surprise_cells,
    surprise_cells,
)
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel


# ----------------------------------------------------------------------------- NC
def test_nc_scales_each_input_before_the_spatial_mean():
    # One input, 3 channels of 1x2: ch0 = [0, 4], ch1 = [1, 1], ch2 = [2, 2].
    # Min-max over the whole output (0..4): ch0 -> [0, 1] mean 0.5; ch1 -> 0.25; ch2 -> 0.5.
    # (Mean first would give means [2, 1, 2] -> scaled [1, 0, 1]: a different answer.)
    output = torch.tensor([[[[0.0, 4.0]], [[1.0, 1.0]], [[2.0, 2.0]]]])
    np.testing.assert_allclose(nc_scaled_means(output).numpy(), [[0.5, 0.25, 0.5]])


def test_nc_dense_output_and_threshold_is_strict():
    # Dense outputs per input: [0, 1, 2, 4] -> scaled [0, .25, .5, 1];
    #                          [8, 6, 5, 2] -> (x - 2) / 6 = [1, 2/3, .5, 0].
    scaled = nc_scaled_means(torch.tensor([[0.0, 1.0, 2.0, 4.0], [8.0, 6.0, 5.0, 2.0]])).numpy()
    np.testing.assert_allclose(scaled, [[0, 0.25, 0.5, 1], [1, 2 / 3, 0.5, 0]], atol=1e-6)
    # threshold 0.75: neuron 3 (input 1) and neuron 0 (input 2) -> 2 of 4 covered
    assert neuron_coverage_cells(scaled, 0.75).tolist() == [True, False, False, True]
    # threshold 0.5 is strict: 0.5 does not count, 2/3 does -> neurons 0, 1, 3
    assert neuron_coverage_cells(scaled, 0.5).tolist() == [True, True, False, True]


def test_nc_constant_output_activates_nothing():
    scaled = nc_scaled_means(torch.full((2, 3, 2, 2), 7.0)).numpy()
    assert np.array_equal(scaled, np.zeros((2, 3)))
    assert not neuron_coverage_cells(scaled, 0.0).any()


# ---------------------------------------------------------------- KMNC, NBC, SNAC
def test_kmnc_sections_by_hand():
    # One neuron, bounds [0, 10], 5 sections of width 2.
    # 0 -> s0, 1.9 -> s0, 2 -> s1, 9.99 -> s4, 10 (== high) -> s4; -0.1 and 10.1 are out of range.
    values = np.array([[0.0], [1.9], [2.0], [9.99], [10.0], [-0.1], [10.1]])
    cells = multisection_cells(values, np.array([0.0]), np.array([10.0]), sections=5)
    assert cells.tolist() == [[True, True, False, False, True]]  # 3 of 5


def test_kmnc_values_outside_bounds_cover_no_section():
    values = np.array([[-5.0], [15.0]])
    assert not multisection_cells(values, np.array([0.0]), np.array([10.0]), sections=5).any()


def test_kmnc_constant_neuron_has_one_reachable_section():
    # Training bounds low == high == 3: v == 3 -> section 0; v == 4 is above the bound.
    low, high = np.array([3.0, 3.0]), np.array([3.0, 3.0])
    cells = multisection_cells(np.array([[3.0, 4.0]]), low, high, sections=4)
    assert cells.tolist() == [[True, False, False, False], [False, False, False, False]]


def test_neuron_bounds_are_training_min_and_max():
    low, high = neuron_bounds(np.array([[1.0, -2.0], [3.0, 5.0], [2.0, 0.0]]))
    assert low.tolist() == [1.0, -2.0] and high.tolist() == [3.0, 5.0]


def test_nbc_and_snac_by_hand():
    # Bounds [0, 1] for both neurons. Neuron 0 sees -1 (< 0): lower corner.
    # Neuron 1 sees 2 (> 1): upper corner; 1 itself is inside (strict).
    values = np.array([[-1.0, 0.5], [0.5, 2.0], [0.2, 1.0]])
    below, above = boundary_cells(values, np.zeros(2), np.ones(2))
    assert below.tolist() == [True, False] and above.tolist() == [False, True]
    # NBC = (1 + 1) / (2 * 2) = 0.5; SNAC = 1 / 2 = 0.5


# ----------------------------------------------------------------------------- TKNC
def test_tknc_top_k_per_layer():
    # Layers of 3 and 2 neurons, k = 2.
    # Input 1: layer A [3, 1, 2] -> top-2 {0, 2}; layer B [5, 4] -> both (size <= k).
    # Input 2: layer A [3, 1, 2] again -> {0, 2}. Neuron A1 is never top-2: 4 of 5 covered.
    values = np.array([[3.0, 1.0, 2.0, 5.0, 4.0], [3.0, 1.0, 2.0, 0.0, 0.0]])
    assert top_k_cells(values, [3, 2], k=2).tolist() == [True, False, True, True, True]


def test_tknc_ties_go_to_the_later_neuron():
    # All equal, k = 1: stable ascending argsort is [0, 1, 2]; the last one (neuron 2) is top.
    assert top_k_cells(np.array([[1.0, 1.0, 1.0]]), [3], k=1).tolist() == [False, False, True]


# -------------------------------------------------------------------------- LSA
def test_lsa_by_hand_in_one_dimension():
    # Class 0 has training traces 0 and 2 (n = 2, d = 1). Unbiased variance = 2; Scott's factor
    # n^(-1/(d+4)) = 2^(-1/5), so the kernel variance is K = 2 * 2^(-2/5) = 2^(3/5) = 1.5157.
    # At x = 1 both kernels are at distance 1: density = N(1; 0, K) = exp(-1/(2K)) / sqrt(2 pi K),
    # LSA = 1/(2K) + 0.5 log(2 pi K) = 0.32988 + 0.5 * log(9.52353) = 0.32988 + 1.12689 = 1.45676.
    model = LikelihoodSurprise().fit(np.array([[0.0], [2.0]]), np.array([0, 0]))
    kernel = 2 ** 0.6
    expected = 0.5 / kernel + 0.5 * math.log(2 * math.pi * kernel)
    assert expected == pytest.approx(1.45676, abs=1e-5)
    assert model.score_samples(np.array([[1.0]]), np.array([0]))[0] == pytest.approx(expected, rel=1e-12)


def test_lsa_matches_scipy_gaussian_kde(rng):
    traces, classes = rng.normal(size=(300, 4)), rng.integers(0, 3, 300)
    queries, query_classes = rng.normal(size=(40, 4)) * 2, rng.integers(0, 3, 40)
    ours = LikelihoodSurprise().fit(traces, classes).score_samples(queries, query_classes)
    reference = [-gaussian_kde(traces[classes == c].T).logpdf(q[:, None])[0] for q, c in zip(queries, query_classes)]
    np.testing.assert_allclose(ours, reference, rtol=1e-10, atol=1e-10)


def test_lsa_drops_low_variance_neurons_for_all_classes(rng):
    # Neuron 2 is constant inside class 1 only; Kim et al. drop it for every class.
    traces = rng.normal(size=(60, 3))
    classes = np.repeat([0, 1], 30)
    traces[classes == 1, 2] = 5.0
    model = LikelihoodSurprise().fit(traces, classes)
    assert model.kept_columns_.tolist() == [True, True, False]
    expected = -gaussian_kde(traces[classes == 0][:, :2].T).logpdf(np.zeros((2, 1)))[0]
    assert model.score_samples(np.zeros((1, 3)), np.array([0]))[0] == pytest.approx(expected, rel=1e-10)


def test_lsa_class_with_one_training_input_gives_nan_and_does_not_crash(rng):
    # Class 1 has a single trace: no KDE exists (zero covariance). Its test inputs get NaN; class 0
    # is unaffected (the single trace's zero variance does not remove every neuron).
    traces = np.vstack([rng.normal(size=(50, 3)), [[9.0, 9.0, 9.0]]])
    classes = np.array([0] * 50 + [1])
    model = LikelihoodSurprise().fit(traces, classes)
    assert model.classes_without_density_ == [1] and model.kept_columns_.all()
    lsa = model.score_samples(np.zeros((3, 3)), np.array([0, 1, 7]))  # class 7 never seen in training
    assert np.isfinite(lsa[0]) and np.isnan(lsa[1]) and np.isnan(lsa[2])


def test_lsa_class_with_fewer_traces_than_neurons_has_no_density(rng):
    model = LikelihoodSurprise().fit(rng.normal(size=(4, 6)), np.zeros(4, dtype=int))
    assert model.classes_without_density_ == [0]


# -------------------------------------------------------------------------- DSA
def test_dsa_by_hand():
    # Training traces: class 0 at (0,0) and (4,0); class 1 at (0,3).
    # (1,0) as class 0: nearest same (0,0) at 1; (0,0) -> nearest class-1 trace (0,3) at 3: 1/3.
    # (4,1) as class 0: nearest same (4,0) at 1; (4,0) -> (0,3) at 5: 1/5.
    # (0,5) as class 1: nearest same (0,3) at 2; (0,3) -> nearest class-0 trace (0,0) at 3: 2/3.
    # (0,0) as class 2: no training trace of class 2: NaN.
    train = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]])
    model = DistanceSurprise().fit(train, np.array([0, 0, 1]))
    assert model.nearest_other_.tolist() == [3.0, 5.0, 3.0]
    dsa = model.score_samples(np.array([[1.0, 0.0], [4.0, 1.0], [0.0, 5.0], [0.0, 0.0]]), np.array([0, 0, 1, 2]))
    np.testing.assert_allclose(dsa[:3], [1 / 3, 1 / 5, 2 / 3], rtol=1e-12)
    assert np.isnan(dsa[3])


def test_dsa_batched_equals_the_naive_per_input_loop(rng):
    train, train_classes = rng.normal(size=(400, 8)), rng.integers(0, 5, 400)
    train_classes[train_classes == 4] = 3  # class 4 has no training trace
    test, test_classes = rng.normal(size=(150, 8)), rng.integers(0, 5, 150)
    batched = DistanceSurprise().fit(train, train_classes).score_samples(test, test_classes)
    naive = distance_surprise_naive(test, test_classes, train, train_classes)
    assert np.isnan(batched).sum() == (test_classes == 4).sum() > 0
    np.testing.assert_allclose(batched, naive, rtol=1e-12, equal_nan=True)


def test_nearest_neighbours_across_chunks(rng):
    queries, references = rng.normal(size=(1100, 3)), rng.normal(size=(70, 3))  # > one 512-row block
    distance, index = nearest_neighbours(queries, references)
    full = np.linalg.norm(queries[:, None, :] - references[None, :, :], axis=2)
    assert np.array_equal(index, full.argmin(axis=1))
    np.testing.assert_allclose(distance, full.min(axis=1), rtol=1e-12)


# ---------------------------------------------------------------- surprise buckets
def test_surprise_buckets_by_hand():
    # [0, 2] in 4 buckets of 0.5: 0 -> b0, 0.49 -> b0, 0.5 -> b1, 2.0 (== upper) -> b3;
    # -0.1 (below the range) -> b0; 2.1 and NaN cover nothing: 3 of 4 buckets.
    cells = surprise_cells(np.array([0.0, 0.49, 0.5, 2.0, 2.1, -0.1, np.nan]), 0.0, 2.0, buckets=4)
    assert cells.tolist() == [True, True, False, True]


def test_values_below_the_range_count_in_the_first_bucket():
    # [0, 2] in 4 buckets: -7.5 and -0.2 lie below 0 -> b0 (the least surprising); 1.2 -> b2.
    cells = surprise_cells(np.array([-7.5, -0.2, 1.2]), 0.0, 2.0, buckets=4)
    assert cells.tolist() == [True, False, True, False]


def test_negative_lsa_is_counted_by_lsc_with_the_default_range():
    # One neuron; class 0's 41 training traces spread over [-0.02, 0.02]: the KDE's density at 0
    # is about 30 > 1, so LSA(0) = -log density < 0. With the default [0, 2000] range in 1000
    # buckets it falls below the range and counts in bucket 0: LSC = 1/1000, not 0.
    train = np.linspace(-0.02, 0.02, 41)[:, None]
    coverage = ClassicCoverage(criteria=("lsc",), layers=["a"], sa_layers=["a"], progress=False)
    coverage.fit_activations({"a": train}, np.zeros(41, dtype=int))
    report = coverage.score_activations({"a": np.array([[0.0]])}, np.array([0]))
    expected_lsa = -math.log(gaussian_kde(train[:, 0])(0.0)[0])
    assert expected_lsa < -3
    np.testing.assert_allclose(report.lsa, [expected_lsa], rtol=1e-9)
    assert report.cells.lsc.nonzero()[0].tolist() == [0]
    assert report.coverage["lsc"] == pytest.approx(1 / 1000)


def test_sadl_buckets_by_hand():
    # Kim et al.'s get_sc: edges linspace(min, upper, k), bucket = digitize - 1.
    # min 1, upper 11, k 4: edges [1, 4.33, 7.67, 11]; 1, 2, 3.5 -> b0; 10 -> b2; 25 (>= upper) -> b3.
    assert sadl_surprise_cells(np.array([1.0, 2.0, 3.5, 10.0, 25.0]), 11.0, 4).tolist() == [True, False, True, True]
    # Negative values set the lower edge: min -5, upper 3, k 5: edges [-5, -3, -1, 1, 3];
    # -5 -> b0, -1 and 0 -> b2, 3 (== upper) -> b4; NaN left out.
    cells = sadl_surprise_cells(np.array([-5.0, -1.0, 0.0, 3.0, np.nan]), 3.0, 5)
    assert cells.tolist() == [True, False, True, False, True]
    assert sadl_surprise_cells(np.array([30.0, 40.0]), 11.0, 4).tolist() == [False, False, False, True]
    assert not sadl_surprise_cells(np.array([np.nan]), 11.0, 4).any()


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 30), elements=st.floats(-50, 80, allow_nan=False)))
def test_sadl_coverage_is_the_reference_formula(values):
    # get_sc's result: distinct digitize indices over k (as a fraction, not a percentage)
    upper, k = 60.0, 7
    if values.min() >= upper:
        return  # get_sc's edges would run backwards; documented separately above
    reference = len(set(np.digitize(values, np.linspace(values.min(), upper, k)))) / k
    assert sadl_surprise_cells(values, upper, k).mean() == pytest.approx(reference)


def test_sadl_rule_merges_by_recomputing_on_all_values():
    # Under SADL's rule the buckets start at each set's minimum, so united cells would be wrong.
    train = np.random.default_rng(3).normal(size=(60, 5))
    coverage = ClassicCoverage(criteria=("lsc", "dsc"), layers=["a"], sa_layers=["a"], progress=False,
                               criterion_settings={"lsc_upper": 20.0, "lsc_buckets": 10, "dsc_buckets": 10,
                                                   "surprise_bucket_rule": "sadl"})
    coverage.fit_activations({"a": train}, _classes(train))
    first, second = np.random.default_rng(4).normal(size=(8, 5)), np.random.default_rng(5).normal(2, 1, size=(8, 5))
    both = np.vstack([first, second])
    one, two = (coverage.score_activations({"a": v}, _classes(v)) for v in (first, second))
    merged, union = one.merge(two), coverage.score_activations({"a": both}, _classes(both))
    assert merged.settings["surprise_bucket_rule"] == "sadl"
    for criterion, values, upper in (("lsc", union.lsa, 20.0), ("dsc", union.dsa, 2.0)):
        expected = sadl_surprise_cells(values, upper, 10)
        assert np.array_equal(getattr(union.cells, criterion), expected)
        assert np.array_equal(getattr(merged.cells, criterion), expected)
    united = one.cells.lsc | two.cells.lsc
    assert not np.array_equal(united, union.cells.lsc)  # the case where uniting would have been wrong


def test_an_unknown_bucket_rule_is_a_user_error():
    with pytest.raises(UserError, match="surprise_bucket_rule 'kim'"):
        ClassicCoverage(criterion_settings={"surprise_bucket_rule": "kim"}).fit(_picking_model(), _images([(1, 2)]))


# ------------------------------------------------------------ estimator, tiny net
def _picking_model() -> TorchModel:
    """fc1 = ReLU(first two pixels of a 2x2 image); logits = fc1 (so the class is the larger pixel)."""
    fc1 = nn.Linear(4, 2, bias=False)
    logits = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        fc1.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]))
        logits.weight.copy_(torch.eye(2))
    module = nn.Sequential()
    module.add_module("flatten", nn.Flatten())
    module.add_module("fc1", nn.Sequential(fc1, nn.ReLU()))
    module.add_module("before_softmax", logits)
    return TorchModel(module, Preprocessing(scale=1.0, layout="NCHW", input_shape=(2, 2, 1)), "picker")


def _images(pixel_pairs) -> ImageSet:
    images = np.zeros((len(pixel_pairs), 2, 2, 1), np.uint8)
    for i, (a, b) in enumerate(pixel_pairs):
        images[i, 0, 0, 0], images[i, 0, 1, 0] = a, b
    return ImageSet(images, np.zeros(len(pixel_pairs)), "pairs")


def test_estimator_on_a_hand_set_network():
    # Training pixels (a, b): (0, 0) and (10, 20) -> fc1 bounds low [0, 0], high [10, 20].
    # Test (5, 25): NC scales [5, 25] -> [0, 1]: neuron 1 covered.  KMNC (10 sections):
    # neuron 0 -> floor(5/10*10) = section 5; neuron 1: 25 > 20, no section -> 1 / 20.
    # NBC: only neuron 1's upper corner -> 1/4; SNAC 1/2. TKNC k=1: neuron 1 is top -> 1/2.
    model = _picking_model()
    coverage = ClassicCoverage(criteria=("nc", "kmnc", "nbc", "snac", "tknc"), progress=False,
                               criterion_settings={"kmnc_sections": 10, "tknc_k": 1}).fit(model, _images([(0, 0), (10, 20)]))
    assert coverage.layers_ == ["fc1"] and coverage.layer_sizes_ == [2]
    assert coverage.low_.tolist() == [0, 0] and coverage.high_.tolist() == [10, 20]
    report = coverage.score(_images([(5, 25)]))
    assert report.coverage == {"nc": 0.5, "kmnc": 1 / 20, "nbc": 0.25, "snac": 0.5, "tknc": 0.5}
    assert np.flatnonzero(report.cells.kmnc[0]).tolist() == [5]
    # Add (30, 1): NC neuron 0 ([30, 1] -> [1, 0]); neuron 0 above 10 (upper corner); top-1 is
    # neuron 0; neuron 1 at 1 -> section floor(1/20*10) = 0. KMNC 2/20, NBC 2/4, SNAC 1, TKNC 1.
    both = coverage.score(_images([(5, 25), (30, 1)]))
    assert both.coverage == {"nc": 1.0, "kmnc": 2 / 20, "nbc": 0.5, "snac": 1.0, "tknc": 1.0}


def test_estimator_predictions_come_from_the_model_output():
    model = _picking_model()
    coverage = ClassicCoverage(criteria=("dsc",), sa_layers=["fc1"], progress=False)
    coverage.fit(model, _images([(0, 1), (9, 0), (0, 4)]))  # predicted classes 1, 0, 1
    assert coverage.distance_.classes_.tolist() == [1, 0, 1]
    # (8, 0) as class 0: nearest (9, 0) at 1; (9, 0) -> nearest class-1 trace (0, 1) at sqrt(82).
    report = coverage.score(_images([(8, 0)]))
    assert report.dsa[0] == pytest.approx(1 / math.sqrt(82), rel=1e-6)


def _tiny_cnn(seed: int = 0) -> TorchModel:
    torch.manual_seed(seed)  # fixed weights: deterministic test model
    module = nn.Sequential()
    module.add_module("conv1", nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()))
    module.add_module("pool1", nn.MaxPool2d(2))
    module.add_module("flatten", nn.Flatten())
    module.add_module("fc1", nn.Sequential(nn.Linear(4 * 3 * 3, 6), nn.ReLU()))
    module.add_module("before_softmax", nn.Linear(6, 3))
    return TorchModel(module, Preprocessing(scale=1 / 255, layout="NCHW", input_shape=(8, 8, 1)), "tiny")


def _random_images(rng, count: int, name: str) -> ImageSet:
    return ImageSet(rng.integers(0, 256, (count, 8, 8, 1), dtype=np.uint8), np.zeros(count), name)


@pytest.fixture()
def tiny_fit(rng):
    model = _tiny_cnn()
    train = _random_images(rng, 300, "train")
    coverage = ClassicCoverage(progress=False, criterion_settings={"kmnc_sections": 50, "lsc_upper": 50.0}).fit(model, train)
    return model, train, coverage


def test_estimator_equals_the_pure_functions_on_collected_activations(tiny_fit, rng):
    from mlflow_di.coverage.activations import collect_activations

    model, train, coverage = tiny_fit
    test = _random_images(rng, 120, "test")
    report = coverage.score(test)
    assert coverage.layers_ == ["conv1", "fc1"] and coverage.sa_layers_ == ["fc1"]
    train_values = collect_activations(model.module, model.to_tensor(train.images), ["conv1", "fc1"])
    values = collect_activations(model.module, model.to_tensor(test.images), ["conv1", "fc1"],
                                 reductions={"nc": nc_scaled_means})
    side = np.hstack([values["conv1"], values["fc1"]])
    low, high = neuron_bounds(np.hstack([train_values["conv1"], train_values["fc1"]]))
    assert np.array_equal(report.cells.kmnc, multisection_cells(side, low, high, 50))
    assert np.array_equal(report.cells.nc, neuron_coverage_cells(np.hstack([values["conv1:nc"], values["fc1:nc"]])))
    assert np.array_equal(report.cells.tknc, top_k_cells(side, [4, 6], 3))
    with torch.no_grad():
        train_pred = model.module(model.to_tensor(train.images)).argmax(1).numpy()
        test_pred = model.module(model.to_tensor(test.images)).argmax(1).numpy()
    naive = distance_surprise_naive(values["fc1"], test_pred, train_values["fc1"], train_pred)
    np.testing.assert_allclose(report.dsa, naive, rtol=1e-9, equal_nan=True)
    assert set(report.coverage) == set(CRITERIA)
    assert all(0.0 <= v <= 1.0 for v in report.coverage.values())


def test_chosen_layers_with_the_default_sa_layer(rng):
    coverage = ClassicCoverage(layers=["pool1"], progress=False, criterion_settings={"kmnc_sections": 10})
    report = coverage.fit(_tiny_cnn(), _random_images(rng, 100, "train")).score(_random_images(rng, 20, "t"))
    assert coverage.layers_ == ["pool1"] and coverage.sa_layers_ == ["fc1"]
    assert report.cells.kmnc.shape == (4, 10) and report.lsa.shape == (20,)


def test_fit_and_score_are_deterministic(tiny_fit, rng):
    model, train, coverage = tiny_fit
    test = _random_images(rng, 80, "test")
    again = ClassicCoverage(progress=False, criterion_settings={"kmnc_sections": 50, "lsc_upper": 50.0}).fit(model, train)
    assert coverage.score(test).to_json() == again.score(test).to_json()


def test_report_json_round_trip(tiny_fit, rng):
    model, _, coverage = tiny_fit
    report = coverage.score(_random_images(rng, 60, "test"))
    report.dsa[0], report.lsa[1] = np.inf, np.nan  # non-finite values must survive strict JSON
    restored = CriteriaReport.from_json(report.to_json())
    assert restored.coverage == report.coverage and restored.criteria == report.criteria
    assert restored.settings == report.settings and restored.num_inputs == 60
    np.testing.assert_array_equal(restored.lsa, report.lsa)
    np.testing.assert_array_equal(restored.dsa, report.dsa)
    for name in ("nc", "kmnc", "below", "above", "tknc", "lsc", "dsc"):
        assert np.array_equal(getattr(restored.cells, name), getattr(report.cells, name))
    assert "NaN" not in report.to_json() and "Infinity" not in report.to_json()


def test_save_and_load_score_without_training_data(tiny_fit, rng, tmp_path):
    model, _, coverage = tiny_fit
    test = _random_images(rng, 70, "test")
    coverage.save(tmp_path / "stats")
    loaded = ClassicCoverage.load(tmp_path / "stats", model=model, progress=False)
    assert loaded.score(test).to_json() == coverage.score(test).to_json()


def test_merged_reports_equal_the_report_of_the_union(tiny_fit, rng):
    model, _, coverage = tiny_fit
    first, second = _random_images(rng, 50, "a"), _random_images(rng, 40, "b")
    merged = coverage.score(first).merge(coverage.score(second))
    union = coverage.score(ImageSet(np.concatenate([first.images, second.images]), np.zeros(90), "a+b"))
    assert merged.coverage == union.coverage and merged.num_inputs == 90
    np.testing.assert_allclose(merged.lsa, union.lsa, rtol=1e-9)
    assert CriteriaReport.combine([coverage.score(first), coverage.score(second)]).coverage == union.coverage


def test_merge_refuses_reports_with_other_settings(tiny_fit, rng):
    model, train, coverage = tiny_fit
    other = ClassicCoverage(progress=False, criterion_settings={"kmnc_sections": 20, "lsc_upper": 50.0}).fit(model, train)
    test = _random_images(rng, 10, "t")
    with pytest.raises(UserError, match="cannot merge"):
        coverage.score(test).merge(other.score(test))


def test_user_errors_say_what_is_wrong():
    model = _picking_model()
    with pytest.raises(UserError, match="unknown criteria"):
        ClassicCoverage(criteria=("nc", "idc")).fit(model, _images([(1, 2)]))
    with pytest.raises(UserError, match="lsc_upper must be greater"):
        ClassicCoverage(criterion_settings={"lsc_upper": -1.0}).fit(model, _images([(1, 2)]))
    with pytest.raises(UserError, match="unknown layer 'fc9'"):
        ClassicCoverage(criteria=("nc",), layers=["fc9"], progress=False).fit(model, _images([(1, 2)]))
    with pytest.raises(UserError, match="not fitted"):
        ClassicCoverage().score(_images([(1, 2)]))


# --------------------------------------------------------------- monotonicity
_values = hnp.arrays(np.float64, st.tuples(st.integers(1, 12), st.just(5)),
                     elements=st.floats(-3, 3, allow_nan=False, width=32))


def _activations(values: np.ndarray) -> dict:
    # Layers "a" (3 neurons) and "b" (2 neurons); NC's scaled means faked as a fixed squash; the SA
    # trace is layer "a"; the predicted class is the sign pattern of neuron 0.
    return {"a": values[:, :3], "b": values[:, 3:], "a:nc": np.tanh(values[:, :3]) / 2 + 0.5,
            "b:nc": np.tanh(values[:, 3:]) / 2 + 0.5}


def _classes(values: np.ndarray) -> np.ndarray:
    return (values[:, 0] > 0).astype(int)


_TRAIN = np.random.default_rng(1).normal(size=(80, 5))
_MONOTONE = ClassicCoverage(layers=["a", "b"], sa_layers=["a"], progress=False,
                            criterion_settings={"kmnc_sections": 20, "tknc_k": 1, "lsc_lower": -10.0, "lsc_upper": 10.0,
                                                "lsc_buckets": 40, "dsc_buckets": 40}
                            ).fit_activations(_activations(_TRAIN), _classes(_TRAIN))


@settings(max_examples=60, deadline=None)
@given(_values, _values)
def test_adding_inputs_never_lowers_any_criterion(first, extra):
    both = np.vstack([first, extra])
    before = _MONOTONE.score_activations(_activations(first), _classes(first)).coverage
    after = _MONOTONE.score_activations(_activations(both), _classes(both)).coverage
    assert set(before) == set(CRITERIA)
    for criterion in CRITERIA:
        assert after[criterion] >= before[criterion], criterion


# ------------------------------------------------------------- reference model
@pytest.mark.slow
def test_lenet5_gaussian_noise_never_lowers_a_criterion(shared_dir, mnist_spec):
    from mlflow_di.data import load_images
    from mlflow_di.models.keras_import import import_keras

    model = import_keras("lenet5", shared_dir / "models" / "deepimportance" / "LeNet5.h5")
    data = load_images(mnist_spec)
    train, test = data.subset(slice(0, 1000)), data.subset(slice(5000, 5500), "test")
    coverage = ClassicCoverage(progress=False).fit(model, train)
    original = coverage.score(test)
    noise = np.random.default_rng(0).normal(0, 0.3 * 255, test.images.shape)
    noisy = ImageSet(np.clip(test.images + noise, 0, 255).astype(np.uint8), test.labels, "noisy")
    combined = original.merge(coverage.score(noisy))
    for criterion in CRITERIA:
        assert combined.coverage[criterion] >= original.coverage[criterion], criterion
    # Measured (sigma 0.3*255, 1000 training / 500 test inputs): KMNC 0.23 -> 0.36, the largest rise.
    assert combined.coverage["kmnc"] > original.coverage["kmnc"]


def test_a_criterion_is_one_record_the_estimator_the_passes_and_the_command_line_read(tracking_uri, tmp_path, capsys):
    """A toy criterion with a setting (a neuron counts once some input lifts it above ``positive_margin``),
    registered as one record: the estimator scores it with the setting's default or a given value, the
    streamed passes and a saved estimator give the same figure, `coverage --criteria` and
    `--criterion-setting` take it, and a value outside the declared range is refused on both sides."""
    from mlflow_di.cli import main
    from mlflow_di.coverage.criteria import Criterion, register_criterion, unregister_criterion
    from mlflow_di.coverage.partials import LocalPasses
    from mlflow_di.coverage.suite import CoverageSuite
    from mlflow_di.data import load_images
    from mlflow_di.mlflow_edge import models as edge_models, runs
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel
    from mlflow_di.settings import OptionSpec

    margin = OptionSpec("positive_margin", "How far above 0 a neuron must go.", "float", low=0, default=0.0)
    register_criterion(Criterion("positive", "a neuron above positive_margin for some input", ("positive",),
                                 settings=(margin,),
                                 score=lambda batch, e: {"positive": (batch.values > e.setting("positive_margin"))
                                                         .any(axis=0)}))
    try:
        model = TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing, name="toy")
        train, test = load_images("digits[0:300]"), load_images("digits[300:400]")
        classic = ClassicCoverage(criteria=("nc", "positive"), progress=False).fit(model, train)
        report = classic.score(test)
        values, _ = classic.collect(model, test)
        side = np.hstack([values[layer] for layer in classic.layers_])
        assert report.coverage["positive"] == pytest.approx((side > 0).any(axis=0).mean())
        chosen = {"positive_margin": 0.5}
        lifted = ClassicCoverage(criteria=("positive",), criterion_settings=chosen, progress=False).fit(model, train)
        expected = (side > 0.5).any(axis=0).mean()
        assert expected < report.coverage["positive"]
        assert lifted.score(test).coverage["positive"] == pytest.approx(expected)
        assert ClassicCoverage.load(lifted.save(tmp_path / "saved"), model).score(test).coverage["positive"] == \
            pytest.approx(expected)
        suite = CoverageSuite(criteria="nc,positive", criterion_settings=chosen, progress=False)
        local = suite.fit(model, train).score(test).metrics()
        streamed = CoverageSuite(criteria="nc,positive", criterion_settings=chosen, batch_size=37, progress=False).fit(
            model, train, passes=LocalPasses()).score(test, passes=LocalPasses())
        assert streamed.metrics()["positive"] == local["positive"] == pytest.approx(expected)
        for bad, message in (({"positive_margin": -1.0}, "positive_margin must be at least 0"),
                             ({"margin": 1.0}, "no chosen criterion has the setting margin")):
            with pytest.raises(UserError, match=message):
                ClassicCoverage(criteria=("positive",), criterion_settings=bad, progress=False).fit(model, train)
        with runs.tracked_run("train"):
            edge_models.log_torch_model(model, registered_model_name="toy")
        out = tmp_path / "coverage.json"
        command = ["coverage", "--model-uri", "models:/toy/1", "--train-data", "digits[0:300]", "--test-data",
                   "digits[300:400]", "--criteria", "positive", "--json-out", str(out)]
        assert main(command) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["positive"] == pytest.approx(report.coverage["positive"])
        assert main([*command, "--criterion-setting", "positive_margin=0.5"]) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["positive"] == pytest.approx(expected)
        capsys.readouterr()
        assert main([*command, "--criterion-setting", "positive_margin=-1"]) == 2
        assert "positive_margin must be at least 0" in capsys.readouterr().err
        # a built-in criterion's setting goes through the same door, on the command line and in Python
        sections = ClassicCoverage(criteria=("kmnc",), criterion_settings={"kmnc_sections": 7}, progress=False)
        built_in = sections.fit(model, train).score(test).coverage["kmnc"]
        builtin_command = [*command[:-4], "--criteria", "kmnc", "--json-out", str(out)]
        assert main([*builtin_command, "--criterion-setting", "kmnc_sections=7"]) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["kmnc"] == pytest.approx(built_in)
        assert main([*builtin_command, "--criterion-setting", "kmnc_sections=0"]) == 2
        assert "kmnc_sections must be at least 1" in capsys.readouterr().err
    finally:
        unregister_criterion("positive")


@pytest.mark.parametrize("name", list(CRITERION))
def test_every_declared_criterion_keeps_the_contract(name):
    """Each criterion's record (built-in or registered, one kind of record): it fills cells or has an adequacy
    model, and each setting it declares has a default inside its own range that the estimator reads back."""
    criterion = CRITERION[name]
    assert criterion.cell and criterion.fields and callable(criterion.count)
    assert (criterion.score is not None) != (criterion.adequacy is not None)
    estimator = ClassicCoverage(criteria=(name,))
    for spec in criterion.settings:
        assert spec.check(spec.default, name) == spec.default and criterion_settings([name])[spec.field] == spec
        assert estimator.setting(spec.field) == spec.default
    with pytest.raises(UserError, match="no chosen criterion has the setting"):
        ClassicCoverage(criteria=(name,), criterion_settings={"unheard_of": 1}).setting("nc_threshold")
