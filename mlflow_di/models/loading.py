"""One loader for every model reference a user can give.

The accepted references are parsed by :class:`~mlflow_di.models.reference.ModelRef`; MLflow
ones (PyTorch and ONNX flavors) are fetched through :mod:`mlflow_di.mlflow_edge.models`. A
pickled PyTorch file holds an ``nn.Module`` or ``{"module": ..., "mlflow_di": {...}}``.

The preprocessing travels with the model (:mod:`mlflow_di.models.metadata`) and
``preprocessing`` overrides it field by field (``"scale=1,layout=NHWC"``).

Pickled PyTorch models run code when loaded: mlflow-di loads them (MLflow refuses by default,
see ``MLFLOW_ALLOW_PICKLE_DESERIALIZATION``) because white-box analysis needs the real module.
Only point it at models you trust, as with any pickle. Work that loads models no person chose
one by one (a pipeline policy, the service) runs inside :func:`only_trusted_pickles`: a pickle is
then loaded only when its registered model is named there; ONNX, TFLite and Keras weights load as usual.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import pathlib
import pickle

from mlflow_di.errors import UserError
from mlflow_di.models.classifier import Classifier, OnnxClassifier, TFLiteClassifier
from mlflow_di.models.metadata import ModelMetadata
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.reference import URI_HELP, ModelRef, RefKind
from mlflow_di.models.shipping import origin_of
from mlflow_di.models.torch_model import TorchModel

__all__ = ["URI_HELP", "WHITE_BOX_KINDS", "ModelSource", "load_classifier", "load_repaired", "load_torch_model", "only_trusted_pickles",
           "resolve"]


#: Formats whose models open white-box (a PyTorch module with named layers).
WHITE_BOX_KINDS = ("pytorch", "pytorch-pt2", "keras", "onnx")


@dataclasses.dataclass
class ModelSource:
    """Where a model came from and what it is, before any framework loads it.

    ``preprocessing_from`` says where :attr:`preprocessing` was found: ``recorded`` (on the registry
    version, by ``describe --set-preprocessing``), ``metadata`` (the ``mlflow_di`` block),
    ``signature`` (MLflow's signature and input example) or None (nowhere: the model's own default).
    ``problem``: why the preprocessing found cannot be used as it is (one line naming the fix);
    ``assumed``: what was assumed to find it.
    """

    ref: ModelRef
    kind: str  # "pytorch", "pytorch-pt2", "onnx", "tflite", "keras", "repaired"
    path: pathlib.Path
    metadata: ModelMetadata = dataclasses.field(default_factory=ModelMetadata)
    preprocessing_from: str | None = None
    problem: str | None = None
    assumed: str | None = None

    @property
    def uri(self) -> str:
        return self.ref.uri

    @property
    def preprocessing(self) -> Preprocessing | None:
        return self.metadata.preprocessing

    @property
    def white_box(self) -> bool:
        """Whether the model opens as a PyTorch module with named layers (coverage, pruning, DeepXplore)."""
        return self.kind in WHITE_BOX_KINDS


_FILE_KINDS = {RefKind.ONNX: "onnx", RefKind.TFLITE: "tflite", RefKind.TORCH: "pytorch", RefKind.KERAS: "keras"}


def resolve(uri: str | ModelRef | ModelSource) -> ModelSource:
    """Find out what ``uri`` points to, downloading MLflow artifacts when needed (a source is returned as it is)."""
    if isinstance(uri, ModelSource):
        return uri
    ref = ModelRef.parse(uri)
    if ref.is_mlflow:
        from mlflow_di.mlflow_edge.models import download_model

        local = download_model(ref.uri)
        return _with_preprocessing(ModelSource(ref, local.kind, local.path, ModelMetadata.from_mlflow(local.metadata)),
                                   local)
    return ModelSource(ref, _FILE_KINDS[ref.kind], ref.path)


def _with_preprocessing(source: ModelSource, local) -> ModelSource:
    """Fill in where the preprocessing comes from, in order: recorded on the version, the model's
    ``mlflow_di`` block, MLflow's signature and input example (an option, given later, beats all)."""
    from mlflow_di.models.signature import from_signature

    if local.recorded:
        try:
            recorded = Preprocessing.from_json(local.recorded)
        except (ValueError, TypeError, UserError) as exc:
            raise UserError(f"the preprocessing recorded on '{source.uri}' is unreadable ({_first_line(exc)}); record "
                            f"it again with mlflow-di describe {source.uri} --set-preprocessing ...") from None
        source.metadata = ModelMetadata(recorded, source.metadata.facts)
        source.preprocessing_from = "recorded"
    elif source.preprocessing is not None:
        source.preprocessing_from = "metadata"
    else:
        inferred = from_signature(local.input_shape, local.input_dtype, local.input_example, _record_hint(source.ref))
        if inferred is not None:
            source.metadata = ModelMetadata(inferred.preprocessing, source.metadata.facts)
            source.preprocessing_from, source.problem, source.assumed = "signature", inferred.problem, inferred.assumed
    return source


