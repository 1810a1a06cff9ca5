"""Layer-wise quantization diagnosis: where a QDQ int8 model departs from its float model.

Compares the float ONNX model that quantization started from (the pre-processed fp32 graph, kept
next to the export as ``<method>.float.onnx``) with the QDQ model, tensor by tensor, using ONNX
Runtime's ``onnxruntime.quantization.qdq_loss_debug``:

- activations: both models are augmented to output every intermediate tensor
  (``modify_model_output_intermediate_tensors``), run on the same preprocessed inputs
  (``collect_activations``), and paired by name (``create_activation_matching``). Per tensor,
  ``sqnr_db`` compares the float model's value with the QDQ model's dequantized value
  (ORT's ``xmodel_err``: the error accumulated up to that point), ``qdq_sqnr_db`` the QDQ model's
  value just before and just after its own QuantizeLinear/DequantizeLinear pair (``qdq_err``:
  the rounding and clipping added there alone). Where the quantizer folded a ReLU into that
  pair (``Conv -> Relu`` becomes a Conv whose output QDQ clips at zero), the value "before" is
  the Conv's, not the ReLU's, so the pair's error would count the ReLU itself: ``qdq_sqnr_db`` is
  then left out (None), as it is whenever the tensor's producer differs between the graphs;
- weights (and int32-quantized biases): the float initializer against its dequantized int8
  version (``create_weight_matching``, ``compute_weight_error``).

SQNR is ``20 log10(||x|| / ||x - y||)`` in dB (ORT's ``compute_signal_to_quantization_noice_ratio``),
i.e. ``10 log10(P_signal / P_noise)``; higher is better, about 6 dB per bit, and identical
tensors get ORT's ceiling of ``20 log10(||x|| / eps)``. ORT computes it over the concatenation
of all batches; to keep memory bounded we run ``collect_activations`` one batch at a time and add
up ``||x||^2`` and ``||x - y||^2`` per tensor, which gives the same number. At most
:data:`DIAGNOSIS_IMAGES` images are used (the first ones): the augmented models output every
intermediate tensor of a batch at once.

Names: weights are named after their initializer (``conv1.0.weight``), which the PyTorch
exporters take from the module's parameters. An activation tensor gets the ``module`` that
produced it (from the dynamo exporter's ``namespace`` node metadata, or the TorchScript
exporter's ``/conv1/conv1.0/Conv`` node names) and the ``layer``: the nearest Conv/Gemm/MatMul
with a constant weight upstream of it in the float graph (``conv1.0`` for the ReLU and
max-pool that follow it; ``(input)`` before the first layer). A layer is what
``--keep-float`` can leave in float.

**Layer score** (what ``--auto-keep-float`` ranks by): the lowest activation ``sqnr_db`` among
the tensors attributed to the layer; the K layers with the lowest scores are the K worst. As
``sqnr_db`` accumulates the error of every layer before, the score says where the QDQ model is
furthest from the float model, which tends to grow with depth; ``qdq_sqnr_db`` shows each
tensor's own share.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import tempfile

import numpy as np
import onnx
from onnxruntime.quantization import qdq_loss_debug as qdq_debug

from mlflow_di.compression.onnx_ops import weighted_layer_nodes
from mlflow_di.compression.quantize import ArrayCalibrationReader, model_input
from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip

DIAGNOSIS_IMAGES = 256
DIAGNOSIS_BATCH = 32
INPUT_LAYER = "(input)"


@dataclasses.dataclass
class TensorError(JsonRoundTrip):
    """Quantization error of one tensor (``kind``: activation, weight or bias); SQNR in dB."""

    tensor: str
    kind: str
    module: str
    layer: str
    sqnr_db: float
    qdq_sqnr_db: float | None = None


@dataclasses.dataclass
class LayerDiagnosis(JsonRoundTrip):
    """Per-tensor SQNR of a QDQ model against its float model on ``images`` inputs, worst first."""

    data: str
    images: int
    tensors: list[TensorError]

    JSON_DUMPS = {"indent": 2}

    def layer_scores(self) -> dict[str, float]:
        """Layer -> its score (the lowest activation SQNR of its tensors; see the module docstring), worst first."""
        scores: dict[str, float] = {}
        for row in self.tensors:
            if row.kind == "activation" and row.layer != INPUT_LAYER:
                scores[row.layer] = min(scores.get(row.layer, math.inf), row.sqnr_db)
        return dict(sorted(scores.items(), key=lambda item: (item[1], item[0])))

    def worst_layers(self, count: int) -> list[str]:
        """The ``count`` layers with the lowest scores."""
        return list(self.layer_scores())[:count]

    def rows(self) -> list[dict]:
        """Table rows (worst first), SQNR rounded to 0.01 dB."""
        return [{"tensor": t.tensor, "kind": t.kind, "module": t.module, "layer": t.layer,
                 "sqnr_db": round(t.sqnr_db, 2),
                 "qdq_sqnr_db": "" if t.qdq_sqnr_db is None else round(t.qdq_sqnr_db, 2)} for t in self.tensors]


def sqnr_db(signal_norm_sq: float, noise_norm_sq: float) -> float:
    """``10 log10(||x||^2 / ||x - y||^2)`` with ORT's floor of ``eps`` on both norms."""
    eps = np.finfo(float).eps
    return 20 * math.log10(max(math.sqrt(signal_norm_sq), eps) / max(math.sqrt(noise_norm_sq), eps))


