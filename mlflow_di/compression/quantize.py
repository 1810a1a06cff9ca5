"""int8 quantization of an fp32 ONNX file with ONNX Runtime's quantization tool.

Both methods first run ONNX Runtime's quantization pre-processing (symbolic shape inference
and graph optimisation, ``quant_pre_process``), which the ORT docs recommend so that the
quantizer sees fused ops and known shapes.

- static: QDQ format, 8-bit weights and activations as a :class:`~mlflow_di.compression.recipes.Recipe`
  says (default ``u8u8``: uint8 both, per-channel weights, MinMax ranges: the same answers on every
  CPU), activation ranges calibrated on preprocessed inputs the caller supplies. The calibration reader
  hands ONNX Runtime one batch at a time, taken from an array or from a
  :class:`~mlflow_di.models.preprocessing.ModelInputs` that preprocesses (and, for lazy data,
  reads) each batch only then; ORT's MinMax calibrator keeps just each tensor's min and max
  per batch, so memory does not grow with the number of calibration images;
- dynamic: int8 weights, activations quantized at run time (``DynamicQuantizeLinear``), no
  calibration data needed.
"""
from __future__ import annotations

import logging
import pathlib
import tempfile

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

from mlflow_di.compression.export import copy_mlflow_di_metadata
from mlflow_di.compression.onnx_ops import weighted_layer_nodes
from mlflow_di.compression.recipes import Recipe, recipe as named_recipe
from mlflow_di.errors import UserError
from mlflow_di.models.preprocessing import ModelInputs
from mlflow_di.progress import progress_bar as tqdm

logger = logging.getLogger(__name__)

CALIBRATION_BATCH_SIZE = 64
NO_CALIBRATION_HINT = (
    "int8-static quantization needs calibration images to measure activation ranges; pass --calib-data "
    "(e.g. --calib-data mnist-train:DIR[0:500], a few hundred images of the training distribution)"
)


class ArrayCalibrationReader(CalibrationDataReader):
    """Feeds preprocessed float32 inputs to ONNX Runtime's calibrator, one batch at a time.

    ``inputs``: an array, or anything sliceable with ``len`` whose slices are float arrays (a
    :class:`~mlflow_di.models.preprocessing.ModelInputs`): each batch is taken only when asked for.
    """

    def __init__(self, input_name: str, inputs, batch_size: int = CALIBRATION_BATCH_SIZE, progress: bool = True):
        self.input_name = input_name
        self.inputs = inputs
        self.batch_size = batch_size
        self.position = 0
        self.progress = progress
        self._bar = None

    def get_next(self) -> dict | None:
        if self.position >= len(self.inputs):
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            return None
        if self._bar is None:
            self._bar = tqdm(total=len(self.inputs), desc="calibration", unit="image", disable=not self.progress,
                             leave=False)
        batch = np.ascontiguousarray(self.inputs[self.position:self.position + self.batch_size], dtype=np.float32)
        self.position += self.batch_size
        self._bar.update(len(batch))
        return {self.input_name: batch}

    def rewind(self) -> None:
        self.position = 0


def pre_process(fp32_path, out_path) -> None:
    """ORT's quantization pre-processing; retried without symbolic shape inference if that fails."""
    try:
        quant_pre_process(str(fp32_path), str(out_path))
    except Exception as error:  # symbolic shape inference does not know every op
        logger.warning("quantization pre-processing with symbolic shapes failed (%s); retrying without", error)
        quant_pre_process(str(fp32_path), str(out_path), skip_symbolic_shape=True)


