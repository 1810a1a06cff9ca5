"""Black-box classifiers: raw uint8 NHWC images in, class probabilities out, whatever the backend.

The fuzzing engine and the evaluator see only this interface, so a PyTorch original can be
compared with an ONNX Runtime or TFLite compressed model. Each backend implements
``_forward`` on one already-preprocessed float32 batch; batching, shape checks and the
softmax live here once.
"""
from __future__ import annotations

import contextlib
import os
import pathlib

import numpy as np

from mlflow_di.data import LazyImages
from mlflow_di.errors import UserError
from mlflow_di.models.device import module_device, with_index
from mlflow_di.models.preprocessing import Preprocessing


def check_finite(outputs: np.ndarray, name: str | None, what: str = "images") -> None:
    """A one-line UserError when a model's outputs hold NaN or Inf: a model that answers so has no answer to
    compare (its top-1 would be class 0 by accident, and two such models would "agree" everywhere)."""
    finite = np.isfinite(outputs).reshape(len(outputs), -1).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        model = f"the model '{name}'" if name else "the model"
        raise UserError(f"{model} answered NaN or Inf on {len(bad)} of {len(outputs)} {what} (the first: "
                        f"number {bad[0]}); its outputs are not probabilities: check the model's weights and its "
                        "preprocessing (what it was trained on: --preprocessing)")


