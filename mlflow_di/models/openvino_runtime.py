"""ONNX files as OpenVINO's CPU plugin runs them: the runtime ``openvino`` (the ``openvino`` extra).

OpenVINO reads the ONNX file itself (no conversion step the user does not do) and compiles it for the
CPU. Its ``INFERENCE_PRECISION_HINT`` decides what a float graph is computed in: on CPUs with bfloat16
(AVX-512 BF16, AMX) the plugin's default is bf16, silently, which moves logits and some top-1 answers
away from ONNX Runtime's f32. The context of every classifier here records the precision the compiled
model reports (what was really used), and what was asked: ``openvino:f32`` or ``openvino:bf16`` pins it
(a CPU without bf16 computes f32 whatever is asked, and the context says so).
"""
from __future__ import annotations

import functools
import pathlib

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.models.classifier import Classifier, fixed_batch, graph_preprocessing
from mlflow_di.models.execution import ExecutionContext, default_threads, host_context
from mlflow_di.models.preprocessing import Preprocessing

#: the CPU plugin's layer types that carry weights (what "runs in int8" means for a model)
WEIGHTED_LAYERS = ("Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul")
#: OpenVINO's element type names -> the precision names the context uses
_PRECISIONS = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16"}


@functools.lru_cache(maxsize=1)
def _core():
    """One ``openvino.Core`` per process (it loads the device plugins once)."""
    import openvino

    return openvino.Core()


def _precision_name(element_type) -> str:
    text = str(getattr(element_type, "get_type_name", lambda: element_type)()).lower()
    text = text.removeprefix("<type: '").removesuffix("'>")
    return _PRECISIONS.get(text, text)


def host_default_precision() -> str:
    """What OpenVINO's CPU plugin computes float graphs in on this host when nothing is pinned (bf16 on CPUs
    with native bfloat16, else f32)."""
    return _precision_name(_core().get_property("CPU", "INFERENCE_PRECISION_HINT"))


class OpenVinoClassifier(Classifier):
    """An ONNX model compiled by OpenVINO for the CPU; ``precision``: ``default`` (the plugin's choice on this
    host), ``f32`` or ``bf16``. Preprocessing comes from the graph's ``mlflow_di.preprocessing`` metadata
    when not given, as for ONNX Runtime."""

    backend = "openvino"

    def __init__(self, path, preprocessing: Preprocessing | None = None, name: str | None = None,
                 precision: str = "default"):
        self.path, self.precision_asked = str(path), precision
        config = {"INFERENCE_NUM_THREADS": default_threads()}
        if precision != "default":
            config["INFERENCE_PRECISION_HINT"] = precision
        try:
            model = _core().read_model(self.path)
            self.compiled = _core().compile_model(model, "CPU", config)
        except Exception as exc:  # noqa: BLE001 - OpenVINO's frontends raise their own types for a bad file
            raise UserError(f"OpenVINO cannot load '{path}': {(str(exc).strip().splitlines() or ['?'])[0]}") from None
        self.request = self.compiled.create_infer_request()
        self.precision = _precision_name(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        self.provider = f"openvino (CPU, {self.precision})"
        shape = self._input_shape(model)
        self.fixed_batch = shape[0] if shape and isinstance(shape[0], int) else None
        if preprocessing is None:
            preprocessing = graph_preprocessing(_onnx_props(self.path), shape)
        super().__init__(preprocessing, name or pathlib.Path(path).name)

    @staticmethod
    def _input_shape(model) -> list:
        dims = model.inputs[0].get_partial_shape()
        return [dim.get_length() if dim.is_static else "batch" for dim in dims] if dims.rank.is_static else []

    @property
    def execution_context(self) -> ExecutionContext:
        """OpenVINO's version, the CPU, the precision the compiled model computes in and what was asked."""
        import openvino

        version = openvino.__version__.split("-")[0]
        threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))
        return host_context("openvino", version, "CPU", graph_optimization="all", threads=threads,
                            precision=self.precision, asked=self.precision_asked)

    def kernels(self) -> str:
        """What the compiled model's weighted layers compute in, e.g. ``Convolution x2 in u8, FullyConnected x3 in
        u8`` (u8/i8: fused int8 kernels; f32 or bf16: float), read from OpenVINO's runtime model."""
        import collections

        counts = collections.Counter()
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            kind = info["layerType"].astype(str) if "layerType" in info else ""
            if kind in WEIGHTED_LAYERS:
                counts[(kind, info["runtimePrecision"].astype(str) if "runtimePrecision" in info else "?")] += 1
        return ", ".join(f"{kind} x{count} in {precision}" for (kind, precision), count in counts.items())

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        return fixed_batch(self._run, batch, self.fixed_batch, self.name)

    def _run(self, batch: np.ndarray) -> np.ndarray:
        from mlflow_di.models import stoppable

        request = self.request
        stoppable.wait_stoppable(lambda: request.start_async({0: batch}), request.wait_for, request.cancel, self.name)
        return np.array(request.get_output_tensor(0).data, dtype=np.float32, copy=True)


def _onnx_props(path: str) -> dict:
    """The ONNX file's metadata props (where mlflow-di keeps the preprocessing), read without its weights' data."""
    import onnx

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - OpenVINO opened it; no readable props means no recorded preprocessing
        return {}
    return {prop.key: prop.value for prop in model.metadata_props}