def _record_hint(ref: ModelRef) -> str:
    example = "mean=0.1307,std=0.3081"
    if ref.kind is RefKind.REGISTRY:
        return (f"record the missing fields once with: mlflow-di describe {ref.uri} --set-preprocessing {example} "
                "(or pass --preprocessing to each command)")
    return (f"pass --preprocessing {example} (the normalisation your model was trained with), or log the model with "
            "metadata={'mlflow_di': {'preprocessing': {...}}}")


def _first_line(text) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else "unknown error"


@contextlib.contextmanager
def _pickle_allowed():
    """MLflow refuses pickled models unless this is set; mlflow-di needs the real module."""
    previous = os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION")
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", None)
        else:
            os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = previous


#: (registered model names or exact URIs whose pickles may load, who said so); None: any pickle
#: loads (a person named the model on the command line).
_TRUSTED_PICKLES: contextvars.ContextVar[tuple[frozenset, str] | None] = contextvars.ContextVar(
    "trusted_pickles", default=None)


@contextlib.contextmanager
def only_trusted_pickles(names, where: str = "the policy"):
    """Within this block a pickled PyTorch model loads only when its registered model name (or its
    URI) is in ``names``; any other pickle is a one-line :class:`UserError` saying ``where`` to list it."""
    token = _TRUSTED_PICKLES.set((frozenset(names), where))
    try:
        yield
    finally:
        _TRUSTED_PICKLES.reset(token)


def _check_trusted(source: ModelSource) -> None:
    trust = _TRUSTED_PICKLES.get()
    if trust is None or source.ref.name in trust[0] or source.uri in trust[0]:
        return
    name = source.ref.name or source.uri
    raise UserError(f"'{source.uri}' is a pickled PyTorch model and loading it runs its code; {trust[1]} does not "
                    f"trust it: add '{name}' to trust.pickled_models if you trust its authors (ONNX and TFLite "
                    "models need no trust)")


def _load_torch_module(source: ModelSource):
    import torch

    _check_trusted(source)

    try:
        with _pickle_allowed():
            loaded = torch.load(source.path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, ValueError, OSError, RuntimeError, EOFError, ImportError, AttributeError) as exc:
        raise UserError(f"cannot load PyTorch model '{source.uri}': {_first_line(exc)} (is it a file written by "
                        "torch.save(model, path)?)") from None
    if isinstance(loaded, dict) and "module" in loaded:
        source.metadata = ModelMetadata.from_block(loaded.get("mlflow_di", {})).merged(source.metadata)
        loaded = loaded["module"]
    if isinstance(loaded, dict):
        raise UserError(
            f"'{source.uri}' holds a state dict, not a model; save the whole module "
            "(torch.save(model, path)) or log it with mlflow.pytorch.log_model(..., serialization_format='pickle')"
        )
    return loaded


def load_torch_model(uri: str | ModelSource, preprocessing: str | Preprocessing | None = None, device=None) -> TorchModel:
    """A white-box :class:`TorchModel` for ``uri`` (PyTorch and Keras references only).

    ``device`` (``auto``, ``cpu``, ``cuda[:N]`` or a ``torch.device``; None keeps the CPU) is where
    the module is moved; every engine then runs its batches there.
    """
    source = resolve(uri)
    model = _load_torch_model(source, preprocessing)
    if device is not None:
        from mlflow_di.models.device import resolve_device

        model.to(resolve_device(device))
    model.origin = origin_of(source, device)  # how a Ray worker loads the same model (models.shipping)
    return model


