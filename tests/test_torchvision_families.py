"""torchvision's CNN families through every command, and LRP's conservation on each.

Random-initialised models (no weights can be downloaded here) at 32x32 RGB: describe -> compress
(int8-dynamic through the CLI; int8-static and pruning at the engine level, because each ONNX
export of a large family costs 10-30 s here and the CLI path is the same for every method) -> coverage (IDC with LRP + the classic criteria) -> fuzz ->
gate, each through the CLI on a registered model. The images are labelled with the model's own
predictions, so that IDC's "correctly classified" analysis inputs exist for a random model.
"""
import json

import mlflow
import numpy as np
import pytest
import torch
from torch import nn

import mlflow_di._compat  # noqa: F401  (torchvision on the CPU build of torch)
import torchvision

from mlflow_di.cli import main
from mlflow_di.coverage.relevance import input_relevance
from mlflow_di.errors import UserError
from mlflow_di.mlflow_edge import models as edge_models, runs as tracking
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel

FAMILIES = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0",
            "vgg11_bn", "densenet121", "squeezenet1_0")
SIZE = 32
PREPROCESSING = Preprocessing(scale=1 / 255, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375),
                              layout="NCHW", output="logits", input_shape=(SIZE, SIZE, 3))


def build(family: str) -> nn.Module:
    """The family's torchvision model with 10 classes, seeded; VGG gets a narrow head (its stock
    head alone has 120M weights, which would only make the test slow, not different).

    Random init is made to behave like a trained net in one respect that matters here: its batch
    norms get statistics from one pass over random images, and its last layer larger weights.
    Freshly built MobileNets output logits of about 1e-9 (unit running variances with activations
    far smaller), whose top-1 label flips with the batch size, so IDC found no "correctly
    classified" inputs.
    """
    torch.manual_seed(0)
    model = getattr(torchvision.models, family)(num_classes=10)
    if family.startswith("vgg"):
        model.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        model.classifier = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Dropout(), nn.Linear(64, 10))
    head = [layer for layer in model.modules() if isinstance(layer, (nn.Linear, nn.Conv2d))][-1]
    nn.init.normal_(head.weight, std=10.0 / head.weight[0].numel() ** 0.5)
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.momentum = None  # a cumulative average: one pass sets the statistics
    model.train()
    with torch.no_grad():
        model(torch.rand(16, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0)) * 4 - 2)
    return model.eval()


def _normalised_without_biases(model: nn.Module, inputs: torch.Tensor) -> nn.Module:
    """Zero every bias and make each batch norm a pure scaling (zero mean) fitted to ``inputs``, so
    that LRP-epsilon must conserve relevance exactly (nothing is absorbed by biases)."""
    for module in model.modules():
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = 1.0
    model.train()
    with torch.no_grad():
        model(inputs)
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.zero_()
    return model


#: Measured sum(input relevance) / start logit: 1.000 (to 1e-3) for the ReLU families; the
#: families with signed activations (Hardswish, SiLU) deviate per input by up to 0.7% (MobileNetV3)
#: and 5% (EfficientNet-B0) - not explained yet; the stabilisers of the residual sums' Norm rule
#: where the two operands nearly cancel are the suspect. Without the canonizers the deviations were
#: 10-30% (measured), so these bounds still catch a missing one.
CONSERVATION_TOLERANCE = {"mobilenet_v3_small": 0.02, "mobilenet_v3_large": 0.02, "efficientnet_b0": 0.08}


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_conserves_relevance_through_the_family(family):
    inputs = torch.rand(4, 3, SIZE, SIZE)
    model = _normalised_without_biases(build(family), inputs)
    with torch.no_grad():
        start = model(inputs).max(dim=1).values.numpy()
    relevance = input_relevance(model, inputs, epsilon=1e-20, progress=False)
    ratio = relevance.reshape(len(inputs), -1).sum(axis=1) / start
    np.testing.assert_allclose(ratio, 1.0, atol=CONSERVATION_TOLERANCE.get(family, 2e-3))


class _UnknownResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 2))

    def forward(self, x):
        return self.head(x + self.conv(x))


def test_a_residual_addition_without_a_canonizer_is_refused_by_name():
    with pytest.raises(UserError, match=r"the model's own forward adds two tensors .* classic criteria"):
        input_relevance(_UnknownResidual(), torch.rand(2, 3, 8, 8), progress=False)


