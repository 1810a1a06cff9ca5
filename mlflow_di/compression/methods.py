"""One entry point for every compression method: PyTorch module in, ONNX file + what was done out.

:func:`compress` runs a declared method (:mod:`mlflow_di.compression.declarations`, which lists them and their
options) on a :class:`MethodJob`; this module holds the built-in methods' ``export`` functions, which the
declarations name, and what they share (the fp32 graph they start from, the export facts worth recording).
"""
from __future__ import annotations

import dataclasses
import io
import pathlib
import shutil
import tempfile
import time
from typing import Callable

import numpy as np
import torch
from torch import nn

from mlflow_di.compression.export import OnnxExport, compression_metadata, export_onnx, onnx_opset, set_metadata
from mlflow_di.compression.nncf_int8 import quantize_with_nncf
from mlflow_di.compression.onnx_ops import assert_linear_layers_quantized
from mlflow_di.compression.prune import prunable_layers, prune_l1, prune_structured
from mlflow_di.compression.quantize import (
    excluded_nodes,
    quantize_int8_dynamic,
    quantize_int8_static,
    require_calibration_inputs,
)
from mlflow_di.compression.declarations import method_declaration, methods_that
from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip
from mlflow_di.data import LazyImages
from mlflow_di.models.preprocessing import ModelInputs, Preprocessing

PRUNE_L1_SCOPE = "global"


@dataclasses.dataclass(frozen=True)
class MethodJob:
    """What one method is asked to do (see :class:`~mlflow_di.compression.declarations.MethodDeclaration`)."""

    module: nn.Module
    preprocessing: Preprocessing
    method: str
    path: pathlib.Path
    calib: object = None
    amount: float = 0.3
    opset: int | None = None
    keep_float: tuple = ()
    graph: object = None
    exported: OnnxExport | None = None
    settings: object = None  # the method's own settings, as its declaration configures them (int8-static: a Recipe)


@dataclasses.dataclass
class CompressionResult(JsonRoundTrip):
    """A compressed model file and how it was made.

    ``sparsity`` is set for pruning methods, ``quantized_ops`` (see
    :func:`~mlflow_di.compression.onnx_ops.quantized_ops`) for quantization methods.
    ``source_size_bytes`` is the size of the source module's serialized state dict.
    ``float_path`` (int8-static) is the pre-processed fp32 graph quantization started from: the
    float side of the layer-wise diagnosis (:mod:`~mlflow_di.compression.quant_debug`), not a model
    to register.
    """

    method: str
    path: str
    params: dict
    size_bytes: int
    source_size_bytes: int
    seconds: float
    exporter: str
    sparsity: float | None = None
    quantized_ops: dict | None = None
    float_path: str | None = None

    JSON_DUMPS = {"indent": 2, "sort_keys": True}
    JSON_OPTIONAL = {"float_path": None}  # added later: results written before keep their bytes


def torch_model_size_bytes(module: nn.Module) -> int:
    """Bytes of ``torch.save(module.state_dict())``: the source model's size for comparison."""
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def check_keep_float(module: nn.Module, method: str, keep_float=(), auto_keep_float: int = 0) -> None:
    """UserError unless the layers to keep in float (module names, or a count of worst layers) fit the
    method and the model, and leave at least one layer quantized."""
    if not keep_float and not auto_keep_float:
        return
    if not method_declaration(method).selective:
        raise UserError(f"--keep-float and --auto-keep-float apply to {', '.join(methods_that('selective'))} only, "
                        f"not {method}")
    if keep_float and auto_keep_float:
        raise UserError("pass either --keep-float LAYER,... or --auto-keep-float K, not both")
    layers = [name for name, _ in prunable_layers(module)]
    unknown = [name for name in keep_float if name not in layers]
    if unknown:
        raise UserError(f"--keep-float: no quantizable layer '{unknown[0]}' in the model; layers: {', '.join(layers)}")
    if len(set(keep_float)) >= len(layers) or auto_keep_float >= len(layers):
        raise UserError(f"keeping {auto_keep_float or len(set(keep_float))} of the model's {len(layers)} layers "
                        "in float leaves none quantized; keep fewer")


