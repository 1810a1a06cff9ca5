"""One network, one coverage: IDC and every classic criterion give the same figures, on the same
layer names, whether the network is run as the eager (pickled) module, as MLflow's default pt2
(torch.export) program rebuilt white-box, or as its ONNX graph; and whether its activations are
``nn.ReLU`` modules or ``torch.relu`` calls (a layer is measured after its activation, see
:mod:`mlflow_di.coverage.activations`). MLflow-logged models through the CLI: test_mlflow_native.py."""
import contextlib
import io

import numpy as np
import pytest
import torch
from torch import nn

import mlflow_di._compat  # noqa: F401  (torchvision on the CPU build of torch)

from benchmarks.check_lrp_conservation import family_model
from mlflow_di.coverage.suite import CoverageSuite
from mlflow_di.data import ImageSet
from mlflow_di.models.onnx_torch import onnx_to_torch
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.pt2 import rebuild
from mlflow_di.models.torch_model import TorchModel

CRITERIA = ("idc", "nc", "kmnc", "nbc", "snac", "tknc", "lsc", "dsc")


class SmallCNN(nn.Module):
    """conv-conv-fc-fc with its ReLUs as modules or as ``torch.relu`` calls: the same computation."""

    def __init__(self, functional: bool):
        super().__init__()
        torch.manual_seed(0)
        self.functional = functional
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3), nn.Conv2d(8, 16, 3)
        self.fc1, self.fc2 = nn.Linear(16 * 4 * 4, 32), nn.Linear(32, 10)
        self.relu1, self.relu2, self.relu3 = nn.ReLU(), nn.ReLU(), nn.ReLU()
        with torch.no_grad():  # weights large enough that units are both on and off
            for parameter in self.parameters():
                parameter.mul_(3)

    def forward(self, x):
        act = (lambda _module, value: torch.relu(value)) if self.functional else (lambda module, value: module(value))
        x = act(self.relu1, self.conv1(x))
        x = act(self.relu2, self.conv2(x))
        x = act(self.relu3, self.fc1(x.flatten(1)))
        return self.fc2(x)


def three_views(module: nn.Module, example: torch.Tensor, tmp_path) -> dict[str, nn.Module]:
    """The eager module (what a pickle holds), its pt2 program rebuilt, its ONNX graph converted."""
    module.eval()
    program = torch.export.export(module, (example,), dynamic_shapes=[{0: torch.export.Dim.AUTO}])
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(module, (example,), str(tmp_path / "m.onnx"), dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "n"}})
    return {"pickle": module, "pt2": rebuild(program), "onnx": onnx_to_torch(tmp_path / "m.onnx")}


def coverage_per_view(module, shape, tmp_path, n_train: int, n_test: int) -> dict[str, tuple]:
    preprocessing = Preprocessing(input_shape=shape)
    rng = np.random.default_rng(0)
    train, test = (rng.integers(0, 256, (n, *shape), dtype=np.uint8) for n in (n_train, n_test))
    with torch.no_grad():  # labels the model gets right, so IDC analyses every input
        def label(images):
            return module.eval()(torch.from_numpy(preprocessing.apply(images))).argmax(1).numpy()

        train, test = ImageSet(train, label(train), "train"), ImageSet(test, label(test), "test")
    results = {}
    for view, network in three_views(module, torch.from_numpy(preprocessing.apply(train.images[:4])), tmp_path).items():
        suite = CoverageSuite(progress=False).fit(TorchModel(network, preprocessing, view), train)
        metrics = suite.score(test).metrics()
        results[view] = (suite.classic_.layers_, suite.idc_.layers_, metrics)
    return results


@pytest.mark.parametrize("functional", [False, True], ids=["nn.ReLU", "torch.relu"])
def test_a_small_cnn_has_one_coverage_in_every_format_and_either_way_of_writing_it(functional, tmp_path):
    results = coverage_per_view(SmallCNN(functional), (8, 8, 1), tmp_path, 300, 100)
    assert results["pickle"] == results["pt2"] == results["onnx"]
    assert results["pickle"][0] == ["conv1", "conv2", "fc1"]
    assert set(CRITERIA) <= set(results["pickle"][2])
    other = coverage_per_view(SmallCNN(not functional), (8, 8, 1), tmp_path, 300, 100)
    assert other["pickle"] == results["pickle"]


@pytest.mark.parametrize("family, layers", [
    ("resnet18", ["conv1", "layer1", "layer2", "layer3", "layer4"]),
    ("mobilenet_v3_small", ["features"]),
])
def test_torchvision_networks_have_one_coverage_in_every_format(family, layers, tmp_path):
    """The ONNX exporter folds each batch norm into its convolution, which changes float32 rounding in
    the last bit: KMNC's 1,000 sections per neuron may then see a value land one section over. Every
    other figure is equal, and KMNC within 1e-5 of its (neurons x 1000) cells: how many values cross a
    section boundary depends on the CPU's convolution kernels (2 on the CI host, 6 of ResNet-18's 1,024,000
    on an AMD EPYC with AVX2), not on anything the project controls."""
    results = coverage_per_view(family_model(family), (32, 32, 3), tmp_path, 160, 60)
    for view in ("pt2", "onnx"):
        assert results[view][:2] == results["pickle"][:2] == (layers, [layers[-1]])
        got, expected = results[view][2], results["pickle"][2]
        assert {k: v for k, v in got.items() if k != "kmnc"} == {k: v for k, v in expected.items() if k != "kmnc"}
        neurons = sum({"conv1": 64, "layer1": 64, "layer2": 128, "layer3": 256, "layer4": 512, "features": 576}[name]
                      for name in layers)
        assert round(abs(got["kmnc"] - expected["kmnc"]) * neurons * 1000) <= 1e-5 * neurons * 1000


def test_a_keras_reference_model_has_one_coverage_as_imported_pt2_and_onnx(shared_dir, tmp_path):
    """The paper's LeNet-5 (Keras HDF5 weights in the zoo's architecture) keeps its coverage when the
    imported module is exported as pt2 or ONNX, as a team registering it would."""
    from mlflow_di.models.keras_import import import_keras

    model = import_keras("lenet5", shared_dir / "models" / "deepimportance" / "LeNet5.h5")
    results = coverage_per_view(model.module, (28, 28, 1), tmp_path, 300, 100)
    assert results["pickle"] == results["pt2"] == results["onnx"]
    assert results["pickle"][:2] == (["conv1", "conv2", "fc1", "fc2"], ["fc2"])
