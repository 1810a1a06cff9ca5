"""PyTorch module -> fp32 ONNX file with a dynamic batch axis and the model's preprocessing inside.

The torch.export-based ("dynamo") exporter is tried first; when it cannot capture the model we
fall back to the TorchScript tracer and say so (a warning, and ``OnnxExport.exporter``). Every
export is checked by running the ONNX file in ONNX Runtime on a fresh batch of a different size
than the traced one and comparing with the module: that proves the batch axis is dynamic and
catches tracer exports that silently froze Python-side values into constants.

The preprocessing spec is stored in the ONNX ``metadata_props`` under
:data:`mlflow_di.models.metadata.ONNX_PREPROCESSING_KEY`, where :class:`~mlflow_di.models.classifier.OnnxClassifier`
reads it, so the file alone is enough to classify raw images.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
import warnings

import numpy as np
import onnx
import torch
from torch import nn

from mlflow_di.compression.export_diagnosis import describe_export_failure, describe_wrong_export, summary
from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip
from mlflow_di.models.metadata import ModelMetadata
from mlflow_di.models.preprocessing import Preprocessing

COMPRESSION_METADATA_KEY = "mlflow_di.compression"
INPUT_NAME = "input"
BATCH_AXIS = "batch"
TRACE_BATCH = 2  # not 0 or 1: torch.export specialises those sizes, which would fix the batch axis
CHECK_BATCH = 3  # differs from TRACE_BATCH so the check also proves the batch axis is dynamic
CHECK_TOLERANCE = 1e-3  # relative to the largest output magnitude; fp32 re-ordering stays far below


@dataclasses.dataclass
class OnnxExport(JsonRoundTrip):
    """What an export produced: the file, which exporter made it and how well it matches the module."""

    path: str
    exporter: str  # "dynamo" (torch.export based) or "torchscript" (fallback tracer)
    opset: int
    seconds: float
    max_abs_diff: float  # ONNX Runtime vs PyTorch outputs on the check batch
    fallback_reason: str | None = None


def output_name(preprocessing: Preprocessing) -> str:
    """The ONNX output is named after what it holds: 'logits' or 'probabilities'."""
    return preprocessing.output


def example_inputs(preprocessing: Preprocessing, batch: int, seed: int = 0) -> np.ndarray:
    """Preprocessed random images of the model's input shape, for tracing and checking an export."""
    if preprocessing.input_shape is None:
        raise UserError(
            "cannot export to ONNX without the model's input shape; set it in the preprocessing "
            "(e.g. --preprocessing input_shape=28/28/1)"
        )
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(batch, *preprocessing.input_shape), dtype=np.uint8)
    return preprocessing.apply(images)


def export_onnx(module: nn.Module, preprocessing: Preprocessing, path, opset: int | None = None) -> OnnxExport:
    """Export ``module`` to an fp32 ONNX file at ``path`` with a dynamic batch axis; check it runs the same.

    The input is named ``input`` in ``preprocessing.layout`` (NCHW for the zoo models) and the
    output after ``preprocessing.output``. Raises :class:`UserError` naming the failing op and
    module when neither exporter can export the model, or when the export disagrees with it.
    """
    if not isinstance(module, nn.Module):
        raise UserError(f"ONNX export needs a PyTorch nn.Module, got {type(module).__name__}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace_input = torch.from_numpy(example_inputs(preprocessing, TRACE_BATCH, seed=0))
    check_input = torch.from_numpy(example_inputs(preprocessing, CHECK_BATCH, seed=1))
    was_training = module.training
    module.eval()
    try:
        start = time.perf_counter()
        exporter, fallback_reason = _export_with_fallback(module, trace_input, path, preprocessing, opset)
        seconds = time.perf_counter() - start
        set_metadata(path, ModelMetadata(preprocessing).to_onnx_props())
        max_abs_diff = _check_against_module(module, check_input, path)
    finally:
        module.train(was_training)
    return OnnxExport(str(path), exporter, onnx_opset(path), seconds, max_abs_diff, fallback_reason)


def _export_with_fallback(module, trace_input, path, preprocessing, opset) -> tuple[str, str | None]:
    names = dict(input_names=[INPUT_NAME], output_names=[output_name(preprocessing)], opset_version=opset)
    errors: list[BaseException] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporters' deprecation chatter is not the user's concern
            torch.onnx.export(
                module, (trace_input,), str(path), dynamo=True, external_data=False, verbose=False,
                dynamic_shapes=({0: torch.export.Dim(BATCH_AXIS, min=1)},), **names,
            )
        return "dynamo", None
    except Exception as error:  # the exporter raises many types; all mean "could not capture"
        errors.append(error)
    reason = summary(errors[0])
    warnings.warn(f"the dynamo ONNX exporter failed ({reason}); falling back to the TorchScript exporter")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, (trace_input,), str(path), dynamo=False, verbose=False,
                dynamic_axes={INPUT_NAME: {0: BATCH_AXIS}, output_name(preprocessing): {0: BATCH_AXIS}}, **names,
            )
        return "torchscript", reason
    except Exception as error:
        errors.append(error)
    path.unlink(missing_ok=True)
    raise UserError(describe_export_failure(module, trace_input, errors)) from None