def calibration_inputs(calib_inputs, preprocessing: Preprocessing) -> np.ndarray | ModelInputs | None:
    """Raw uint8 NHWC images (an array or lazy images) become model inputs preprocessed batch by batch;
    float arrays are taken as model inputs already."""
    if calib_inputs is None:
        return None
    if not isinstance(calib_inputs, LazyImages):
        calib_inputs = np.asarray(calib_inputs)
    if calib_inputs.dtype == np.uint8 and len(calib_inputs):
        return ModelInputs(calib_inputs, preprocessing)
    return calib_inputs


def compress(module: nn.Module, preprocessing: Preprocessing, method: str, out_dir, calib_inputs=None,
             **job_fields) -> CompressionResult:
    """Compress ``module`` with ``method`` into ``out_dir/<method>.onnx``.

    ``calib_inputs`` (int8-static only) are raw uint8 NHWC images (an array or lazy images, read and
    preprocessed one calibration batch at a time) or preprocessed float inputs. ``job_fields``: the other
    :class:`MethodJob` fields, declared there with their defaults: ``amount`` is the pruning fraction
    (prune-l1: of all weights, prune-structured: of each layer's output channels), ``opset``. The ONNX file
    carries the preprocessing and a ``mlflow_di.compression`` metadata entry with the method and its
    parameters. ``keep_float`` (int8-static only): layers (PyTorch module names, e.g. ``conv1.0``) left in
    float. int8-static also keeps the float graph it quantized as ``out_dir/<method>.float.onnx``.
    ``graph``: the ONNX file ``module`` is the white-box view of (an ONNX original): fp32 and the int8
    methods then start from that graph itself instead of an export of the view; pruning prunes the view's
    weights and exports it. ``exported``: an fp32 export of ``module`` made earlier (:func:`float_export`)
    that fp32 and the int8 methods copy instead of exporting again (a search that quantizes one model many
    times exports it once). ``settings``: the method's own settings object, as its declaration's
    :meth:`~mlflow_di.compression.declarations.MethodDeclaration.configure` makes it (None: its options'
    defaults; int8-static's is a :class:`~mlflow_di.compression.recipes.Recipe`, by default one that does not
    saturate on any CPU).
    """
    declared = method_declaration(method)
    keep_float = tuple(job_fields.pop("keep_float", ()))
    if job_fields.get("settings") is None:
        job_fields["settings"] = declared.configure()
    if keep_float and not declared.selective:
        raise UserError(f"--keep-float applies to {', '.join(methods_that('selective'))} only, not {method}")
    if not isinstance(module, nn.Module):
        raise UserError(f"compression needs a PyTorch nn.Module, got {type(module).__name__}")
    calib = calibration_inputs(calib_inputs, preprocessing)
    if declared.needs_calibration:
        require_calibration_inputs(calib)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{method}.onnx"
    start = time.perf_counter()
    fields = declared.run_export(MethodJob(module, preprocessing, method, path, calib, keep_float=keep_float, **job_fields))
    seconds = time.perf_counter() - start
    set_metadata(path, compression_metadata(method, fields["params"]))
    return CompressionResult(
        method=method, path=str(path), size_bytes=path.stat().st_size,
        source_size_bytes=torch_model_size_bytes(module), seconds=seconds, **fields,
    )


def float_export(module, preprocessing: Preprocessing, out, opset=None, graph=None, exported=None) -> OnnxExport:
    """The fp32 ONNX model the methods start from at ``out``: a copy of ``exported`` when given, else
    an ONNX original's own ``graph``, else an export of ``module``."""
    if exported is not None:
        shutil.copyfile(exported.path, out)
        return dataclasses.replace(exported, path=str(out))
    if graph is not None:
        from mlflow_di.models.onnx_torch import onnx_layer_names

        return _original_graph(graph, preprocessing, out, onnx_layer_names(module))
    return export_onnx(module, preprocessing, out, opset)


def export_fp32(job: MethodJob) -> dict:
    export = float_export(job.module, job.preprocessing, job.path, job.opset, job.graph, job.exported)
    return {"params": export_facts(export), "exporter": export.exporter}


def _int8(job: MethodJob, quantize: Callable[[pathlib.Path, MethodJob], tuple[dict, dict]]) -> dict:
    """An int8 method: the fp32 graph it starts from (an export, or an ONNX original's own graph), ``quantize``d
    (-> its params and extra result fields), each Conv/Linear checked to be quantized unless kept in float."""
    with tempfile.TemporaryDirectory(prefix="mlflow-di-fp32-") as work:
        fp32_path = pathlib.Path(work) / "fp32.onnx"
        export = float_export(job.module, job.preprocessing, fp32_path, job.opset, job.graph, job.exported)
        params, extra = quantize(fp32_path, job)
    params.update(export_facts(export))
    return {"params": params, "exporter": export.exporter, **extra,
            "quantized_ops": assert_linear_layers_quantized(job.path, kept_float=list(job.keep_float))}