def node_module(node) -> str:
    """The dotted PyTorch module path an exported ONNX node came from ('' when unknown or the root)."""
    namespace = next((p.value for p in node.metadata_props if p.key == "namespace"), None)
    if namespace:  # dynamo: ": Root/conv1: Sequential/conv1.0: Conv2d/conv2d: aten.conv2d.default"
        scopes = [segment.split(":", 1)[0].strip() for segment in namespace.split("/")]
        return scopes[-2] if len(scopes) > 1 else ""
    parts = node.name.split("/")  # TorchScript: "/conv1/conv1.0/Conv"
    return parts[-2] if len(parts) > 2 else ""


class FloatGraph:
    """Producers, modules and layers of the float graph's tensors."""

    def __init__(self, model: onnx.ModelProto):
        self.producer = {out: node for node in model.graph.node for out in node.output}
        self.constants = {init.name for init in model.graph.initializer}
        self.layer_of_node = {node: layer for layer, node in weighted_layer_nodes(model).items()}
        self._layers: dict[str, str] = {}

    def op_type(self, tensor: str) -> str | None:
        node = self.producer.get(tensor)
        return node.op_type if node is not None else None

    def module(self, tensor: str) -> str:
        node = self.producer.get(tensor)
        return node_module(node) if node is not None else ""

    def layer(self, tensor: str) -> str:
        """The nearest weighted layer upstream of ``tensor`` (first non-constant input at each step)."""
        seen = []
        while tensor not in self._layers:
            node = self.producer.get(tensor)
            if node is None:
                self._layers[tensor] = INPUT_LAYER
                break
            if node.name in self.layer_of_node:
                self._layers[tensor] = self.layer_of_node[node.name]
                break
            seen.append(tensor)
            tensor = next((i for i in node.input if i and i not in self.constants and i in self.producer), "")
        for name in seen:
            self._layers[name] = self._layers[tensor]
        return self._layers[tensor]


def _batch_activations(augmented: pathlib.Path, input_name: str, batch) -> dict[str, list[np.ndarray]]:
    return qdq_debug.collect_activations(str(augmented), ArrayCalibrationReader(
        input_name, batch, batch_size=len(batch), progress=False))