def _check_against_module(module: nn.Module, check_input: torch.Tensor, path: pathlib.Path) -> float:
    """Max |ONNX Runtime - PyTorch| on a batch of another size; UserError (and no file) if they disagree."""
    with torch.no_grad():
        expected = module(check_input).numpy()
    try:
        actual = run_onnx(path, check_input.numpy())
    except Exception as error:  # onnxruntime raises its own exception types
        problem = f"fails in ONNX Runtime on a batch of {len(check_input)} ({_first_line(error)})"
    else:
        max_abs_diff = float(np.abs(actual - expected).max()) if actual.shape == expected.shape else float("inf")
        if max_abs_diff <= CHECK_TOLERANCE * max(1.0, float(np.abs(expected).max())):
            return max_abs_diff
        problem = f"does not compute what the PyTorch module computes (max |difference| {max_abs_diff:.3g})"
    path.unlink(missing_ok=True)
    raise UserError(describe_wrong_export(module, check_input, problem))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


def run_onnx(path, inputs: np.ndarray) -> np.ndarray:
    """The first output of an ONNX model for one float32 batch (CPU, ONNX Runtime)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # failures surface as exceptions; ORT's own log would repeat them
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    from mlflow_di.models import stoppable

    return stoppable.run(session, {session.get_inputs()[0].name: np.ascontiguousarray(inputs, np.float32)},
                         f"the ONNX export '{path}'")[0]


def onnx_opset(path) -> int:
    """The default-domain opset an ONNX file uses."""
    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def metadata(path) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file as a dict."""
    model = onnx.load(str(path), load_external_data=False)
    return {prop.key: prop.value for prop in model.metadata_props}


def set_metadata(path, values: dict[str, str]) -> None:
    """Add or replace ``metadata_props`` entries of an ONNX file in place."""
    model = onnx.load(str(path))
    current = {prop.key: prop.value for prop in model.metadata_props}
    current.update(values)
    del model.metadata_props[:]
    for key, value in current.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def copy_mlflow_di_metadata(source, target, extra: dict | None = None) -> None:
    """Carry the ``mlflow_di.*`` metadata of ``source`` over to ``target`` (quantizers drop it)."""
    values = {k: v for k, v in metadata(source).items() if k.startswith("mlflow_di.")}
    values.update(extra or {})
    set_metadata(target, values)


def read_preprocessing(path) -> Preprocessing | None:
    """The preprocessing spec stored in an ONNX file, or None when it has none."""
    return ModelMetadata.from_onnx_props(metadata(path)).preprocessing


def compression_metadata(method: str, params: dict) -> dict[str, str]:
    """The metadata entry that records how a compressed file was made."""
    return {COMPRESSION_METADATA_KEY: json.dumps({"method": method, "params": params}, sort_keys=True)}
