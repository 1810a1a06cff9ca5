"""ONNX originals white-box: the graph as torch.nn layers in nested modules named as in PyTorch,
the same outputs as ONNX Runtime, and LRP relevance equal to the eager model the graph came from."""
import contextlib
import io

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import mlflow_di._compat  # noqa: F401  (torchvision on the CPU build of torch)

from benchmarks.check_lrp_conservation import family_model
from mlflow_di.coverage.activations import collect_activations
from mlflow_di.coverage.relevance import input_relevance
from mlflow_di.errors import UserError
from mlflow_di.models import zoo
from mlflow_di.models.onnx_torch import onnx_to_torch

EXPORTERS = ("torchscript", "dynamo")


def exported(module, example, path, exporter: str):
    """``module`` as ONNX, the way users export it (torch.onnx.export, a dynamic batch axis)."""
    with contextlib.redirect_stdout(io.StringIO()):
        if exporter == "dynamo":
            torch.onnx.export(module.eval(), (example,), str(path), dynamo=True,
                              dynamic_shapes=({0: torch.export.Dim("n")},))
        else:
            torch.onnx.export(module.eval(), (example,), str(path), dynamo=False, input_names=["x"],
                              dynamic_axes={"x": {0: "n"}})
    return path


def relative(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("arch, shape", [("digits-cnn", (1, 8, 8)), ("lenet5", (1, 28, 28))])
def test_a_plain_cnn_is_its_eager_model_white_box(arch, shape, exporter, tmp_path):
    model = zoo.build(arch, seed=0)
    inputs = torch.rand(4, *shape)
    converted = onnx_to_torch(exported(model, inputs, tmp_path / "m.onnx", exporter))
    assert {"conv1.0", "conv2.0", "fc1.0"} <= {name for name, _ in converted.named_modules()}
    assert type(converted.get_submodule("conv1.0")).__name__ == "Conv2d"
    with torch.no_grad():
        np.testing.assert_allclose(converted(inputs).numpy(), model(inputs).numpy(), atol=1e-5)
    assert relative(input_relevance(converted, inputs, progress=False),
                    input_relevance(model, inputs, progress=False)) <= 1e-5


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_residual_blocks_are_modules_that_run_and_relevance_matches(exporter, tmp_path):
    """ResNet-18's blocks are containers named as in torchvision whose hooks fire; the exporters fold
    batch norms into the convolutions, so relevance matches the eager model to float32 rounding."""
    model = family_model("resnet18")
    inputs = torch.rand(4, 3, 32, 32)
    converted = onnx_to_torch(exported(model, inputs, tmp_path / "r.onnx", exporter))
    children = [name for name, _ in converted.named_children()]
    assert children[:7] == ["conv1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
    eager_blocks = collect_activations(model, inputs, ["layer2.1", "layer4"])
    view_blocks = collect_activations(converted, inputs, ["layer2.1", "layer4"])
    for layer in ("layer2.1", "layer4"):
        np.testing.assert_allclose(view_blocks[layer], eager_blocks[layer], rtol=1e-4, atol=1e-4)
    assert relative(input_relevance(converted, inputs, progress=False),
                    input_relevance(model, inputs, progress=False)) <= 1e-4


def test_squeeze_excitation_gates_and_inverted_residuals_convert(tmp_path):
    model = family_model("mobilenet_v3_small")
    inputs = torch.rand(4, 3, 32, 32)
    converted = onnx_to_torch(exported(model, inputs, tmp_path / "m.onnx", "torchscript"))
    assert type(converted.get_submodule("features.1.block.1.scale_activation")).__name__ == "Hardsigmoid"
    assert relative(input_relevance(converted, inputs, progress=False),
                    input_relevance(model, inputs, progress=False)) <= 1e-4


def _graph_with(op: str, path):
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], name="the_node")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, 4, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_an_operator_without_a_conversion_is_one_line_naming_it(tmp_path):
    with pytest.raises(UserError, match=r"ONNX operator Erf \(node 'the_node'\) has no white-box conversion") as caught:
        onnx_to_torch(_graph_with("Erf", tmp_path / "erf.onnx"), "erf.onnx")
    assert "\n" not in str(caught.value) and "fuzz, robustness, gate" in str(caught.value)


def test_a_hand_built_graph_without_torch_names_gets_node_names(tmp_path):
    weight = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["x"], ["flat"], axis=1, name="flatten"),
         helper.make_node("MatMul", ["flat", "W"], ["mm"], name="dense"),
         helper.make_node("Add", ["mm", "b"], ["y"], name="bias")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        initializer=[numpy_helper.from_array(weight.T.copy(), "W"), numpy_helper.from_array(np.ones(3, np.float32), "b")])
    path = tmp_path / "hand.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    converted = onnx_to_torch(path)
    linear = [module for module in converted.modules() if isinstance(module, torch.nn.Linear)]
    assert len(linear) == 1 and linear[0].bias is not None  # MatMul + Add of a constant: one dense layer
    inputs = torch.rand(2, 1, 4, 4)
    with torch.no_grad():
        np.testing.assert_allclose(converted(inputs).numpy(), inputs.reshape(2, -1).numpy() @ weight.T + 1, atol=1e-5)


def test_an_onnx_original_is_quantized_from_its_own_graph(tmp_path):
    """compress(graph=...) starts int8 from the original graph (its node names survive), not from an
    export of the view; its outputs stay those of ONNX Runtime on the original to int8 precision."""
    from mlflow_di.compression import compress
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.models.preprocessing import Preprocessing

    model = zoo.build("digits-cnn", seed=0)
    original = exported(model, torch.rand(2, 1, 8, 8), tmp_path / "cnn.onnx", "torchscript")
    preprocessing = Preprocessing(input_shape=(8, 8, 1))
    result = compress(onnx_to_torch(original), preprocessing, "int8-dynamic", tmp_path / "out", graph=original)
    assert result.exporter == "original graph"
    names = {node.name for node in onnx.load(result.path).graph.node}
    assert any(name.startswith("/conv1/conv1.0/Conv") for name in names)
    images = np.random.default_rng(0).integers(0, 256, (16, 8, 8, 1), dtype=np.uint8)
    before = OnnxClassifier(original, preprocessing).predict_proba(images)
    after = OnnxClassifier(result.path).predict_proba(images)
    np.testing.assert_allclose(after, before, atol=0.05)
