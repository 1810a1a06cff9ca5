import mlflow_di  # noqa: F401  (torchvision guard before zennit imports torchvision)

import collections

import numpy as np
import pytest
import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.coverage.relevance import input_relevance, layer_relevance
from mlflow_di.models import zoo


def _without_bias(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            module.bias = None
    return model


def _mlp(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(collections.OrderedDict(
        flatten=nn.Flatten(),
        fc1=nn.Sequential(nn.Linear(6, 5, bias=bias), nn.ReLU()),
        fc2=nn.Sequential(nn.Linear(5, 4, bias=bias), nn.ReLU()),
        logits=nn.Linear(4, 3, bias=bias),
    )).eval()


@pytest.mark.parametrize("rule", ["epsilon", "z"])
def test_bias_free_mlp_conserves_relevance_at_every_layer(rule):
    x = torch.rand(16, 6) + 0.1
    result = layer_relevance(_mlp(bias=False), x, ["fc1", "fc2", "logits"], rule=rule, progress=False)
    assert (result.start_relevance > 0).sum() >= 8  # most inputs have relevance to conserve
    for layer in ("fc1", "fc2", "logits"):
        np.testing.assert_allclose(result.relevance[layer].sum(axis=1), result.start_relevance, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(input_relevance(_mlp(bias=False), x, rule=rule, progress=False).sum(axis=1),
                               result.start_relevance, rtol=1e-4, atol=1e-5)


def test_bias_free_lenet5_conserves_relevance_through_conv_and_max_pool():
    model = _without_bias(zoo.build("lenet5"))
    x = torch.rand(8, 1, 28, 28)
    layers = ["conv1", "conv2", "fc1", "fc2"]
    result = layer_relevance(model, x, layers, rule="z", progress=False)
    for layer in layers:
        np.testing.assert_allclose(result.relevance[layer].sum(axis=1), result.start_relevance, rtol=1e-3, atol=1e-6)
    assert result.relevance["conv2"].shape == (8, 16)  # one value per channel


def test_resnet_residual_additions_split_relevance_instead_of_doubling_it():
    model = _without_bias(zoo.build("resnet20"))
    x = torch.randn(2, 3, 32, 32)
    layers = ["conv1", "stage1_block1", "stage2_block1", "stage3_block3"]
    result = layer_relevance(model, x, layers, rule="z", progress=False)
    for layer in layers:
        np.testing.assert_allclose(result.relevance[layer].sum(axis=1), result.start_relevance, rtol=1e-3, atol=1e-5)
    assert not hasattr(model.stage1_block1, "canonizer_sum")  # the canonizer is undone afterwards


def test_epsilon_rule_matches_a_closed_form_computation():
    model = _mlp(bias=True)
    eps = 0.1
    x = torch.rand(9, 6)
    result = layer_relevance(model, x, ["fc1", "fc2"], rule="epsilon", epsilon=eps, progress=False)

    w1, b1 = model.fc1[0].weight.detach().double().numpy(), model.fc1[0].bias.detach().double().numpy()
    w2, b2 = model.fc2[0].weight.detach().double().numpy(), model.fc2[0].bias.detach().double().numpy()
    w3, b3 = model.logits.weight.detach().double().numpy(), model.logits.bias.detach().double().numpy()
    a0 = x.double().numpy()
    a1 = np.maximum(a0 @ w1.T + b1, 0)
    a2 = np.maximum(a1 @ w2.T + b2, 0)
    logits = a2 @ w3.T + b3

    def stabilised(z):
        return z + eps * np.where(z >= 0, 1.0, -1.0)

    start = np.zeros_like(logits)
    decided = logits.argmax(axis=1)
    start[np.arange(len(x)), decided] = logits[np.arange(len(x)), decided]
    r2 = a2 * ((start / stabilised(logits)) @ w3)  # R_j = a_j sum_k w_kj R_k / (z_k + eps sign z_k)
    r1 = a1 * ((r2 / stabilised(a1 @ w2.T + b2)) @ w2)
    np.testing.assert_allclose(result.relevance["fc2"], r2, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(result.relevance["fc1"], r1, rtol=1e-4, atol=1e-6)
    assert not np.allclose(r2.sum(axis=1), start.sum(axis=1), rtol=1e-3)  # epsilon and biases absorb some


def test_activations_come_from_the_same_pass_and_batches_do_not_matter():
    model = _mlp()
    x = torch.rand(10, 6)
    small = layer_relevance(model, x, "fc2", batch_size=3, progress=False)
    large = layer_relevance(model, x, "fc2", batch_size=100, progress=False)
    np.testing.assert_allclose(small.relevance["fc2"], large.relevance["fc2"], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        expected = model.fc2(model.fc1(x)).numpy()
    np.testing.assert_allclose(small.activations["fc2"], expected, rtol=1e-6)
    np.testing.assert_array_equal(small.predictions, model(x).argmax(dim=1).numpy())


def test_the_callers_inputs_are_left_as_they_were_and_inference_tensors_work():
    model = zoo.build("lenet1")
    x = torch.rand(5, 1, 28, 28)
    before = x.clone()
    relevance = input_relevance(model, x, batch_size=2, progress=False)
    assert torch.equal(x, before) and not x.requires_grad
    with torch.inference_mode():  # such a tensor cannot require grad: the pass copies it
        frozen = x.clone()
    np.testing.assert_array_equal(input_relevance(model, frozen, batch_size=2, progress=False), relevance)


def test_explaining_a_given_class_starts_from_its_logit():
    model = _mlp()
    x = torch.rand(5, 6)
    result = layer_relevance(model, x, "fc2", targets=np.full(5, 2), progress=False)
    with torch.no_grad():
        np.testing.assert_allclose(result.start_relevance, model(x)[:, 2].numpy(), rtol=1e-6)


def test_batch_norm_is_merged_into_the_preceding_layer():
    torch.manual_seed(3)
    batch_norm = nn.BatchNorm1d(4)
    batch_norm.running_mean.uniform_(-1, 1)
    batch_norm.running_var.uniform_(0.5, 2)
    batch_norm.weight.data.uniform_(0.5, 2)
    batch_norm.bias.data.uniform_(-1, 1)
    with_bn = nn.Sequential(collections.OrderedDict(
        fc=nn.Sequential(nn.Linear(3, 4), batch_norm, nn.ReLU()), logits=nn.Linear(4, 2))).eval()
    scale = batch_norm.weight / torch.sqrt(batch_norm.running_var + batch_norm.eps)
    merged_linear = nn.Linear(3, 4)
    merged_linear.weight.data = with_bn.fc[0].weight.data * scale[:, None].detach()
    merged_linear.bias.data = ((with_bn.fc[0].bias - batch_norm.running_mean) * scale + batch_norm.bias).detach()
    merged = nn.Sequential(collections.OrderedDict(
        fc=nn.Sequential(merged_linear, nn.ReLU()), logits=with_bn.logits)).eval()
    x = torch.rand(6, 3)
    before = batch_norm.running_var.clone()
    np.testing.assert_allclose(
        layer_relevance(with_bn, x, "fc", rule="epsilon", epsilon=0.05, progress=False).relevance["fc"],
        layer_relevance(merged, x, "fc", rule="epsilon", epsilon=0.05, progress=False).relevance["fc"],
        rtol=1e-4, atol=1e-6,
    )
    assert torch.equal(batch_norm.running_var, before)  # the merge is undone


def test_zplus_and_alpha1beta0_are_the_same_rule():
    model = _mlp()
    x = torch.rand(4, 6)
    a = layer_relevance(model, x, "fc1", rule="zplus", progress=False).relevance["fc1"]
    b = layer_relevance(model, x, "fc1", rule="alpha1beta0", progress=False).relevance["fc1"]
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_unsupported_module_is_named_with_its_type():
    model = nn.Sequential(collections.OrderedDict(fc=nn.Linear(4, 4), norm=nn.LayerNorm(4), logits=nn.Linear(4, 2)))
    with pytest.raises(UserError, match="layer 'norm' of type LayerNorm is not supported"):
        layer_relevance(model, torch.rand(2, 4), "fc", progress=False)


def test_a_final_softmax_module_is_skipped_so_relevance_starts_from_the_logits():
    torch.manual_seed(0)
    logits = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with_softmax = nn.Sequential(logits, nn.Softmax(dim=1))
    inputs = torch.rand(5, 4)
    plain = layer_relevance(logits, inputs, "1", progress=False)
    ended = layer_relevance(with_softmax, inputs, "0.1", progress=False)
    np.testing.assert_allclose(ended.relevance["0.1"], plain.relevance["1"], rtol=1e-6)
    np.testing.assert_allclose(ended.start_relevance, logits(inputs).max(dim=1).values.detach().numpy(), rtol=1e-6)
    assert isinstance(with_softmax(inputs).sum(dim=1), torch.Tensor)
    np.testing.assert_allclose(with_softmax(inputs).sum(dim=1).detach().numpy(), 1.0, rtol=1e-6)  # hook removed


def test_a_softmax_inside_the_model_is_rejected():
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1), nn.Linear(3, 2))
    with pytest.raises(UserError, match="supports a softmax only as the model's last layer"):
        layer_relevance(model, torch.rand(2, 4), "0", progress=False)


class _FunctionalSoftmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return torch.softmax(self.fc(x), dim=1)


def test_probabilities_from_forward_code_are_rejected_with_a_fix():
    with pytest.raises(UserError, match="returns probabilities .* drop the softmax"):
        layer_relevance(_FunctionalSoftmax(), torch.rand(2, 4), "fc", progress=False)


def test_unknown_rule_is_a_user_error():
    with pytest.raises(UserError, match="unknown LRP rule 'gamma'"):
        layer_relevance(_mlp(), torch.rand(2, 6), "fc1", rule="gamma", progress=False)


def test_a_batch_s_bad_logits_and_targets_are_one_line_each():
    inputs = torch.tensor([[0.9, 0, 0, 0], [0.1, 0, 0, 0]])
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with torch.no_grad():
        model[2].bias[1] = torch.nan
    with pytest.raises(UserError, match="NaN|finite"):
        layer_relevance(model, inputs, "0", progress=False)
    with torch.no_grad():
        model[2].bias[1] = 0.0
    with pytest.raises(UserError, match=r"target classes must be in 0..1; got 0..2"):
        layer_relevance(model, inputs, "0", targets=np.array([0, 2]), progress=False)
    with pytest.raises(UserError, match=r"target classes must be in 0..1; got -1..1"):
        layer_relevance(model, inputs, "0", targets=np.array([1, -1]), progress=False)