def model_input(path) -> tuple[str, list]:
    """Name and shape (ints or symbolic names) of an ONNX model's first input."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    return first.name, list(first.shape)


def require_calibration_inputs(inputs) -> None:
    """UserError pointing at --calib-data when there are no calibration inputs at all."""
    if inputs is None or len(inputs) == 0:
        raise UserError(NO_CALIBRATION_HINT)


def check_calibration_inputs(inputs, input_shape: list):
    """Calibration inputs (float32 of the model's input shape), or a UserError saying what is wrong.

    An array comes back as float32; a lazy :class:`~mlflow_di.models.preprocessing.ModelInputs` as it is.
    """
    require_calibration_inputs(inputs)
    if not isinstance(inputs, ModelInputs):
        inputs = np.asarray(inputs)
    if not np.issubdtype(inputs.dtype, np.floating):
        raise UserError(
            f"calibration inputs must be preprocessed float arrays (model input), got {inputs.dtype}; "
            "apply the model's preprocessing first (Preprocessing.apply)"
        )
    fixed = [(axis, size) for axis, size in enumerate(input_shape) if isinstance(size, int) and axis > 0]
    if inputs.ndim != len(input_shape) or any(inputs.shape[axis] != size for axis, size in fixed):
        raise UserError(
            f"calibration inputs have shape {inputs.shape} but the model input is {input_shape}; "
            "use calibration images of the model's size and layout"
        )
    return inputs if isinstance(inputs, ModelInputs) else inputs.astype(np.float32, copy=False)


def excluded_nodes(prepared_path, keep_float) -> list[str]:
    """ONNX node names of the layers ``keep_float`` (PyTorch module names such as ``conv1.0``) in a graph;
    a UserError listing the graph's layers names one it does not have."""
    nodes = weighted_layer_nodes(onnx.load(str(prepared_path), load_external_data=False))
    unknown = [name for name in keep_float if name not in nodes]
    if unknown:
        raise UserError(f"--keep-float: no quantizable layer '{unknown[0]}' in the model; layers: {', '.join(nodes)}")
    return [nodes[name] for name in keep_float]


def quantize_int8_static(fp32_path, out_path, calibration_inputs_float, recipe: Recipe | None = None,
                         float_out=None, keep_float=()) -> pathlib.Path:
    """Static int8 QDQ quantization of ``fp32_path`` calibrated on preprocessed inputs; returns ``out_path``.

    ``recipe``: types, ranges and calibration (:mod:`~mlflow_di.compression.recipes`; None: the default).
    ``float_out``: where to keep the pre-processed fp32 graph that quantization starts from (the
    float side of :func:`~mlflow_di.compression.quant_debug.diagnose`); ``keep_float``: layers
    (PyTorch module names) left in float (ONNX Runtime's ``nodes_to_exclude``).
    """
    require_calibration_inputs(calibration_inputs_float)
    input_name, input_shape = model_input(fp32_path)
    inputs = check_calibration_inputs(calibration_inputs_float, input_shape)
    out_path = pathlib.Path(out_path)
    with tempfile.TemporaryDirectory(prefix="mlflow-di-quant-") as work:
        prepared = pathlib.Path(float_out) if float_out else pathlib.Path(work) / "prepared.onnx"
        pre_process(fp32_path, prepared)
        quantize_static(
            str(prepared), str(out_path), ArrayCalibrationReader(input_name, inputs),
            quant_format=QuantFormat.QDQ, nodes_to_exclude=excluded_nodes(prepared, keep_float),
            **(recipe or named_recipe()).quantize_static_kwargs(),
        )
    copy_mlflow_di_metadata(fp32_path, out_path)
    return out_path


def quantize_int8_dynamic(fp32_path, out_path, per_channel: bool = True) -> pathlib.Path:
    """Dynamic int8 quantization (int8 weights, run-time activation ranges) of ``fp32_path``; returns ``out_path``."""
    out_path = pathlib.Path(out_path)
    with tempfile.TemporaryDirectory(prefix="mlflow-di-quant-") as work:
        prepared = pathlib.Path(work) / "prepared.onnx"
        pre_process(fp32_path, prepared)
        quantize_dynamic(str(prepared), str(out_path), per_channel=per_channel, weight_type=QuantType.QInt8)
    copy_mlflow_di_metadata(fp32_path, out_path)
    return out_path
