"""A repaired ONNX model: the repair head appended to the compressed export's graph.

The head becomes plain ONNX nodes (Max, Log, MatMul, Add, Relu, Softmax; a Softmax first when
the export outputs logits), joined to the export with :func:`onnx.compose.merge_models`, so the
result is one ONNX file that any ONNX Runtime loads. Its output is probabilities of the export's
shape (batch, classes); its ``mlflow_di.preprocessing`` metadata is the export's with
``output=probabilities``, so :class:`~mlflow_di.models.classifier.OnnxClassifier` reads it like
any export.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import onnx
from onnx import TensorProto, compose, helper, numpy_helper

from mlflow_di.errors import UserError
from mlflow_di.models.head import EPS, ProbabilityHead
from mlflow_di.models.metadata import ONNX_PREPROCESSING_KEY, ModelMetadata
from mlflow_di.models.preprocessing import Preprocessing

PREFIX = "drepair/"
REPAIRED_KEY = "mlflow_di.repaired"


def head_graph(head: ProbabilityHead, from_logits: bool, output: str, opset: int, ir_version: int) -> onnx.ModelProto:
    """The head alone as an ONNX model: input ``drepair/input`` (batch, C), output ``output``."""
    name = lambda n: PREFIX + n  # noqa: E731
    inits = [numpy_helper.from_array(np.asarray(value, np.float32), name(key))
             for key, value in (("w1", head.w1), ("b1", head.b1), ("w2", head.w2), ("b2", head.b2),
                                ("eps", np.float32(EPS)))]
    nodes = []
    probabilities = name("input")
    if from_logits:
        nodes.append(helper.make_node("Softmax", [probabilities], [name("softmax")], axis=-1, name=name("softmax")))
        probabilities = name("softmax")
    steps = [("Max", [probabilities, name("eps")], "clipped"), ("Log", [name("clipped")], "x"),
             ("MatMul", [probabilities, name("w1")], "h1"), ("Add", [name("h1"), name("b1")], "h2"),
             ("Relu", [name("h2")], "h3"), ("MatMul", [name("h3"), name("w2")], "c1"),
             ("Add", [name("c1"), name("b2")], "c2"), ("Add", [name("x"), name("c2")], "logits")]
    nodes += [helper.make_node(op, inputs, [name(out)], name=name(out)) for op, inputs, out in steps]
    nodes.append(helper.make_node("Softmax", [name("logits")], [output], axis=-1, name=name("output")))
    shape = ["batch", head.num_classes]
    graph = helper.make_graph(nodes, "drepair_head",
                              [helper.make_tensor_value_info(name("input"), TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def append_head(export_path, head: ProbabilityHead, preprocessing: Preprocessing, out_path,
                facts: dict | None = None) -> pathlib.Path:
    """Write ``export_path`` followed by ``head`` to ``out_path``; ``preprocessing`` is the export's
    (its ``output`` says whether the export gives logits). ``facts`` go into the metadata as
    ``mlflow_di.<key>`` entries."""
    export = onnx.load(str(export_path))
    if len(export.graph.output) != 1:
        raise UserError(f"'{export_path}' has {len(export.graph.output)} outputs; a repair head needs one output")
    source_output = export.graph.output[0].name
    opset = next((o.version for o in export.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset < 13:
        raise UserError(f"'{export_path}' uses ONNX opset {opset}; appending a repair head needs opset 13 or newer")
    names = {value for node in export.graph.node for value in node.output} | {i.name for i in export.graph.input}
    output = "probabilities" if "probabilities" not in names else PREFIX + "probabilities"
    tail = head_graph(head, preprocessing.output == "logits", output, opset, export.ir_version)
    merged = compose.merge_models(export, tail, io_map=[(source_output, PREFIX + "input")], outputs=[output])
    repaired = dataclasses.replace(preprocessing, output="probabilities")
    props = {prop.key: prop.value for prop in export.metadata_props}
    props.update(ModelMetadata(repaired).to_onnx_props())
    props[REPAIRED_KEY] = "true"
    for key, value in (facts or {}).items():
        props[f"mlflow_di.{key}"] = value if isinstance(value, str) else json.dumps(value)
    del merged.metadata_props[:]
    for key, value in props.items():
        merged.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(merged)
    out_path = pathlib.Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(merged, str(out_path))
    return out_path


__all__ = ["append_head", "head_graph", "ONNX_PREPROCESSING_KEY", "REPAIRED_KEY"]
