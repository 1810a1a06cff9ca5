"""The cell criteria scored where the activations are (criteria_device, DeviceCells) give the host's
cells exactly; the pass that feeds them keeps the other layers on the device (collect_activations'
``on_batch``/``keep``, RowBuffer's staging). On this machine the "device" is torch's CPU: the device
path is forced on, and the GPU test in test_device.py runs the same comparison on CUDA."""
import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mlflow_di.coverage import criteria as criteria_module
from mlflow_di.coverage import criteria_device as on_device
from mlflow_di.coverage.activations import RowBuffer, collect_activations
from mlflow_di.coverage.criteria import ClassicCoverage, Criterion, DeviceCells, register_criterion, unregister_criterion
from mlflow_di.coverage.criteria_neuron import (
    boundary_cells,
    multisection_cells,
    neuron_bounds,
    neuron_coverage_cells,
    top_k_cells,
)
from mlflow_di.coverage.suite import CoverageSuite
from mlflow_di.data import ImageSet
from tests.test_criteria import _random_images, _tiny_cnn

#: few distinct levels (ties, constant neurons), values beyond any bound, and non-finite ones
_LEVELS = st.sampled_from([-2.0, -0.5, 0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 3.0, np.inf, -np.inf, np.nan])
_FLOATS = st.one_of(_LEVELS, st.floats(-4, 4, width=32))


def _values(rows: int = 12, columns: int = 9, elements=_FLOATS):
    return hnp.arrays(np.float32, st.tuples(st.integers(1, rows), st.integers(1, columns)), elements=elements)


def _bounds_of(train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    finite = np.where(np.isfinite(train), train, 0.0).astype(np.float32)
    return neuron_bounds(finite)


def _in_batches(values: np.ndarray, size: int):
    return [torch.from_numpy(values[start:start + size]) for start in range(0, len(values), size)]


def _ored(parts):
    out = parts[0]
    for part in parts[1:]:
        out = out | part
    return out.numpy()


@settings(max_examples=150, deadline=None)
@given(_values(), st.sampled_from([0.75, 0.1, 0.0, np.float64(0.1), 1.0]), st.integers(1, 5))
def test_nc_cells_on_the_device_are_the_host_s(scaled, threshold, batch):
    expected = neuron_coverage_cells(scaled, threshold)
    parts = [on_device.neuron_coverage_cells(part, threshold) for part in _in_batches(scaled, batch)]
    assert np.array_equal(_ored(parts), expected)


@pytest.mark.parametrize("threshold, covered", [(0.1, False), (np.float64(0.1), True)])
def test_nc_compares_with_the_threshold_in_numpy_s_dtype(threshold, covered):
    # float32(0.1) is 0.10000000149: above the float64 0.1, equal to a Python 0.1 compared in float32
    scaled = np.array([[0.1]], np.float32)
    assert neuron_coverage_cells(scaled, threshold).tolist() == [covered]
    assert on_device.neuron_coverage_cells(torch.from_numpy(scaled), threshold).tolist() == [covered]


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from([1, 3, 10, 1000]), st.integers(1, 5))
def test_kmnc_and_boundary_cells_on_the_device_are_the_host_s(data, sections, batch):
    values = data.draw(_values())
    train = data.draw(hnp.arrays(np.float32, (data.draw(st.integers(1, 6)), values.shape[1]), elements=_FLOATS))
    low, high = _bounds_of(train)
    low_t, high_t = torch.from_numpy(low), torch.from_numpy(high)
    parts = _in_batches(values, batch)
    assert np.array_equal(_ored([on_device.multisection_cells(p, low_t, high_t, sections) for p in parts]),
                          multisection_cells(values, low, high, sections))
    below, above = boundary_cells(values, low, high)
    device = [on_device.boundary_cells(p, low_t, high_t) for p in parts]
    assert np.array_equal(_ored([b for b, _ in device]), below)
    assert np.array_equal(_ored([a for _, a in device]), above)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 5))
def test_tknc_cells_on_the_device_are_the_host_s(data, k, batch):
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    values = data.draw(hnp.arrays(np.float32, (data.draw(st.integers(1, 10)), sum(sizes)), elements=_FLOATS))
    parts = [on_device.top_k_cells(p, sizes, k) for p in _in_batches(values, batch)]
    assert np.array_equal(_ored(parts), top_k_cells(values, sizes, k))


