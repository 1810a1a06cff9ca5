"""One loader for every model reference a user can give.

The accepted references are parsed by :class:`~mlflow_di.models.reference.ModelRef`; MLflow ones
are fetched through :mod:`mlflow_di.mlflow_edge.models`. What each format can do and how it opens
is its entry in :data:`mlflow_di.models.formats.FORMATS`; this module resolves a reference once,
finds its preprocessing, opens it through its format and adds preprocessing, device and origin.

Preprocessing, first found wins: the ``preprocessing`` argument (a command's option, or a pipeline
policy's ``preprocessing:`` section), the preprocessing recorded on the registry version
(``describe --set-preprocessing``), the model's ``mlflow_di`` metadata block, MLflow's signature
and input example (:mod:`mlflow_di.models.signature`), the format's own default. The argument
overrides field by field (``"scale=1,layout=NHWC"``).

Pickled PyTorch models run code when loaded: work that loads models no person chose runs inside
:func:`~mlflow_di.models.trust.only_trusted_pickles` (re-exported here).
"""
from __future__ import annotations

import dataclasses
import pathlib

from mlflow_di.errors import UserError
from mlflow_di.models.classifier import Classifier
from mlflow_di.models.formats import FORMATS, ModelFormat, load_repaired
from mlflow_di.models.metadata import ModelMetadata
from mlflow_di.models.origin import origin_of
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.reference import ModelRef, RefKind
from mlflow_di.models.runtimes import RuntimeChoice
from mlflow_di.models.torch_model import TorchModel
from mlflow_di.models.trust import only_trusted_pickles

__all__ = ["WHITE_BOX_KINDS", "ModelSource", "load_classifier", "load_repaired", "load_torch_model",
           "only_trusted_pickles", "resolve"]


#: Formats whose models open white-box (a PyTorch module with named layers).
WHITE_BOX_KINDS = tuple(name for name, fmt in FORMATS.items() if fmt.white_box)


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
    def format(self) -> ModelFormat:
        """What this kind of model can do (:class:`~mlflow_di.models.formats.ModelFormat`): ask it, not the kind."""
        return FORMATS[self.kind]

    @property
    def white_box(self) -> bool:
        """Whether the model opens as a PyTorch module with named layers (coverage, pruning, DeepXplore)."""
        return self.format.white_box


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
    return ModelSource(ref, ref.format, ref.path)


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


def load_torch_model(uri: str | ModelSource, preprocessing: str | Preprocessing | None = None, device=None) -> TorchModel:
    """A white-box :class:`TorchModel` for ``uri``: any format whose entry in ``FORMATS`` is ``white_box``
    (PyTorch pt2 or pickle, ONNX, Keras); others are a one-line :class:`UserError` naming what works.

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
    fmt = source.format
    if not fmt.white_box:
        raise UserError(
            f"'{source.uri}' is a {source.kind} model ({fmt.title}), which opens only as a black box; white-box work "
            "(coverage, inspect, generate, compress, deepxplore) needs a PyTorch (pt2 or pickle), ONNX or Keras "
            "original, such as the model it was made from; fuzz, robustness and gate work on it as it is"
        )
    module, found = fmt.open_module(source)
    source.metadata = found.merged(source.metadata)  # what resolve found beats what the file itself says
    return TorchModel(module, _effective(source, Preprocessing(), preprocessing), name=source.ref.display_name,
                      metadata=source.metadata.facts)


def load_classifier(uri: str, preprocessing: str | Preprocessing | None = None, device=None,
                    runtime: str | RuntimeChoice | None = None) -> Classifier:
    """A black-box :class:`Classifier` for ``uri``, whatever the backend, on ``device`` (see
    :func:`load_torch_model`; ONNX models choose their execution provider from it, TFLite runs on the CPU).
    ``runtime`` (``NAME[:PRECISION]``, :mod:`mlflow_di.models.runtimes`; None: the format's own) runs the file
    instead; a format the runtime does not open is a one-line refusal."""
    source = resolve(uri)
    choice = None if runtime is None else RuntimeChoice.parse(runtime)
    classifier = _load_classifier(source, preprocessing, device, choice)
    classifier.origin = origin_of(source, device, None if choice is None else choice.label)  # for a Ray worker
    return classifier


def _load_classifier(source: ModelSource, preprocessing, device, runtime: RuntimeChoice | None = None) -> Classifier:
    fmt = source.format
    if runtime is not None:
        classifier = runtime.open(source.path, None, source.ref.display_name, device, fmt.name)
    elif fmt.open_black_box is None:  # a PyTorch module: it runs as itself
        return load_torch_model(source, preprocessing, device).classifier()
    else:
        classifier = fmt.open_black_box(source, device)
    classifier.preprocessing = _effective(source, classifier.preprocessing, preprocessing)
    return classifier


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
