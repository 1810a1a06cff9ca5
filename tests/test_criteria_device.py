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


@pytest.mark.parametrize("batch_size", [7, 64])
def test_the_device_pass_gives_the_host_pass_s_report(rng, monkeypatch, batch_size):
    model, train, test = _tiny_cnn(), _random_images(rng, 150, "train"), _random_images(rng, 50, "test")
    coverage = ClassicCoverage(kmnc_sections=50, lsc_upper=50.0, batch_size=batch_size, progress=False).fit(model, train)
    on_host = coverage.score(test)
    assert "activations" in coverage.seconds_
    monkeypatch.setattr(criteria_module, "cells_on_device", lambda device: True)
    report, kept = coverage.score_pass(test)
    assert "activations_and_cells" in coverage.seconds_  # the device path ran
    assert report.to_dict() == on_host.to_dict() and report.cells == on_host.cells
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
    assert suite.score(test).criteria.to_dict() == result.criteria.to_dict()


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