def export_int8_static(job: MethodJob) -> dict:
    return _int8(job, _static)


def export_int8_dynamic(job: MethodJob) -> dict:
    return _int8(job, _dynamic)


def export_int8_nncf(job: MethodJob) -> dict:
    return _int8(job, quantize_with_nncf)


def _static(fp32_path: pathlib.Path, job: MethodJob) -> tuple[dict, dict]:
    float_path = job.path.with_name(f"{job.method}.float.onnx")
    recipe = job.settings
    keep_float = list(job.keep_float)
    quantize_int8_static(fp32_path, job.path, job.calib, recipe=recipe, float_out=float_path, keep_float=keep_float)
    params = {"format": "QDQ", **recipe.params(), "calibration_samples": int(len(job.calib))}
    if keep_float:  # both names: PyTorch modules, and the ONNX nodes ORT's nodes_to_exclude takes
        params["kept_float"] = keep_float
        params["nodes_to_exclude"] = excluded_nodes(float_path, keep_float)
    return params, {"float_path": str(float_path)}


def _dynamic(fp32_path: pathlib.Path, job: MethodJob) -> tuple[dict, dict]:
    quantize_int8_dynamic(fp32_path, job.path, per_channel=True)
    return {"per_channel": True, "weights": "int8", "activations": "dynamic uint8"}, {}


def _original_graph(graph, preprocessing: Preprocessing, out, layer_names: dict | None = None) -> OnnxExport:
    """An ONNX original's own graph as the float model to compress: copied (weights MLflow keeps in
    external files taken inside), with the preprocessing stored, and each weighted layer's weight named
    ``<layer>.weight`` after the layer its white-box view gives it (``layer_names``: node -> layer), so that
    every figure names the layer as coverage does (an exporter's ``onnx::Conv_20`` becomes ``stem.0.weight``)."""
    import onnx

    from mlflow_di.models.metadata import ModelMetadata

    model = onnx.load(str(graph))
    _name_weights_by_layer(model, layer_names or {})
    onnx.save_model(model, str(out))
    set_metadata(out, ModelMetadata(preprocessing).to_onnx_props())
    return OnnxExport(str(out), "original graph", onnx_opset(out), 0.0, 0.0)


def _name_weights_by_layer(model, layer_names: dict) -> None:
    """Rename, in place, the weight initializer of each Conv/Gemm/MatMul node ``layer_names`` knows to ``<layer>.weight``."""
    initializers = {init.name: init for init in model.graph.initializer}
    renamed = {}
    for node in model.graph.node:
        layer = layer_names.get(node.name)
        if layer is None or node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2:
            continue
        weight, wanted = node.input[1], f"{layer}.weight"
        if weight in initializers and weight != wanted and wanted not in initializers and weight not in renamed:
            renamed[weight] = wanted
    for old, new in renamed.items():
        initializers[old].name = new
    for node in model.graph.node:
        node.input[:] = [renamed.get(value, value) for value in node.input]


def export_facts(export) -> dict:
    """The export facts worth recording: the opset, and why the dynamo exporter was not used (if so)."""
    params = {"opset": export.opset}
    if export.fallback_reason:
        params["exporter_fallback_reason"] = export.fallback_reason
    return params


def export_prune_l1(job: MethodJob) -> dict:
    pruned = prune_l1(job.module, job.amount, scope=PRUNE_L1_SCOPE)
    params = {"amount": float(job.amount), "scope": PRUNE_L1_SCOPE, "norm": "L1", "structure": "unstructured"}
    return _pruned_export(job, pruned, params)


def export_prune_structured(job: MethodJob) -> dict:
    pruned = prune_structured(job.module, job.amount)
    params = {"amount": float(job.amount), "norm": "L1", "structure": "output channels",
              "kept_layer": prunable_layers(job.module)[-1][0]}
    return _pruned_export(job, pruned, params)


def _pruned_export(job: MethodJob, pruned, params: dict) -> dict:
    export = export_onnx(pruned.module, job.preprocessing, job.path, job.opset)
    params.update(export_facts(export))
    return {"params": params, "exporter": export.exporter, "sparsity": pruned.sparsity}