@pytest.mark.parametrize("family", ("resnet18", "mobilenet_v3_small", "squeezenet1_0"))
def test_static_int8_export_of_the_family_runs(family, tmp_path):
    """int8-static (QDQ with calibration) at the engine level, on the three cheapest families (ONNX
    Runtime's static quantization took 25-45 s per larger family here; every family's static export
    is run by benchmarks/bench_scale.py --families; the CLI path is tested on the digits CNN)."""
    from mlflow_di.compression import compress
    from mlflow_di.models.classifier import OnnxClassifier

    images = np.random.default_rng(1).integers(0, 256, (16, SIZE, SIZE, 3), dtype=np.uint8)
    result = compress(build(family), PREPROCESSING, "int8-static", str(tmp_path), calib_inputs=images[:8])
    probabilities = OnnxClassifier(result.path).predict_proba(images)
    assert probabilities.shape == (16, 10) and np.allclose(probabilities.sum(axis=1), 1, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_reaches_its_sparsity_on_the_family(family):
    from mlflow_di.compression import prune_l1, prune_structured

    module = build(family)
    assert prune_l1(module, 0.3).sparsity == pytest.approx(0.3, abs=0.01)
    pruned = prune_structured(module, 0.25)
    inputs = torch.rand(2, 3, SIZE, SIZE)
    with torch.no_grad():
        assert pruned.module(inputs).shape == (2, 10)


@pytest.fixture()
def registered(tracking_uri, tmp_path, request):
    """The family registered as models:/<family>/1, and an npz of 48 images labelled by the model."""
    family = request.param
    model = TorchModel(build(family), PREPROCESSING, name=family, metadata={"arch": family})
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (48, SIZE, SIZE, 3), dtype=np.uint8)
    labels = model.classifier().predict(images)
    np.savez(tmp_path / "images.npz", x=images, y=labels)
    with tracking.tracked_run("register"):
        edge_models.log_torch_model(model, registered_model_name=family)
    return family, f"npz:{tmp_path / 'images.npz'}"


@pytest.mark.parametrize("registered", FAMILIES, indirect=True)
def test_every_command_runs_on_the_family(registered, tmp_path, capsys):
    family, data = registered
    uri = f"models:/{family}/1"
    assert main(["describe", uri, "--device", "cpu"]) == 0
    assert "runs on:        pytorch (cpu)" in capsys.readouterr().out
    assert main(["compress", "--model-uri", uri, "--method", "int8-dynamic", "--eval-data", f"{data}[32:48]"]) == 0, \
        capsys.readouterr().err
    summary = tmp_path / "coverage.json"
    assert main(["coverage", "--model-uri", uri, "--train-data", f"{data}[0:32]", "--test-data", f"{data}[32:48]",
                 "--top-m", "3", "--clusters", "2", "--criteria", "idc,nc,kmnc,tknc", "--batch-size", "16",
                 "--json-out", str(summary)]) == 0, \
        capsys.readouterr().err
    measured = json.loads(summary.read_text())
    assert 0 < measured["idc"] <= 1 and 0 <= measured["nc"] <= 1
    out = tmp_path / "fuzz.json"  # random-init logits are near ties: a compressed copy disagrees on some seeds
    assert main(["fuzz", "--original", uri, "--compressed", f"models:/{family}-int8-dynamic/1",
                 "--seed-data", f"{data}[32:48]", "--max-queries", "10", "--out-dir", str(tmp_path / "campaign"),
                 "--json-out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["seeds"] == 16
    code = main(["gate", "--model-uri", uri, "--compressed", f"models:/{family}-int8-dynamic/1", "--min-idc", "0.01",
                 "--max-accuracy-drop", "1"])
    assert code in (0, 1), capsys.readouterr().err  # a verdict either way; 2 would be bad input
    verdict = mlflow.MlflowClient().get_model_version(family, "1").tags
    assert verdict["mlflow_di.gate"] in ("pass", "fail")


def test_fitting_the_classic_criteria_leaves_a_batch_norm_model_in_eval_mode_and_unchanged():
    """Regression: the criteria's output tap was created in training mode and restored to it, which
    switched the user's model to training mode; batch norms then drifted on every later pass."""
    from mlflow_di.coverage.suite import CoverageSuite
    from mlflow_di.data import ImageSet

    model = TorchModel(build("resnet18"), PREPROCESSING, "resnet18")
    images = np.random.default_rng(0).integers(0, 256, (8, SIZE, SIZE, 3), dtype=np.uint8)
    inputs = model.to_tensor(images)
    with torch.no_grad():
        before = model.module(inputs)
    CoverageSuite(criteria=("nc", "kmnc"), progress=False).fit(model, ImageSet(images, np.zeros(8), "x")).score(
        ImageSet(images, np.zeros(8), "x"))
    assert not model.module.training
    with torch.no_grad():
        torch.testing.assert_close(model.module(inputs), before)
