"""Compression engine: fp32 ONNX export, int8 quantization, pruning, and their failure modes.

Most tests use the zoo's digits CNN trained for 40 mini-batch steps on scikit-learn's digits
(about 90% accuracy), so int8 outputs are compared on a model with meaningful logits. Each
method's ONNX file is made once per module and shared.
"""
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import mlflow_di  # noqa: F401  (torchvision guard before anything imports it)
from mlflow_di.models.metadata import ONNX_PREPROCESSING_KEY
from mlflow_di.compression import (
    METHODS,
    CompressionResult,
    assert_linear_layers_quantized,
    compress,
    export_onnx,
    layer_sparsity,
    prune_l1,
    prune_structured,
    quantize_int8_static,
    quantized_ops,
    read_preprocessing,
    torch_model_size_bytes,
)
from mlflow_di.compression.prune import prunable_layers, zero_channels
from mlflow_di.data import load_images
from mlflow_di.errors import UserError
from mlflow_di.models import zoo
from mlflow_di.models.preprocessing import Preprocessing

DIGITS_LAYERS = ("conv1.0.weight", "conv2.0.weight", "fc1.0.weight", "before_softmax.weight")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    return load_images("digits")


@pytest.fixture(scope="module")
def trained_cnn(digits):
    """The zoo digits CNN after 40 seeded Adam steps of 128 images (deterministic, ~0.3 s)."""
    module = zoo.build("digits-cnn", seed=0).train()
    preprocessing = zoo.DIGITS_PREPROCESSING
    x = torch.from_numpy(preprocessing.apply(digits.images))
    y = torch.from_numpy(digits.labels)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.02)
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        batch = torch.randint(0, len(x), (128,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x[batch]), y[batch]).backward()
        optimizer.step()
    return module.eval(), preprocessing


@pytest.fixture(scope="module")
def compressed(trained_cnn, digits, tmp_path_factory):
    """method -> CompressionResult, each made on first use (calibration: the first 300 digits)."""
    module, preprocessing = trained_cnn
    out_dir = tmp_path_factory.mktemp("compressed")
    results = {}

    def get(method: str) -> CompressionResult:
        if method not in results:
            results[method] = compress(module, preprocessing, method, out_dir, calib_inputs=digits.images[:300])
        return results[method]

    return get


def torch_logits(module, inputs: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(inputs)).numpy()


def onnx_logits(path, inputs: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: inputs})[0]


# --- fp32 export ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 7])
def test_fp32_export_matches_torch_at_any_batch_size(compressed, trained_cnn, digits, batch):
    module, preprocessing = trained_cnn
    inputs = preprocessing.apply(digits.images[100:100 + batch])
    np.testing.assert_allclose(onnx_logits(compressed("fp32").path, inputs), torch_logits(module, inputs), atol=1e-4)


def test_fp32_export_declares_a_symbolic_batch_axis_and_nchw_input(compressed):
    model = onnx.load(compressed("fp32").path)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch"
    assert [d.dim_value for d in dims[1:]] == [1, 8, 8]  # NCHW of an 8x8x1 image
    assert model.graph.output[0].name == "logits"


def test_export_records_exporter_and_check_and_restores_training_mode(tmp_path):
    module = zoo.build("digits-cnn").train()
    export = export_onnx(module, zoo.DIGITS_PREPROCESSING, tmp_path / "m.onnx")
    assert export.exporter == "dynamo" and export.fallback_reason is None
    assert export.max_abs_diff < 1e-4
    assert export.opset >= 13  # per-channel QDQ quantization needs opset 13+
    assert module.training  # exported in eval mode, then left in the mode it came in


def test_export_needs_the_input_shape(trained_cnn, tmp_path):
    module, _ = trained_cnn
    with pytest.raises(UserError, match="input_shape"):
        export_onnx(module, Preprocessing(), tmp_path / "m.onnx")


@pytest.mark.parametrize("method", METHODS)
def test_every_method_runs_in_onnxruntime_with_a_dynamic_batch(compressed, trained_cnn, digits, method):
    _, preprocessing = trained_cnn
    path = compressed(method).path
    for batch in (1, 7):
        outputs = onnx_logits(path, preprocessing.apply(digits.images[:batch]))
        assert outputs.shape == (batch, 10)
        assert np.isfinite(outputs).all()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_carries_the_preprocessing_and_how_it_was_made(compressed, trained_cnn, method):
    _, preprocessing = trained_cnn
    result = compressed(method)
    props = {p.key: p.value for p in onnx.load(result.path).metadata_props}
    assert Preprocessing.from_json(props[ONNX_PREPROCESSING_KEY]) == preprocessing
    assert read_preprocessing(result.path) == preprocessing
    assert f'"method": "{method}"' in props["mlflow_di.compression"]
    assert result.size_bytes == len(open(result.path, "rb").read())


