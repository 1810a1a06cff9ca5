"""The paper-era reproduction devices (benchmarks only): DeepImportance's reference LRP and
comb_cov.py's pairing of neurons with centroids, on hand-computed cases and LRP's conservation."""
import pathlib
import sys

import numpy as np
import pytest
import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.reproduce.idc_paper_era import class_idc  # noqa: E402
from benchmarks.reproduce.reference_lrp import (  # noqa: E402
    _maxpool_relevance, reference_forward, reference_layers, reference_relevance, summed_relevance)


def _lenet(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("conv1", nn.Sequential(nn.Conv2d(1, 3, 3, bias=bias), nn.ReLU()))
    model.add_module("pool1", nn.MaxPool2d(2))
    model.add_module("flatten", nn.Flatten())
    model.add_module("fc1", nn.Sequential(nn.Linear(3 * 3 * 3, 5, bias=bias), nn.ReLU()))
    model.add_module("out", nn.Linear(5, 4, bias=bias))
    return model.eval()


def test_the_relus_after_convolutions_are_dropped_and_the_others_kept():
    kinds = [(name, type(layer).__name__) for name, layer in reference_layers(_lenet())]
    assert kinds == [("conv1", "Conv2d"), ("pool1", "MaxPool2d"), ("flatten", "Flatten"), ("fc1", "Linear"),
                     ("fc1", "ReLU"), ("out", "Linear")]


def test_a_dense_layer_by_hand():
    """z-rule with the bias in the denominator: R_j = a_j w_jk / (sum_j a_j w_jk + b_k) R_k."""
    model = nn.Sequential()
    model.add_module("hidden", nn.Flatten())  # a pass-through leaf the relevance is read at
    model.add_module("out", nn.Linear(2, 2))
    with torch.no_grad():
        model.out.weight[:] = torch.tensor([[1.0, 3.0], [0.0, 1.0]])
        model.out.bias[:] = torch.tensor([1.0, 0.0])
    x = torch.tensor([[[[2.0, 1.0]]]])  # logits: 1*2 + 3*1 + 1 = 6 and 1: class 0 starts with 6
    relevance = reference_relevance(model, x, "hidden")
    np.testing.assert_allclose(relevance, [[2 / 6 * 6, 3 / 6 * 6]])  # the bias keeps its 1/6 share


def test_relevance_is_conserved_without_biases():
    """Without biases the z-rule keeps every layer's total at the start relevance: the highest logit
    of the ReLU-less network (not of the model itself)."""
    model = _lenet(bias=False)
    x = torch.rand(6, 1, 8, 8)
    start = reference_forward(reference_layers(model), x)[-1].max(1).values.numpy()
    for name in ("conv1", "fc1"):
        np.testing.assert_allclose(reference_relevance(model, x, name).sum(1), start, rtol=1e-9)


def test_max_pooling_splits_a_window_between_tied_maxima():
    inputs = torch.tensor([[[[1.0, 1.0], [0.0, 1.0]]]], dtype=torch.float64)
    relevance = _maxpool_relevance(nn.MaxPool2d(2), inputs, torch.tensor([[[[3.0]]]], dtype=torch.float64))
    np.testing.assert_allclose(relevance[0, 0].numpy(), [[1.0, 1.0], [0.0, 1.0]])


def test_summed_relevance_sums_what_reference_relevance_gives_per_input():
    model, x = _lenet(), torch.rand(5, 1, 8, 8)
    np.testing.assert_allclose(summed_relevance(model, x)[3], reference_relevance(model, x, "fc1").sum(0), rtol=1e-12)


def test_unsupported_layers_are_named():
    model = nn.Sequential()
    model.add_module("norm", nn.BatchNorm2d(1))
    with pytest.raises(ValueError, match="'norm' has BatchNorm2d"):
        reference_layers(model)


def test_comb_cov_pairing_compares_each_neuron_with_another_neurons_centroids():
    """Neuron 1 is the more relevant; its values sit at 100/200, neuron 0's at 0.5/10. Correctly paired,
    the two test inputs cover 2 of the 4 cells; paired as comb_cov.py does (neuron 1 with neuron 0's
    centroids and the other way round), both inputs fall into one cell."""
    order = np.array([1, 0])
    centroids = {0: np.array([0.5, 10.0]), 1: np.array([100.0, 200.0])}
    values = np.array([[0.5, 100.0], [10.0, 200.0]])
    result = class_idc(order, centroids, values)
    assert result == {"reference": 2 / 4, "paper_era": 1 / 4}