def matched_activations(float_path, qdq_path, inputs, count: int, batch_size: int = DIAGNOSIS_BATCH):
    """For each batch of the first ``count`` preprocessed ``inputs``: ``(batch size, matching)``, where
    ``matching`` is ORT's ``create_activation_matching`` of every intermediate tensor of both models
    (tensor -> ``{"float": [...], "pre_qdq": [...], "post_qdq": [...]}``, one array per batch)."""
    input_name, _ = model_input(float_path)
    with tempfile.TemporaryDirectory(prefix="mlflow-di-qdq-debug-") as work:
        augmented_float = pathlib.Path(work) / "float.onnx"
        augmented_qdq = pathlib.Path(work) / "qdq.onnx"
        qdq_debug.modify_model_output_intermediate_tensors(str(float_path), str(augmented_float))
        qdq_debug.modify_model_output_intermediate_tensors(str(qdq_path), str(augmented_qdq))
        for start in range(0, count, batch_size):
            batch = np.ascontiguousarray(inputs[start:min(start + batch_size, count)], dtype=np.float32)
            yield len(batch), qdq_debug.create_activation_matching(
                _batch_activations(augmented_qdq, input_name, batch), _batch_activations(augmented_float, input_name, batch))


def diagnose(float_path, qdq_path, inputs, data: str = "eval", max_images: int = DIAGNOSIS_IMAGES,
             batch_size: int = DIAGNOSIS_BATCH) -> LayerDiagnosis:
    """Per-tensor SQNR of ``qdq_path`` against ``float_path`` on the first ``max_images`` of ``inputs``.

    ``inputs``: preprocessed float model inputs (an array or a lazy
    :class:`~mlflow_di.models.preprocessing.ModelInputs`), read ``batch_size`` at a time.
    """
    count = min(len(inputs), max_images)
    if count == 0:
        raise UserError(f"no {data} images to diagnose the quantization on")
    graph = FloatGraph(onnx.load(str(float_path)))
    qdq_producer = {out: node.op_type for node in onnx.load(str(qdq_path)).graph.node for out in node.output}
    sums: dict[str, np.ndarray] = {}  # tensor -> [||float||^2, ||float - qdq||^2, ||pre||^2, ||pre - post||^2]
    for _, matching in matched_activations(float_path, qdq_path, inputs, count, batch_size):
        for name, match in matching.items():
            if "float" not in match:
                continue  # a tensor only the QDQ graph has
            totals = sums.setdefault(name, np.zeros(4))
            totals += _norms(match["float"], match["pre_qdq"], match["post_qdq"])
    rows = [TensorError(name, "activation", graph.module(name), graph.layer(name), sqnr_db(s[0], s[1]),
                        sqnr_db(s[2], s[3]) if graph.op_type(name) == _pre_qdq_op(qdq_producer, name) else None)
            for name, s in sums.items()]
    weight_errors = qdq_debug.compute_weight_error(qdq_debug.create_weight_matching(str(float_path), str(qdq_path)))
    for name, error in weight_errors.items():
        kind = "bias" if name.endswith(".bias") else "weight"
        module = name.rsplit(".", 1)[0] if "." in name else name
        rows.append(TensorError(name, kind, module, module, float(error)))
    rows.sort(key=lambda row: (row.sqnr_db, row.tensor))
    return LayerDiagnosis(data, count, rows)


def _pre_qdq_op(qdq_producer: dict, name: str) -> str | None:
    """The op that produces ``name``'s value before its QuantizeLinear in the QDQ graph (a graph output
    is renamed ``<name>_QuantizeLinear_Input`` there)."""
    return qdq_producer.get(name + "_QuantizeLinear_Input", qdq_producer.get(name))


def _norms(float_values, pre_qdq, post_qdq) -> np.ndarray:
    """``||float||^2, ||float - post||^2, ||pre||^2, ||pre - post||^2`` over one batch's tensors."""
    flat = [np.concatenate(values).ravel().astype(np.float64) for values in (float_values, pre_qdq, post_qdq)]
    reference, pre, post = flat
    return np.array([reference @ reference, np.sum((reference - post) ** 2), pre @ pre, np.sum((pre - post) ** 2)])