def test_tknc_ties_go_to_the_later_neuron_on_the_device_too():
    values = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert on_device.top_k_cells(values, [4], 2).tolist() == [False, True, True, False]


# ------------------------------------------------------------------ the pass that feeds them
class _StagingOnTheCpu(RowBuffer):
    """A RowBuffer that stages CPU tensors as it stages a GPU's."""

    def _stays(self, value) -> bool:
        return isinstance(value, torch.Tensor)


@pytest.mark.parametrize("stage_bytes", [2**28, 100])
def test_a_row_buffer_s_staged_values_land_in_their_rows(stage_bytes, monkeypatch):
    monkeypatch.setattr(_StagingOnTheCpu, "STAGE_BYTES", stage_bytes)  # 100 bytes: copied every few batches
    rng = np.random.default_rng(0)
    full = rng.random((23, 5), dtype=np.float32)
    staged, plain = _StagingOnTheCpu(23), RowBuffer(23)
    for start in (0, 4, 8, 12, 16, 20, 1):  # the last one overwrites rows, out of order
        stop = min(start + 4, 23) if start != 1 else 3
        part = torch.from_numpy(full[start:stop] * (2 if start == 1 else 1))
        staged.write(start, {"x": part, "host": part.numpy()})
        plain.write(start, {"x": part.numpy(), "host": part.numpy()})
    assert np.array_equal(staged.arrays["x"], plain.arrays["x"])
    assert np.array_equal(staged.arrays["host"], plain.arrays["host"])


def test_collect_hands_every_layer_to_on_batch_and_returns_the_kept_ones(rng):
    model = _tiny_cnn()
    inputs = model.to_tensor(_random_images(rng, 10, "x").images)
    seen = []
    kept = collect_activations(model.module, inputs, ["conv1", "fc1"], batch_size=4,
                               reductions={"double": lambda out: 2 * out.flatten(1)[:, :2]},
                               on_batch=lambda values: seen.append(sorted(values)), keep=["fc1"])
    everything = collect_activations(model.module, inputs, ["conv1", "fc1"], batch_size=4,
                                     reductions={"double": lambda out: 2 * out.flatten(1)[:, :2]})
    assert seen == [["conv1", "conv1:double", "fc1", "fc1:double"]] * 3
    assert sorted(kept) == ["fc1", "fc1:double"]
    assert all(np.array_equal(kept[key], everything[key]) for key in kept)


@pytest.fixture()
def device_cells_on_the_cpu(monkeypatch):
    """ClassicCoverage scores its cells batch by batch on torch's CPU, as it does on a GPU."""
    monkeypatch.setattr(criteria_module, "cells_on_device", lambda device: True)


def _assert_same_report(on_device, on_host) -> None:
    """The same report, cells and all, but for LSA's and DSA's last bits (torch sums them in another order)."""
    device_dict, host_dict = on_device.to_dict(), on_host.to_dict()
    for values in ("lsa", "dsa"):
        np.testing.assert_allclose(np.array(device_dict.pop(values), float), np.array(host_dict.pop(values), float),
                                   rtol=1e-10)
    assert device_dict == host_dict and on_device.cells == on_host.cells


@pytest.mark.parametrize("batch_size", [7, 64])
def test_the_device_pass_gives_the_host_pass_s_report(rng, monkeypatch, batch_size):
    model, train, test = _tiny_cnn(), _random_images(rng, 150, "train"), _random_images(rng, 50, "test")
    coverage = ClassicCoverage(batch_size=batch_size, progress=False,
                               criterion_settings={"kmnc_sections": 50, "lsc_upper": 50.0}).fit(model, train)
    on_host = coverage.score(test)
    assert "activations" in coverage.seconds_
    monkeypatch.setattr(criteria_module, "cells_on_device", lambda device: True)
    report, kept = coverage.score_pass(test)
    assert "activations_and_cells" in coverage.seconds_  # the device path ran
    _assert_same_report(report, on_host)
    assert sorted(kept) == ["fc1", "fc1:nc"]  # the SA layer only: conv1's values stayed where they were