def _load_torch_model(source: ModelSource, preprocessing) -> TorchModel:
    uri = source.uri
    if source.kind == "keras":
        from mlflow_di.models.keras_import import import_keras

        model = import_keras(source.ref.arch, str(source.path))
        model.preprocessing = _with_override(model.preprocessing, preprocessing)
        return model
    fallback = Preprocessing()
    if source.kind == "pytorch-pt2":
        from mlflow_di.models.pt2 import load_pt2

        module = load_pt2(source.path, uri)  # a graph, not a pickle: it runs no code when loaded
    elif source.kind == "onnx":
        from mlflow_di.models.onnx_torch import onnx_to_torch

        module = onnx_to_torch(source.path, uri)  # its graph's operators as torch layers, checked against ORT
        fallback = OnnxClassifier(source.path, name=source.ref.display_name).preprocessing  # its props or input
    elif source.kind == "pytorch":
        module = _load_torch_module(source)  # may read the preprocessing stored beside the module
    else:
        raise UserError(
            f"'{uri}' is a {source.kind} model, which opens only as a black box; white-box work (coverage, inspect, "
            "generate, compress, deepxplore) needs a PyTorch (pt2 or pickle), ONNX or Keras original, such as the "
            "model it was made from; fuzz, robustness and gate work on it as it is"
        )
    return TorchModel(module, _effective(source, fallback, preprocessing), name=source.ref.display_name,
                      metadata=source.metadata.facts)


def load_classifier(uri: str, preprocessing: str | Preprocessing | None = None, device=None) -> Classifier:
    """A black-box :class:`Classifier` for ``uri``, whatever the backend, on ``device`` (see
    :func:`load_torch_model`; ONNX models choose their execution provider from it, TFLite runs on the CPU)."""
    source = resolve(uri)
    classifier = _load_classifier(source, preprocessing, device)
    classifier.origin = origin_of(source, device)  # how a Ray worker loads the same model (models.shipping)
    return classifier


def _load_classifier(source: ModelSource, preprocessing, device) -> Classifier:
    if source.kind in ("pytorch", "pytorch-pt2", "keras"):
        return load_torch_model(source, preprocessing, device).classifier()
    if source.kind == "repaired":
        classifier = load_repaired(source.path, source.metadata.to_mlflow(), source.ref.display_name, device)
    elif source.kind == "onnx":
        classifier = OnnxClassifier(source.path, name=source.ref.display_name, device=device)
    else:
        classifier = TFLiteClassifier(source.path, name=source.ref.display_name)
    classifier.preprocessing = _effective(source, classifier.preprocessing, preprocessing)
    return classifier


def load_repaired(folder, metadata: dict, name: str | None = None, device=None) -> Classifier:
    """A repaired pyfunc model's classifier: its base model file and ``head.npz`` in ``folder``,
    ``metadata`` its MLflow metadata (the ``mlflow_di`` block names the base file)."""
    from mlflow_di.models.head import ProbabilityHead, RepairedClassifier

    folder = pathlib.Path(folder)
    block = ModelMetadata.from_mlflow(metadata)
    named = str(block.facts.get("repaired_base", ""))
    relative = pathlib.PurePosixPath(named.replace("\\", "/"))
    if not named or relative.is_absolute() or pathlib.PureWindowsPath(named).drive or ".." in relative.parts:
        raise UserError(f"the repaired model's metadata names its base file '{named}', which is not a path inside "
                        "the model folder; refusing to load it")
    base_path = folder / relative
    if base_path.suffix == ".onnx":
        base = OnnxClassifier(base_path, block.preprocessing, name=base_path.name, device=device)
    else:
        base = TFLiteClassifier(base_path, block.preprocessing, name=base_path.name)
    return RepairedClassifier(base, ProbabilityHead.load(folder / "head.npz"), name=name)


def _effective(source: ModelSource, fallback: Preprocessing, override) -> Preprocessing:
    """The model's preprocessing (``fallback`` when it has none) with ``override`` applied; the
    source's problem, when nothing overrides the preprocessing it found, as a one-line error."""
    if source.problem and (override is None or override == ""):
        raise UserError(f"cannot tell the preprocessing of '{source.uri}': {source.problem}")
    return _with_override(source.preprocessing or fallback, override)


def _with_override(base: Preprocessing, override: str | Preprocessing | None) -> Preprocessing:
    if override is None or override == "":
        return base
    if isinstance(override, Preprocessing):
        return override
    return base.override(override)
