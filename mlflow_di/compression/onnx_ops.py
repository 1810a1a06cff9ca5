"""Which layers of an ONNX graph are quantized, and a check that none was left behind.

A "layer" here is a Conv, Gemm or MatMul with a constant weight (an initializer). After ONNX
Runtime quantization it appears in one of two forms:

- QDQ (static): the float op stays, but its weight (and activation) inputs come out of
  ``DequantizeLinear`` nodes fed by int8 initializers;
- integer ops: ``QLinearConv``/``QLinearMatMul``/``QGemm`` (QOperator static),
  ``ConvInteger``/``MatMulInteger`` behind ``DynamicQuantizeLinear``, or ``DynamicQuantizeMatMul``
  (dynamic).

Layers are named after their weight initializer (``conv1.0.weight``), which the PyTorch
exporters take from the module's parameter names and the quantizers keep with a suffix.
"""
from __future__ import annotations

import collections

import onnx
from onnx import numpy_helper

from mlflow_di.errors import UserError

WEIGHTED_FLOAT_OPS = ("Conv", "Gemm", "MatMul")
INTEGER_LAYER_OPS = (
    "QLinearConv", "QLinearMatMul", "QGemm", "ConvInteger", "MatMulInteger",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
)
QUANTIZATION_OPS = INTEGER_LAYER_OPS + ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")
# ONNX Runtime >= 1.32 dynamic quantization transposes Gemm weights into "<name>_Transposed"
_WEIGHT_SUFFIXES = ("_quantized", "_DequantizeLinear_Output", "_dequantized", "_TransposeB", "_Transposed")


class _Graph:
    """Initializers and the producer of every tensor, for walking back from a node's inputs."""

    def __init__(self, model: onnx.ModelProto):
        self.initializers = {init.name: init for init in model.graph.initializer}
        self.producer = {out: node for node in model.graph.node for out in node.output}
        for node in model.graph.node:  # Constant nodes hold weights too in some exports
            if node.op_type == "Constant" and node.attribute and node.attribute[0].type == onnx.AttributeProto.TENSOR:
                self.initializers.setdefault(node.output[0], node.attribute[0].t)

    def constant(self, name: str):
        return self.initializers.get(name)

    def dequantized_constant(self, name: str):
        """The int initializer and scale behind ``name`` when it is DequantizeLinear(constant)."""
        node = self.producer.get(name)
        if node is not None and node.op_type == "DequantizeLinear" and self.constant(node.input[0]) is not None:
            return self.constant(node.input[0]), self.constant(node.input[1])
        return None


def layer_name(weight_name: str) -> str:
    """'conv1.0.weight_quantized' -> 'conv1.0.weight'."""
    for suffix in _WEIGHT_SUFFIXES:
        weight_name = weight_name.removesuffix(suffix)
    return weight_name


def _dtype(tensor) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).name


def _granularity(scale) -> str:
    return "per-channel" if scale is not None and numpy_helper.to_array(scale).size > 1 else "per-tensor"


def _describe_float_op(node, graph: _Graph) -> tuple[str, str, bool] | None:
    """(layer, description, quantized) for a Conv/Gemm/MatMul with a constant weight, else None."""
    candidates = [node.input[1]] if node.op_type in ("Conv", "Gemm") else list(node.input[:2])
    for name in candidates:
        if graph.constant(name) is not None:
            return layer_name(name), f"{node.op_type} (fp32 weight)", False
        dequantized = graph.dequantized_constant(name)
        if dequantized is not None:
            weight, scale = dequantized
            activation = next((i for i in node.input[:2] if i != name), None)
            act_q = activation is not None and getattr(graph.producer.get(activation), "op_type", "") == "DequantizeLinear"
            act_text = "quantized activations" if act_q else "float activations"
            return (
                layer_name(name),
                f"{node.op_type} via QDQ ({_dtype(weight)} {_granularity(scale)} weights, {act_text})",
                True,
            )
    return None


def _describe_integer_op(node, graph: _Graph) -> tuple[str, str, bool]:
    weight_index = 3 if node.op_type in ("QLinearConv", "QLinearMatMul", "QGemm") else 1
    weight_name = node.input[weight_index] if len(node.input) > weight_index else node.name
    weight = graph.constant(weight_name)
    dtype = _dtype(weight) if weight is not None else "integer"
    return layer_name(weight_name), f"{node.op_type} ({dtype} weights)", True


def weighted_layer_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """Layer -> ONNX node name for every float Conv/Gemm/MatMul with a constant weight.

    A layer is named after its weight without ``.weight`` (``conv1.0``): the PyTorch module's
    dotted name, which is what ``--keep-float`` takes.
    """
    graph = _Graph(model)
    nodes = {}
    for node in model.graph.node:
        if node.op_type in WEIGHTED_FLOAT_OPS:
            described = _describe_float_op(node, graph)
            if described is not None:
                nodes[described[0].removesuffix(".weight")] = node.name
    return nodes


def quantized_ops(onnx_path) -> dict:
    """Which weighted layers of an ONNX file are quantized, and how.

    Returns ``{"quantized_layers": {layer: how}, "float_layers": {layer: op}, "op_counts":
    {quantization op: count}}`` where a layer is named after its weight, e.g.
    ``{"conv1.0.weight": "Conv via QDQ (int8 per-channel weights, quantized activations)"}``.
    """
    model = onnx.load(str(onnx_path))
    graph = _Graph(model)
    quantized: dict[str, str] = {}
    floating: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type in INTEGER_LAYER_OPS:
            described = _describe_integer_op(node, graph)
        elif node.op_type in WEIGHTED_FLOAT_OPS:
            described = _describe_float_op(node, graph)
        else:
            continue
        if described is not None:
            layer, how, is_quantized = described
            (quantized if is_quantized else floating)[layer] = how
    counts = collections.Counter(n.op_type for n in model.graph.node if n.op_type in QUANTIZATION_OPS)
    return {"quantized_layers": quantized, "float_layers": floating, "op_counts": dict(sorted(counts.items()))}


def assert_linear_layers_quantized(onnx_path, op_types=WEIGHTED_FLOAT_OPS, kept_float=()) -> dict:
    """Raise :class:`UserError` if a Conv/Gemm/MatMul (of ``op_types``) kept an fp32 weight; return the report.

    ``kept_float``: layers (``conv1.0``) left in float on purpose (``--keep-float``), not an error.

    Also raises when nothing at all is quantized: a quantization method that quantized no layer
    produced the float model under another name.
    """
    report = quantized_ops(onnx_path)
    left_float = {layer: how for layer, how in report["float_layers"].items()
                  if how.split(" ", 1)[0] in op_types and layer.removesuffix(".weight") not in kept_float}
    if left_float:
        listed = ", ".join(f"{layer} ({how.split(' ', 1)[0]})" for layer, how in left_float.items())
        raise UserError(
            f"{len(left_float)} layer(s) of {onnx_path} kept fp32 weights after quantization: {listed}; "
            "the quantizer skipped them (unsupported op pattern or excluded nodes)"
        )
    if not report["quantized_layers"]:
        raise UserError(f"no Conv/Gemm/MatMul layer of {onnx_path} is quantized; nothing was compressed")
    return report