class Classifier:
    """Maps raw uint8 images (N, H, W, C) to float32 probabilities (N, classes) in batches."""

    backend = "abstract"
    provider = "cpu"  #: what runs the model, for logs (a backend names its device or execution provider)
    default_batch_size = 256
    #: where the model was loaded from (:class:`mlflow_di.models.origin.Origin`), set by
    #: ``load_classifier``: a Ray worker loads its own copy from it; None for classifiers built in Python
    origin = None

    def __init__(self, preprocessing: Preprocessing, name: str):
        self.preprocessing = preprocessing
        self.name = name
        self._num_classes: int | None = None

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        """Model outputs (logits or probabilities, see preprocessing.output) for one float32 batch."""
        raise NotImplementedError

    def predict_proba(self, images: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """Probabilities for raw uint8 NHWC images, computed in batches of ``batch_size``.

        ``images`` may be lazy (:class:`mlflow_di.data.LazyImages`): each batch is read as it is classified.
        """
        if not isinstance(images, LazyImages):
            images = np.asarray(images)
        if images.dtype != np.uint8:
            raise UserError(f"{self.name}: images must be raw uint8 pixels, got {images.dtype}")
        self.preprocessing.check_images(images)
        size = batch_size or self.default_batch_size
        if len(images) <= size:  # the common case (fuzzing calls): no chunk list, no concatenation
            probabilities = self._predict_batch(images[:])  # [:]: an array's view, or a lazy set read
        else:
            probabilities = np.concatenate([self._predict_batch(images[i:i + size])
                                            for i in range(0, len(images), size)])
        check_finite(probabilities, self.name)
        self._num_classes = probabilities.shape[1]
        return probabilities

    def _predict_batch(self, images: np.ndarray) -> np.ndarray:
        """Probabilities for one batch of already-checked raw images."""
        return self.preprocessing.to_probabilities(self._forward(self.preprocessing.apply(images)))

    def predict(self, images: np.ndarray, batch_size: int | None = None) -> np.ndarray:
        """Top-1 labels for raw uint8 NHWC images."""
        return self.predict_proba(images, batch_size).argmax(axis=1)

    @property
    def num_classes(self) -> int:
        """Number of classes (probes the model with one blank image the first time, if needed)."""
        if self._num_classes is None:
            if self.preprocessing.input_shape is None:
                raise UserError(f"{self.name}: input shape unknown; set it with --preprocessing input_shape=H/W/C")
            try:
                self.predict_proba(np.zeros((1, *self.preprocessing.input_shape), np.uint8))
            except (RuntimeError, ValueError) as exc:  # the framework's own shape error
                raise self.preprocessing.shape_mismatch(self.name, exc) from None
        return self._num_classes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class TorchClassifier(Classifier):
    """A PyTorch ``nn.Module`` used as a black box (eval mode, no gradients).

    ``MLFLOW_DI_THREADS``, when set, also sets torch's intra-op thread count (a process-wide
    setting), as it does for ONNX Runtime and TFLite sessions.
    """

    backend = "pytorch"

    def __init__(self, module, preprocessing: Preprocessing, name: str = "pytorch-model"):
        import torch

        super().__init__(preprocessing, name)
        if not isinstance(module, torch_fx_graph_module()):  # exported (pt2) graphs refuse .eval()
            module.eval()
        self.module = module
        self._torch = torch  # imported once: the forward pass runs per fuzzing query
        threads = os.environ.get("MLFLOW_DI_THREADS")
        if threads:
            torch.set_num_threads(int(threads))

    @property
    def device(self):
        """Where the module runs (its parameters' device); batches are sent there, outputs come back."""
        return module_device(self.module)

    @property
    def provider(self) -> str:
        """What runs the model, for logs: ``pytorch (cpu)`` or ``pytorch (cuda:0)``."""
        return f"pytorch ({self.device})"

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            outputs = self.module(torch.from_numpy(batch).to(self.device))
        return (outputs if outputs.dtype == torch.float32 else outputs.float()).cpu().numpy()

    def _predict_batch(self, images: np.ndarray) -> np.ndarray:
        """Preprocessing runs on the model's device: on a GPU host the host's preprocessing, even the table
        lookup, cost more than the GPU's own forward pass and copied 4x the bytes
        (benchmarks/RESULTS.md, "Realistic size on cuda:0")."""
        torch = self._torch
        device = self.device
        if device.type == "cpu":
            return super()._predict_batch(images)
        with torch.inference_mode():
            outputs = self.module(self.preprocessing.apply_on(images, device))
        return self.preprocessing.to_probabilities(outputs.float().cpu().numpy())

    def predict_device_batch(self, images) -> np.ndarray:
        """:meth:`predict_proba` for a uint8 NHWC tensor already on this model's device (a campaign's mutants,
        made where the model runs, see :func:`takes_device_batches`): the same probabilities as for its host
        copy, without copying the images to the host and back. A batch on the CPU is that array: it takes
        :meth:`predict_proba`'s table lookup, faster there than torch's arithmetic."""
        if images.device.type == "cpu":
            return self.predict_proba(images.numpy())
        return self._classified_where_it_is(images)

    def _classified_where_it_is(self, images) -> np.ndarray:
        """:meth:`predict_device_batch`'s work on any device: preprocessing and the forward pass where ``images`` is."""
        self.preprocessing.check_images(images)
        size = self.default_batch_size
        with self._torch.inference_mode():
            outputs = [self.module(self.preprocessing.apply_on(images[i:i + size], self.device)).float().cpu().numpy()
                       for i in range(0, len(images), size)]
        probabilities = self.preprocessing.to_probabilities(outputs[0] if len(outputs) == 1 else np.concatenate(outputs))
        check_finite(probabilities, self.name)
        self._num_classes = probabilities.shape[1]
        return probabilities


def takes_device_batches(model, device) -> bool:
    """Whether ``model`` classifies a uint8 batch already on ``device`` (:meth:`TorchClassifier.predict_device_batch`):
    a PyTorch classifier running there, on an accelerator. Not on the CPU: there the host's rows are the
    device's memory, so no copy is saved (a campaign keeping fresh batches ran 0.96-1.02x as fast as one
    reusing its rows: benchmarks/RESULTS.md, bench_device_batch)."""
    device = with_index(device)
    return device.type != "cpu" and isinstance(model, TorchClassifier) and with_index(model.device) == device



def torch_fx_graph_module():
    import torch.fx

    return torch.fx.GraphModule


def _threads() -> int:
    from mlflow_di.models.execution import default_threads

    return default_threads()


class OnnxClassifier(Classifier):
    """An ONNX model run by ONNX Runtime. Preprocessing is read from the model's
    ``mlflow_di.preprocessing`` metadata when not given; the input shape from its input.

    ``device`` (``auto``, ``cpu``, ``cuda[:N]``) picks the execution provider: CUDA when asked
    for (or ``auto`` on a machine with a GPU) and the installed onnxruntime build has it, else the
    CPU; :attr:`provider` says which one the session really uses. ``semantics``: ``host`` (this
    CPU's fused int8 kernels, ONNX Runtime's default) or ``reference`` (the QDQ graph as written:
    graph optimizations off; see :mod:`mlflow_di.models.execution`).
    """

    backend = "onnxruntime"

    def __init__(self, path, preprocessing: Preprocessing | None = None, name: str | None = None, device=None,
                 semantics: str = "host"):
        import onnxruntime as ort

        from mlflow_di.models.device import onnx_providers
        from mlflow_di.models.execution import session_options

        options = session_options(semantics, _threads())
        self.semantics = semantics
        self.path, self._device = str(path), device
        try:
            self.session = ort.InferenceSession(str(path), options, providers=onnx_providers(device))
        except Exception as exc:  # onnxruntime raises its own exception types
            raise UserError(f"cannot load ONNX model '{path}': {str(exc).splitlines()[0]}") from None
        self.input_name = self.session.get_inputs()[0].name
        self.provider = f"onnxruntime ({self.session.get_providers()[0]})"
        self.fixed_batch = self._fixed_batch_size()
        if preprocessing is None:
            preprocessing = self._stored_preprocessing()
        super().__init__(preprocessing, name or pathlib.Path(path).name)

    def with_semantics(self, semantics: str) -> "OnnxClassifier":
        """The same model file and preprocessing run with other ``semantics`` (a new session)."""
        twin = OnnxClassifier(self.path, self.preprocessing, self.name, self._device, semantics)
        twin.origin = getattr(self, "origin", None)
        return twin

    @property
    def execution_context(self):
        """The :class:`~mlflow_di.models.execution.ExecutionContext` this session's answers come from."""
        from mlflow_di.models.execution import execution_context

        return execution_context(self.session, self.semantics)

    def _stored_preprocessing(self) -> Preprocessing:
        return graph_preprocessing(self.session.get_modelmeta().custom_metadata_map, self.session.get_inputs()[0].shape)

    def _fixed_batch_size(self) -> int | None:
        first = self.session.get_inputs()[0].shape[0]
        return first if isinstance(first, int) else None

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        return fixed_batch(self._run, batch, self.fixed_batch, self.name)

    def _run(self, batch: np.ndarray) -> np.ndarray:
        from mlflow_di.models import stoppable

        return stoppable.run(self.session, {self.input_name: batch}, self.name)[0]


def graph_preprocessing(metadata: dict, shape) -> Preprocessing:
    """An ONNX graph's preprocessing, whatever runtime opened it: its ``mlflow_di.preprocessing`` metadata
    (``metadata``: the graph's props), else what its input ``shape`` (e.g. ``['batch', 1, 28, 28]``) tells."""
    from mlflow_di.models.metadata import ModelMetadata

    stored = ModelMetadata.from_onnx_props(metadata).preprocessing
    if stored is not None:
        return stored
    if len(shape) == 4 and all(isinstance(d, int) for d in shape[1:]):
        if shape[1] in (1, 3) and shape[3] not in (1, 3):
            return Preprocessing(layout="NCHW", input_shape=(shape[2], shape[3], shape[1]))
        return Preprocessing(layout="NHWC", input_shape=tuple(shape[1:]))
    return Preprocessing()


def fixed_batch(forward, batch: np.ndarray, fixed: int | None, name: str) -> np.ndarray:
    """``forward(batch)`` for a graph whose batch axis is ``fixed`` (None: dynamic): a fixed size of 1 runs image
    by image, another fixed size that differs from the batch's is a one-line refusal."""
    if fixed and len(batch) != fixed:
        if fixed != 1:
            raise UserError(f"{name}: model has a fixed batch size {fixed}; export it with a dynamic batch axis")
        return np.concatenate([forward(batch[i:i + 1]) for i in range(len(batch))])
    return forward(batch)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Silence what native code writes to file descriptor 2 (Python's own sys.stderr is untouched)."""
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class TFLiteClassifier(Classifier):
    """A TensorFlow Lite model run by ``ai-edge-litert`` (no TensorFlow needed).

    TFLite files carry no preprocessing, so the default is scale 1/255, NHWC, probabilities
    (the DFlare reference models end in softmax); override it for other models.
    """

    backend = "tflite"
    default_batch_size = 512
    provider = "tflite (cpu)"

    def __init__(self, path, preprocessing: Preprocessing | None = None, name: str | None = None):
        try:
            from ai_edge_litert.interpreter import Interpreter
        except ImportError:
            raise UserError("TFLite models need the 'tflite' extra: pip install 'mlflow-di[tflite]'") from None
        try:
            self.interpreter = Interpreter(model_path=str(path), num_threads=_threads())
        except (ValueError, RuntimeError) as exc:
            raise UserError(f"cannot load TFLite model '{path}': {str(exc).splitlines()[0]}") from None
        details = self.interpreter.get_input_details()[0]
        self.input_index = details["index"]
        self.output_index = self.interpreter.get_output_details()[0]["index"]
        self._batch = None
        if preprocessing is None:
            shape = tuple(int(v) for v in details["shape"][1:])
            preprocessing = Preprocessing(layout="NHWC", output="probabilities",
                                          input_shape=shape if len(shape) == 3 else None)
        super().__init__(preprocessing, name or pathlib.Path(path).name)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        if self._batch != len(batch):  # resizing re-plans the graph: only when the size changes
            with _native_stderr_silenced():  # planning creates the XNNPACK delegate, which logs an INFO line
                self.interpreter.resize_tensor_input(self.input_index, batch.shape)
                self.interpreter.allocate_tensors()
            self._batch = len(batch)
        self.interpreter.set_tensor(self.input_index, batch)
        self.interpreter.invoke()
        return self.interpreter.get_tensor(self.output_index).copy()