# --- quantization --------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["int8-static", "int8-dynamic"])
def test_int8_logits_stay_close_to_fp32(compressed, trained_cnn, digits, method):
    module, preprocessing = trained_cnn
    inputs = preprocessing.apply(digits.images[300:800])  # not the calibration images
    expected = torch_logits(module, inputs)
    actual = onnx_logits(compressed(method).path, inputs)
    logit_range = expected.max() - expected.min()
    assert np.abs(actual - expected).max() < 0.1 * logit_range
    assert (actual.argmax(1) == expected.argmax(1)).mean() >= 0.97


@pytest.mark.parametrize("method, how", [("int8-static", "via QDQ (uint8 per-channel"), ("int8-dynamic", "Integer (int8")])
def test_int8_methods_quantize_every_conv_and_dense_layer(compressed, method, how):
    report = compressed(method).quantized_ops
    assert sorted(report["quantized_layers"]) == sorted(DIGITS_LAYERS)
    assert all(how in text for text in report["quantized_layers"].values())
    assert report["float_layers"] == {}
    assert report == assert_linear_layers_quantized(compressed(method).path)


def test_quantized_ops_counts_qdq_pairs_and_integer_ops(compressed):
    static = quantized_ops(compressed("int8-static").path)["op_counts"]
    dynamic = quantized_ops(compressed("int8-dynamic").path)["op_counts"]
    assert static["QuantizeLinear"] > 0 and static["DequantizeLinear"] >= static["QuantizeLinear"]
    assert dynamic == {"ConvInteger": 2, "DynamicQuantizeLinear": 4, "MatMulInteger": 2}


def test_fp32_layers_fail_the_quantization_check_by_name(compressed):
    report = quantized_ops(compressed("fp32").path)
    assert report["quantized_layers"] == {} and sorted(report["float_layers"]) == sorted(DIGITS_LAYERS)
    with pytest.raises(UserError, match=r"4 layer\(s\).*conv1\.0\.weight \(Conv\).*fc1\.0\.weight \(Gemm\)"):
        assert_linear_layers_quantized(compressed("fp32").path)


@pytest.mark.parametrize("calib", [None, np.zeros((0, 8, 8, 1), np.uint8)])
def test_static_quantization_without_calibration_data_asks_for_it(trained_cnn, tmp_path, calib):
    module, preprocessing = trained_cnn
    with pytest.raises(UserError, match="--calib-data"):
        compress(module, preprocessing, "int8-static", tmp_path, calib_inputs=calib)
    assert not (tmp_path / "int8-static.onnx").exists()


def test_static_quantization_rejects_calibration_of_the_wrong_shape(compressed, tmp_path):
    wrong = np.zeros((4, 1, 28, 28), np.float32)
    with pytest.raises(UserError, match=r"shape \(4, 1, 28, 28\)"):
        quantize_int8_static(compressed("fp32").path, tmp_path / "q.onnx", wrong)
    with pytest.raises(UserError, match="--calib-data"):
        quantize_int8_static(compressed("fp32").path, tmp_path / "q.onnx", None)


# --- pruning -------------------------------------------------------------------------------

def test_prune_l1_reaches_the_asked_sparsity_globally_on_a_copy(trained_cnn):
    module, _ = trained_cnn
    before = {k: v.clone() for k, v in module.state_dict().items()}
    pruned, sparsity = prune_l1(module, 0.3)
    total = sum(layer.weight.numel() for _, layer in prunable_layers(module))
    assert abs(sparsity - 0.3) <= 1 / total
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # source untouched
    assert set(pruned.state_dict()) == set(before)  # permanent: no weight_orig / weight_mask left
    assert not any(m._forward_pre_hooks for m in pruned.modules())


def test_prune_l1_per_layer_prunes_every_layer_equally(trained_cnn):
    module, _ = trained_cnn
    pruned, _ = prune_l1(module, 0.5, scope="layer")
    for name, value in layer_sparsity(pruned).items():
        count = dict(prunable_layers(pruned))[name].weight.numel()
        assert value == pytest.approx(round(0.5 * count) / count), name


def test_prune_structured_zeroes_whole_output_channels_except_the_logit_layer(trained_cnn):
    module, _ = trained_cnn
    pruned, sparsity = prune_structured(module, 0.3)
    layers = prunable_layers(pruned)
    for name, layer in layers[:-1]:
        channels = layer.weight.shape[0]
        assert zero_channels(layer) == round(0.3 * channels), name
        empty = layer.weight.flatten(1).abs().sum(1) == 0
        assert (layer.bias[empty] == 0).all()  # a removed channel outputs exactly zero
        assert (layer.weight.flatten(1)[~empty] != 0).any(1).all()  # the others keep their weights
    assert zero_channels(layers[-1][1]) == 0
    zeros = sum(round(0.3 * layer.weight.shape[0]) * layer.weight[0].numel() for _, layer in layers[:-1])
    assert sparsity == pytest.approx(zeros / sum(layer.weight.numel() for _, layer in layers[:-1]))


