"""Layer-wise int8 diagnosis (SQNR per tensor, float vs QDQ) and layers kept in float, on small generated models."""
import math

import numpy as np
import onnx
import pytest
import torch
from onnxruntime.quantization import qdq_loss_debug
from torch import nn

import mlflow_di  # noqa: F401  (torchvision guard before anything imports it)
from mlflow_di.compression import check_keep_float, compress, diagnose
from mlflow_di.compression.export import run_onnx
from mlflow_di.compression.quant_debug import INPUT_LAYER, LayerDiagnosis, TensorError, sqnr_db
from mlflow_di.errors import UserError
from mlflow_di.models.preprocessing import Preprocessing

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PREPROCESSING = Preprocessing(input_shape=(8, 8, 1), layout="NCHW", scale=1 / 255)


class SmallNet(nn.Module):
    """conv -> relu -> fc -> relu -> fc; with ``outlier``, layer ``coarse`` gets one huge weight per output
    channel, so its per-channel int8 scale is coarse and its other weights round to a few levels."""

    def __init__(self, outlier: float = 0.0, coarse: str = "fc1"):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(4 * 8 * 8, 16)
        self.fc2 = nn.Linear(16, 5)
        if outlier:
            with torch.no_grad():
                getattr(self, coarse).weight[:, 0] = outlier  # per-channel scale = outlier / 127

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.flatten(self.act(self.conv(x))))))


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).integers(0, 256, size=(96, 8, 8, 1), dtype=np.uint8)


@pytest.fixture(scope="module")
def exported(images, tmp_path_factory):
    """outlier -> int8-static CompressionResult of SmallNet(outlier), made with the symmetric int8 recipe
    (``s8s8``: the per-channel scale is max |w| / 127, which the outlier makes coarse)."""
    from mlflow_di.compression.recipes import RECIPES

    made = {}

    def get(outlier: float = 0.0, keep_float=(), coarse: str = "fc1"):
        key = (outlier, tuple(keep_float), coarse)
        if key not in made:
            made[key] = compress(SmallNet(outlier, coarse).eval(), PREPROCESSING, "int8-static",
                                 tmp_path_factory.mktemp("q"),
                                 calib_inputs=images[:64], keep_float=keep_float, settings=RECIPES["s8s8"])
        return made[key]

    return get


def test_sqnr_of_known_noise_is_ten_log_signal_over_noise_power():
    rng = np.random.default_rng(1)
    signal = rng.normal(size=10_000)
    noise = rng.normal(scale=0.01, size=10_000)
    expected = 10 * math.log10(np.sum(signal ** 2) / np.sum(noise ** 2))
    assert sqnr_db(np.sum(signal ** 2), np.sum(noise ** 2)) == pytest.approx(expected)
    assert qdq_loss_debug.compute_signal_to_quantization_noice_ratio(signal, signal + noise) == pytest.approx(expected)
    assert sqnr_db(np.sum(signal ** 2), 0.0) > 300  # identical tensors: ORT's eps ceiling


def test_diagnosis_has_a_finite_sqnr_row_for_every_quantized_tensor(exported, images):
    result = exported()
    diagnosis = diagnose(result.float_path, result.path, PREPROCESSING.apply(images), max_images=50, batch_size=16)
    assert diagnosis.images == 50
    by_kind = {}
    for row in diagnosis.tensors:
        assert math.isfinite(row.sqnr_db)
        by_kind.setdefault(row.kind, set()).add(row.tensor)
    assert by_kind["weight"] == {"conv.weight", "fc1.weight", "fc2.weight"}
    assert by_kind["bias"] == {"conv.bias", "fc1.bias", "fc2.bias"}
    # every activation the QDQ graph quantizes (a DequantizeLinear of a non-constant) has a row
    qdq = onnx.load(result.path).graph
    constants = {init.name for init in qdq.initializer}
    quantized = {n.output[0].removesuffix("_DequantizeLinear_Output") for n in qdq.node
                 if n.op_type == "DequantizeLinear" and n.input[0].removesuffix("_QuantizeLinear_Output") != n.input[0]
                 and n.input[0] not in constants}
    assert quantized and quantized <= by_kind["activation"]
    assert [r.sqnr_db for r in diagnosis.tensors] == sorted(r.sqnr_db for r in diagnosis.tensors)
    layers = {r.tensor: r.layer for r in diagnosis.tensors}
    assert layers["input"] == INPUT_LAYER and layers["fc2.weight"] == "fc2"
    assert set(diagnosis.layer_scores()) == {"conv", "fc1", "fc2"}
    assert LayerDiagnosis.from_json(diagnosis.to_json()) == diagnosis


def test_streamed_sqnr_equals_ort_over_all_batches_at_once(exported, images):
    """Adding up norms batch by batch gives ORT's compute_activation_error over the concatenation."""
    import tempfile

    from mlflow_di.compression.quantize import ArrayCalibrationReader

    result = exported()
    inputs = PREPROCESSING.apply(images[:40])
    streamed = {r.tensor: r.sqnr_db for r in diagnose(result.float_path, result.path, inputs, batch_size=8).tensors
                if r.kind == "activation"}
    with tempfile.TemporaryDirectory() as work:
        for path, name in ((result.float_path, "f"), (result.path, "q")):
            qdq_loss_debug.modify_model_output_intermediate_tensors(path, f"{work}/{name}.onnx")
        collected = {name: qdq_loss_debug.collect_activations(f"{work}/{name}.onnx", ArrayCalibrationReader(
            "input", inputs, batch_size=8, progress=False)) for name in "fq"}
    matching = qdq_loss_debug.create_activation_matching(collected["q"], collected["f"])
    errors = qdq_loss_debug.compute_activation_error({k: v for k, v in matching.items() if "float" in v})
    assert set(errors) == set(streamed)
    for name, error in errors.items():
        assert streamed[name] == pytest.approx(error["xmodel_err"], abs=1e-6)