def test_the_suite_s_idc_reads_the_kept_layer_of_the_device_pass(rng, monkeypatch):
    monkeypatch.setattr(criteria_module, "cells_on_device", lambda device: True)
    model = _tiny_cnn()
    train = ImageSet(_random_images(rng, 200, "train").images, np.zeros(200, np.int64), "train")
    suite = CoverageSuite(layers=["conv1"], top_m=3, only_correct=False, clusters=(2, 3), batch_size=32,
                          progress=False)
    suite.fit(model, train)
    test = _random_images(rng, 40, "test")
    result = suite.score(test)
    idc_alone = suite.idc_.score(test)["conv1"]
    assert result.idc["conv1"].to_dict() == idc_alone.to_dict()
    monkeypatch.setattr(criteria_module, "cells_on_device", lambda device: False)
    _assert_same_report(result.criteria, suite.score(test).criteria)


def test_a_criterion_without_a_device_score_keeps_the_host_pass(rng, device_cells_on_the_cpu):
    register_criterion(Criterion("firstneuron", "neuron 0 above 0", ("firstneuron",),
                                 score=lambda batch, e: {"firstneuron": batch.values[:, :1].max(axis=0) > 0}))
    try:
        assert not DeviceCells.usable(("nc", "firstneuron")) and DeviceCells.usable(("nc", "kmnc", "lsc"))
        model = _tiny_cnn()
        coverage = ClassicCoverage(criteria=("nc", "firstneuron"), progress=False).fit(model, _random_images(rng, 30, "t"))
        coverage.score(_random_images(rng, 10, "s"))
        assert "activations" in coverage.seconds_
    finally:
        unregister_criterion("firstneuron")


# --- LSA's and DSA's distance work on the device (coverage/surprise_device.py) ---

def _traces(rng, rows: int, columns: int = 6) -> np.ndarray:
    return rng.normal(size=(rows, columns)).round(1)  # coarse values: ties among distances


@pytest.mark.parametrize("block", [7 * 40, 10**9])
def test_nearest_neighbours_on_the_device_are_the_host_s(rng, monkeypatch, block):
    from mlflow_di.coverage import surprise_device
    from mlflow_di.coverage.criteria_surprise import nearest_neighbours

    monkeypatch.setattr(surprise_device, "DEVICE_BLOCK_ELEMENTS", block)  # 7 query rows a block, or all at once
    references = _traces(rng, 40)
    references[25] = references[3]  # an exact tie: the lower index wins on both
    queries = np.concatenate([_traces(rng, 100), references[[3, 10]]])
    distance, index = nearest_neighbours(queries, references)
    on_device, index_on_device = nearest_neighbours(queries, references, device="cpu")
    assert np.array_equal(index_on_device, index) and index[-2] == 3
    np.testing.assert_allclose(on_device, distance, rtol=1e-12, atol=1e-12)


def test_lsa_and_dsa_on_the_device_are_the_host_s(rng):
    from mlflow_di.coverage.criteria_surprise import DistanceSurprise, LikelihoodSurprise

    classes = np.array([0] * 30 + [1] * 25 + [2])  # class 2: one trace, no density
    train = _traces(rng, len(classes))
    test, test_classes = _traces(rng, 60), rng.integers(0, 4, 60)  # class 3 never seen
    likelihood = LikelihoodSurprise().fit(train, classes)
    lsa, lsa_on_device = (likelihood.score_samples(test, test_classes, **on) for on in ({}, {"device": "cpu"}))
    np.testing.assert_array_equal(np.isnan(lsa_on_device), np.isnan(lsa))
    np.testing.assert_allclose(lsa_on_device, lsa, rtol=1e-10)
    host, device = DistanceSurprise().fit(train, classes), DistanceSurprise().fit(train, classes, device="cpu")
    np.testing.assert_allclose(device.nearest_other_, host.nearest_other_, rtol=1e-12)
    dsa, dsa_on_device = host.score_samples(test, test_classes), device.score_samples(test, test_classes, device="cpu")
    np.testing.assert_array_equal(np.isnan(dsa_on_device), np.isnan(dsa))
    np.testing.assert_allclose(dsa_on_device, dsa, rtol=1e-12)
    assert np.isnan(lsa[test_classes >= 2]).all() and np.isnan(dsa[test_classes == 3]).all()