@pytest.mark.parametrize("method, pruned_layers", [("prune-l1", DIGITS_LAYERS), ("prune-structured", DIGITS_LAYERS[:-1])])
def test_pruned_exports_keep_the_zeros_and_report_sparsity(compressed, method, pruned_layers):
    result = compressed(method)
    initializers = {init.name: init for init in onnx.load(result.path).graph.initializer}
    weights = [onnx.numpy_helper.to_array(initializers[name]) for name in pruned_layers]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.size for w in weights)
    assert zeros == pytest.approx(result.sparsity)
    assert result.sparsity == pytest.approx(0.3, abs=0.02)  # per-layer rounding of channel counts


def test_pruning_needs_a_torch_module_and_a_fraction(trained_cnn):
    module, _ = trained_cnn
    with pytest.raises(UserError, match="nn.Module"):
        prune_l1("model.onnx", 0.3)
    with pytest.raises(UserError, match="nn.Module"):
        prune_structured(object(), 0.3)
    with pytest.raises(UserError, match=r"\[0, 1\)"):
        prune_l1(module, 1.5)


# --- results, sizes, errors ----------------------------------------------------------------

def test_unknown_method_lists_the_known_ones(trained_cnn, tmp_path):
    module, preprocessing = trained_cnn
    with pytest.raises(UserError, match="fp32, int8-static, int8-dynamic, prune-l1, prune-structured"):
        compress(module, preprocessing, "int4", tmp_path)


def test_torch_model_size_is_the_float32_weights_plus_container_overhead(trained_cnn):
    module, _ = trained_cnn
    weight_bytes = 4 * sum(p.numel() for p in module.state_dict().values())
    size = torch_model_size_bytes(module)
    assert weight_bytes < size < weight_bytes + 16_000


def test_compression_result_round_trips_through_json(compressed):
    result = compressed("int8-dynamic")
    assert CompressionResult.from_json(result.to_json()) == result
    assert result.source_size_bytes == torch_model_size_bytes(zoo.build("digits-cnn"))


class EigenvalueFeatures(nn.Module):
    """Uses torch.linalg.eigvals, which has no ONNX translation in either exporter."""

    def forward(self, x):
        return torch.linalg.eigvals(x).real


def test_export_failure_names_the_op_and_the_module(tmp_path):
    model = nn.Sequential(nn.Conv2d(1, 2, 1), EigenvalueFeatures(), nn.Flatten(), nn.Linear(12, 3))
    with pytest.warns(UserWarning, match="falling back to the TorchScript exporter"):
        with pytest.raises(UserError, match=r"op 'linalg_eig'.*module '1' \(EigenvalueFeatures\)"):
            export_onnx(model, Preprocessing(input_shape=(6, 6, 1)), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


class PythonErf(torch.autograd.Function):
    """erf computed in Python: torch.export cannot capture it and the tracer freezes it."""

    @staticmethod
    def forward(ctx, x):
        return torch.tensor([math.erf(v) for v in x.flatten().tolist()]).view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class PythonActivation(nn.Module):
    def forward(self, x):
        return PythonErf.apply(x)


@pytest.mark.slow  # torch.export tries several capture strategies before giving up (~10 s)
def test_export_of_a_custom_autograd_function_names_it(tmp_path):
    model = nn.Sequential(nn.Conv2d(1, 2, 1), PythonActivation(), nn.Flatten(), nn.Linear(72, 3))
    with pytest.warns(UserWarning, match="falling back"):
        with pytest.raises(UserError, match=r"custom autograd Function PythonErf in module '1' \(PythonActivation\)"):
            export_onnx(model, Preprocessing(input_shape=(6, 6, 1)), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8-static", "int8-dynamic", "prune-l1"])
def test_lenet5_stays_within_one_accuracy_point(shared_dir, mnist_spec, tmp_path, method):
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.models.keras_import import import_keras

    model = import_keras("lenet5", shared_dir / "models" / "deepimportance" / "LeNet5.h5")
    data = load_images(mnist_spec)
    result = compress(model.module, model.preprocessing, method, tmp_path, calib_inputs=data.images[:500])
    reference = (model.classifier().predict(data.images) == data.labels).mean()
    compressed_accuracy = (OnnxClassifier(result.path).predict(data.images) == data.labels).mean()
    assert reference == pytest.approx(0.9879, abs=1e-4)
    assert compressed_accuracy >= reference - 0.01