def test_a_relu_folded_into_the_qdq_pair_gets_no_local_sqnr(exported, images):
    result = exported()
    rows = {r.tensor: r for r in diagnose(result.float_path, result.path, PREPROCESSING.apply(images[:32])).tensors}
    relu = next(r for r in rows.values() if r.module == "act")
    assert relu.layer == "conv" and relu.qdq_sqnr_db is None


def test_the_diagnosis_points_at_the_layer_with_coarse_weights(exported, images):
    result = exported(outlier=40.0)
    diagnosis = diagnose(result.float_path, result.path, PREPROCESSING.apply(images))
    weights = {r.tensor: r.sqnr_db for r in diagnosis.tensors if r.kind == "weight"}
    assert min(weights, key=weights.get) == "fc1.weight"
    scores = diagnosis.layer_scores()
    assert scores["conv"] - scores["fc1"] > 10  # the activation SQNR falls where the coarse layer is
    assert scores["fc1"] == min(r.sqnr_db for r in diagnosis.tensors if r.kind == "activation" and r.layer == "fc1")


def test_auto_keep_float_picks_the_worst_layer_and_keeping_it_float_helps(exported, images):
    inputs = PREPROCESSING.apply(images)
    result = exported(outlier=40.0, coarse="fc2")
    diagnosis = diagnose(result.float_path, result.path, inputs)
    assert diagnosis.worst_layers(1) == ["fc2"] == [min(diagnosis.layer_scores(), key=diagnosis.layer_scores().get)]
    kept = exported(outlier=40.0, coarse="fc2", keep_float=diagnosis.worst_layers(1))
    again = diagnose(kept.float_path, kept.path, inputs)
    assert "fc2.weight" not in {r.tensor for r in again.tensors}  # no longer quantized
    reference = run_onnx(result.float_path, inputs)

    def logits_sqnr(path):
        return sqnr_db(np.sum(reference ** 2), np.sum((reference - run_onnx(path, inputs)) ** 2))

    assert logits_sqnr(kept.path) > logits_sqnr(result.path) + 10


def test_keep_float_leaves_the_named_layer_without_qdq_around_its_weight(exported):
    result = exported(keep_float=["fc1"])
    graph = onnx.load(result.path).graph
    gemm = next(n for n in graph.node if "fc1.weight" in n.input)
    assert gemm.input[1] == "fc1.weight"  # the float initializer itself, no DequantizeLinear in between
    assert not any(n.input[0].startswith("fc1.weight") for n in graph.node if n.op_type == "DequantizeLinear")
    assert any(n.input[0] == "conv.weight_quantized" for n in graph.node if n.op_type == "DequantizeLinear")
    assert result.params["kept_float"] == ["fc1"]
    assert set(result.quantized_ops["float_layers"]) == {"fc1.weight"}
    assert result.params["nodes_to_exclude"] == [gemm.name]


def test_the_logged_nodes_to_exclude_reproduce_the_export_with_onnx_runtimes_own_quantizer(exported, images,
                                                                                            tmp_path):
    """What the compress report tells a user to run: quantize_static on the float graph, excluding the
    logged nodes, with the logged recipe's settings, gives the export's outputs."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from mlflow_di.compression.quantize import ArrayCalibrationReader

    result = exported(keep_float=["fc1"])
    again = tmp_path / "again.onnx"
    quantize_static(result.float_path, str(again), ArrayCalibrationReader("input", PREPROCESSING.apply(images[:64]),
                                                                          progress=False),
                    quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax, reduce_range=False,
                    nodes_to_exclude=result.params["nodes_to_exclude"])
    inputs = PREPROCESSING.apply(images)
    np.testing.assert_array_equal(run_onnx(again, inputs), run_onnx(result.path, inputs))


@pytest.mark.parametrize("kwargs, problem", [
    ({"keep_float": ["fc9"]}, "no quantizable layer 'fc9' in the model; layers: conv, fc1, fc2"),
    ({"keep_float": ["conv", "fc1", "fc2"]}, "leaves none quantized"),
    ({"auto_keep_float": 3}, "leaves none quantized"),
    ({"keep_float": ["fc1"], "auto_keep_float": 1}, "not both"),
])
def test_bad_keep_float_requests_are_one_line_errors(kwargs, problem):
    with pytest.raises(UserError, match=problem):
        check_keep_float(SmallNet(), "int8-static", **kwargs)
    with pytest.raises(UserError, match="int8-static only"):
        check_keep_float(SmallNet(), "int8-dynamic", keep_float=["fc1"])


def test_diagnosis_rows_and_scores_from_hand_made_tensors():
    diagnosis = LayerDiagnosis("eval", 3, [TensorError("a", "activation", "m", "l1", 20.0, None),
                                           TensorError("b", "activation", "m", "l2", 30.0, 40.0),
                                           TensorError("c", "activation", "m", "l1", 35.0, 50.0),
                                           TensorError("l1.weight", "weight", "l1", "l1", 10.0)])
    assert diagnosis.layer_scores() == {"l1": 20.0, "l2": 30.0}  # weights do not count, the lowest activation does
    assert diagnosis.worst_layers(1) == ["l1"]
    assert diagnosis.rows()[0]["qdq_sqnr_db"] == ""
