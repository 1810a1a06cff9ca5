"""One loader for every model reference a user can give.

Accepted references:

* MLflow URIs: ``models:/NAME/VERSION``, ``models:/NAME@ALIAS``, ``runs:/RUN_ID/PATH``, or a
  local MLflow model directory (one with an ``MLmodel`` file). PyTorch and ONNX flavors.
* Files: ``.onnx`` (ONNX Runtime), ``.tflite`` / ``.lite`` (ai-edge-litert), ``.pt`` / ``.pth`` /
  ``.pkl`` (a pickled ``nn.Module``, or a dict ``{"module": ..., "mlflow_di": {...}}``).
* ``keras:ARCH:FILE``: a Keras HDF5 reference model ported to PyTorch on the fly
  (see :mod:`mlflow_di.models.keras_import`).

The preprocessing travels with the model (MLflow metadata ``mlflow_di.preprocessing``, ONNX
metadata ``mlflow_di.preprocessing``) and ``preprocessing`` overrides it field by field
(``"scale=1,layout=NHWC"``).

Pickled PyTorch models run code when loaded: mlflow-di loads them (MLflow refuses by default,
see ``MLFLOW_ALLOW_PICKLE_DESERIALIZATION``) because white-box analysis needs the real module.
Only point it at models you trust, as with any pickle.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib

from mlflow_di.errors import UserError
from mlflow_di.models.classifier import Classifier, OnnxClassifier, TFLiteClassifier
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel

TORCH_SUFFIXES = (".pt", ".pth", ".pkl")
TFLITE_SUFFIXES = (".tflite", ".lite")
URI_HELP = ("models:/NAME/VERSION, models:/NAME@ALIAS, runs:/RUN_ID/PATH, an MLflow model folder, "
            "a .onnx/.tflite/.lite/.pt file or keras:ARCH:FILE.h5")


@dataclasses.dataclass
class ModelSource:
    """Where a model came from and what it is, before any framework loads it."""

    uri: str
    kind: str  # "pytorch", "pytorch-pt2", "onnx", "tflite", "keras"
    path: pathlib.Path
    metadata: dict = dataclasses.field(default_factory=dict)  # the mlflow_di metadata block

    @property
    def preprocessing(self) -> Preprocessing | None:
        stored = self.metadata.get("preprocessing")
        return Preprocessing.from_dict(stored) if stored else None


def is_mlflow_uri(uri: str) -> bool:
    return uri.startswith(("models:/", "runs:/", "mlflow-artifacts:/")) or (
        pathlib.Path(uri).is_dir() and (pathlib.Path(uri) / "MLmodel").exists()
    )


def resolve(uri: str) -> ModelSource:
    """Find out what ``uri`` points to, downloading MLflow artifacts when needed."""
    if not isinstance(uri, str) or not uri.strip():
        raise UserError(f"no model given; pass one of: {URI_HELP}")
    uri = uri.strip()
    if uri.startswith("keras:"):
        _, arch, file = (uri.split(":", 2) + ["", ""])[:3]
        if not arch or not file:
            raise UserError(f"bad keras reference '{uri}'; write keras:ARCH:FILE.h5, e.g. keras:lenet5:LeNet5.h5")
        return ModelSource(uri, "keras", _existing_file(file), {"arch": arch})
    if is_mlflow_uri(uri):
        return _resolve_mlflow(uri)
    path = _existing_file(uri)
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return ModelSource(uri, "onnx", path)
    if suffix in TFLITE_SUFFIXES:
        return ModelSource(uri, "tflite", path)
    if suffix in TORCH_SUFFIXES:
        return ModelSource(uri, "pytorch", path)
    raise UserError(f"cannot tell what kind of model '{uri}' is from its suffix; give {URI_HELP}")


def _existing_file(path: str) -> pathlib.Path:
    resolved = pathlib.Path(path).expanduser()
    if not resolved.exists():
        raise UserError(f"model file '{path}' does not exist; give {URI_HELP}")
    return resolved


def _resolve_mlflow(uri: str) -> ModelSource:
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    try:
        local = pathlib.Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
        model = Model.load(str(local))
    except MlflowException as exc:
        raise UserError(
            f"cannot load model '{uri}' from the tracking store {mlflow.get_tracking_uri()}: "
            f"{_first_line(exc.message)} (check the name/version, or pass --tracking-uri)"
        ) from None
    except OSError as exc:
        raise UserError(f"cannot load model '{uri}': {exc}") from None
    metadata = (model.metadata or {}).get("mlflow_di", {})
    flavors = model.flavors
    if "pytorch" in flavors:
        data = local / flavors["pytorch"].get("model_data", "data")
        if (data / "model.pth").exists():
            return ModelSource(uri, "pytorch", data / "model.pth", metadata)
        return ModelSource(uri, "pytorch-pt2", data / "model.pt2", metadata)
    if "onnx" in flavors:
        return ModelSource(uri, "onnx", local / flavors["onnx"]["data"], metadata)
    raise UserError(
        f"model '{uri}' has flavors {sorted(flavors)}; mlflow-di reads the pytorch and onnx flavors "
        "(log the model with mlflow.pytorch or mlflow.onnx)"
    )


def _first_line(text: str) -> str:
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


def _load_torch_module(source: ModelSource):
    import torch

    try:
        with _pickle_allowed():
            loaded = torch.load(source.path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ModuleNotFoundError, AttributeError) as exc:
        raise UserError(f"cannot load PyTorch model '{source.uri}': {_first_line(exc)}") from None
    if isinstance(loaded, dict) and "module" in loaded:
        source.metadata = {**loaded.get("mlflow_di", {}), **source.metadata}
        loaded = loaded["module"]
    if isinstance(loaded, dict):
        raise UserError(
            f"'{source.uri}' holds a state dict, not a model; save the whole module "
            "(torch.save(model, path)) or log it with mlflow.pytorch.log_model(..., serialization_format='pickle')"
        )
    return loaded


def load_torch_model(uri: str, preprocessing: str | Preprocessing | None = None) -> TorchModel:
    """A white-box :class:`TorchModel` for ``uri`` (PyTorch and Keras references only)."""
    source = resolve(uri)
    if source.kind == "pytorch-pt2":
        raise UserError(
            f"'{uri}' was logged in MLflow's pt2 (torch.export) format, which has no module hooks; "
            "re-log it with mlflow.pytorch.log_model(model, name=..., serialization_format='pickle')"
        )
    if source.kind == "keras":
        from mlflow_di.models.keras_import import import_keras

        model = import_keras(source.metadata["arch"], str(source.path))
        model.preprocessing = _with_override(model.preprocessing, preprocessing)
        return model
    if source.kind != "pytorch":
        raise UserError(
            f"'{uri}' is a {source.kind} model; white-box analysis (coverage, pruning) needs a PyTorch model"
        )
    module = _load_torch_module(source)
    base = source.preprocessing or Preprocessing()
    return TorchModel(module, _with_override(base, preprocessing), name=_display_name(uri), metadata=source.metadata)


def load_classifier(uri: str, preprocessing: str | Preprocessing | None = None) -> Classifier:
    """A black-box :class:`Classifier` for ``uri``, whatever the backend."""
    source = resolve(uri)
    if source.kind in ("pytorch", "keras"):
        return load_torch_model(uri, preprocessing).classifier()
    if source.kind == "pytorch-pt2":
        return _pt2_classifier(source, preprocessing)
    if source.kind == "onnx":
        classifier = OnnxClassifier(source.path, name=_display_name(uri))
    else:
        classifier = TFLiteClassifier(source.path, name=_display_name(uri))
    base = source.preprocessing or classifier.preprocessing
    classifier.preprocessing = _with_override(base, preprocessing)
    return classifier


def _pt2_classifier(source: ModelSource, preprocessing) -> Classifier:
    import torch

    from mlflow_di.models.classifier import TorchClassifier

    program = torch.export.load(str(source.path)).module()
    base = source.preprocessing or Preprocessing()
    return TorchClassifier(program, _with_override(base, preprocessing), _display_name(source.uri))


def _with_override(base: Preprocessing, override: str | Preprocessing | None) -> Preprocessing:
    if override is None or override == "":
        return base
    if isinstance(override, Preprocessing):
        return override
    return base.override(override)


def _display_name(uri: str) -> str:
    return uri if is_mlflow_uri(uri) else pathlib.Path(uri).name
