import mlflow_di  # noqa: F401  (torchvision guard before anything imports zennit/torchvision)

import collections

import numpy as np
import pytest
import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.coverage.activations import collect_activations, default_layer, hidden_layers
from mlflow_di.models import zoo


def _small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(collections.OrderedDict(
        conv=nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU()),
        flatten=nn.Flatten(),
        fc=nn.Sequential(nn.Linear(3 * 4 * 4, 5), nn.ReLU()),
        logits=nn.Linear(5, 2),
    )).eval()


def test_conv_neurons_are_channel_means_and_dense_outputs_unchanged():
    model = _small_cnn()
    x = torch.rand(7, 1, 6, 6)
    result = collect_activations(model, x, ["conv", "fc"], batch_size=3)
    with torch.no_grad():
        conv_out = model.conv(x)
        fc_out = model.fc(model.flatten(conv_out))
    assert result["conv"].shape == (7, 3)
    np.testing.assert_allclose(result["conv"], conv_out.mean(dim=(2, 3)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(result["fc"], fc_out.numpy(), rtol=1e-6)


def test_batch_size_does_not_change_values_and_reductions_are_keyed_by_layer():
    model = _small_cnn()
    x = torch.rand(10, 1, 6, 6)
    whole = collect_activations(model, x, ["conv"], batch_size=100,
                                reductions={"max": lambda out: out.flatten(2).amax(dim=2)})
    pieces = collect_activations(model, x, ["conv"], batch_size=3,
                                 reductions={"max": lambda out: out.flatten(2).amax(dim=2)})
    np.testing.assert_allclose(whole["conv"], pieces["conv"], rtol=1e-6)
    with torch.no_grad():
        expected_max = model.conv(x).flatten(2).amax(dim=2).numpy()
    np.testing.assert_allclose(pieces["conv:max"], expected_max, rtol=1e-6)


def test_unknown_layer_lists_available_layers():
    with pytest.raises(UserError, match=r"unknown layer 'fc9'.*conv, conv\.0.*logits"):
        collect_activations(_small_cnn(), torch.rand(2, 1, 6, 6), ["fc9"])


def test_training_mode_is_restored_after_collection():
    model = _small_cnn().train()
    collect_activations(model, torch.rand(2, 1, 6, 6), ["fc"])
    assert model.training


def test_default_and_hidden_layers_of_the_zoo_lenets():
    assert default_layer(zoo.build("lenet5")) == "fc2"
    assert default_layer(zoo.build("lenet1")) == "conv2"
    assert hidden_layers(zoo.build("lenet5")) == ["conv1", "conv2", "fc1", "fc2"]


def test_flat_sequential_layers_are_named_after_their_weights_and_measured_after_their_activation():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    assert hidden_layers(model) == ["0", "2"]
    assert default_layer(model) == "2"
    inputs = torch.randn(16, 4)
    values = collect_activations(model, inputs, ["0", "2"])
    with torch.no_grad():
        np.testing.assert_allclose(values["0"], model[1](model[0](inputs)).numpy(), rtol=1e-6)
        np.testing.assert_allclose(values["2"], model[:4](inputs).numpy(), rtol=1e-6)


def test_model_without_hidden_layer_is_a_user_error():
    with pytest.raises(UserError, match="no hidden layer"):
        default_layer(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))


class _TwoWays(nn.Module):
    """One computation, its activations written as ``style`` says."""

    def __init__(self, style: str):
        super().__init__()
        torch.manual_seed(0)
        self.style = style
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4).eval()
        self.relu = nn.ReLU(inplace=style == "inplace-module")
        self.fc = nn.Linear(4 * 4 * 4, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.2, 0.2)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        x = self.bn(self.conv(x))
        if self.style in ("module", "inplace-module"):
            x = self.relu(x)
        elif self.style == "torch.relu":
            x = torch.relu(x)
        elif self.style == "functional":
            x = nn.functional.relu(x)
        elif self.style == "method_":
            x = x.relu_()
        elif self.style == "aten":
            x = torch.ops.aten.relu.default(x)
        return self.fc(x.flatten(1))


STYLES = ("module", "inplace-module", "torch.relu", "functional", "method_", "aten")


@pytest.mark.parametrize("style", STYLES)
def test_a_layer_is_measured_after_its_batch_norm_and_activation_however_they_are_written(style):
    inputs = torch.randn(8, 1, 6, 6)
    model = _TwoWays(style)
    with torch.no_grad():
        expected = torch.relu(model.bn(model.conv(inputs))).mean(dim=(2, 3)).numpy()
    np.testing.assert_allclose(collect_activations(model, inputs, ["conv"])["conv"], expected, rtol=1e-6, atol=1e-7)
    assert hidden_layers(model) == ["conv"]


@pytest.mark.parametrize("style", STYLES)
def test_relevance_at_a_layer_does_not_depend_on_how_its_activation_is_written(style):
    from mlflow_di.coverage.relevance import layer_relevance

    inputs = torch.randn(8, 1, 6, 6)
    reference = layer_relevance(_TwoWays("module"), inputs, ["conv"], progress=False)
    got = layer_relevance(_TwoWays(style), inputs, ["conv"], progress=False)
    np.testing.assert_allclose(got.relevance["conv"], reference.relevance["conv"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.activations["conv"], reference.activations["conv"], rtol=1e-6, atol=1e-7)


def test_an_activation_on_other_values_does_not_move_a_layer():
    class Sidecar(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y + torch.relu(x)  # a ReLU, but of the input: fc stays where it is

    model, inputs = Sidecar(), torch.randn(5, 4)
    with torch.no_grad():
        np.testing.assert_allclose(collect_activations(model, inputs, ["fc"])["fc"], model.fc(inputs).numpy(), rtol=1e-6)
