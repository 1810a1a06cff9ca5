"""The model formats mlflow-di opens, one entry each: what it can do and how it opens.

:data:`FORMATS` maps a format's name (what :func:`mlflow_di.models.loading.resolve` finds a
reference to be) to a :class:`ModelFormat`. ``white_box`` formats open as a PyTorch module with
named layers (coverage, IDC, inspect, generate, compress, DeepXplore); every format opens as a
black box (fuzz, robustness, gate, repair's target). ``runs_code`` formats execute code from the
file when loaded (pickle): policies and the service load them only for models they trust
(:mod:`mlflow_di.models.trust`). pt2 archives are read weights-only; one that needs more is
refused unless trusted (:func:`mlflow_di.models.trust.may_run_hidden_code`).

The openers take the local file and return the bare model (a module or a classifier); the
loader adds preprocessing, device and origin, the same for every format. A format also says how a
user's file or MLflow model is recognised as it: its file ``suffixes`` and the MLflow ``flavor`` its
logged models carry. :func:`register_format` adds one (a module and its entry, no edit elsewhere).
"""
from __future__ import annotations

import dataclasses
import pathlib
import pickle
from typing import TYPE_CHECKING, Callable

from mlflow_di.errors import UserError
from mlflow_di.models.metadata import ModelMetadata
from mlflow_di.registry import Registry

if TYPE_CHECKING:
    from mlflow_di.models.classifier import Classifier

__all__ = ["FORMATS", "ModelFormat", "format_of", "format_of_file", "load_repaired", "register_format",
           "unregister_format"]


@dataclasses.dataclass(frozen=True)
class ModelFormat:
    """One model format: how users make it, what it can do, how it opens.

    ``open_module(source)`` -> (``nn.Module``, the :class:`ModelMetadata` found in the file) for
    white-box formats; ``open_black_box(source, device)`` -> a :class:`Classifier` for formats that
    run on a runtime of their own (ONNX Runtime, LiteRT); white-box formats without one run as
    their module. ``source`` is the :class:`~mlflow_di.models.loading.ModelSource` (path, URI, ref).

    What the commands ask of a format, so that none of them names one:
    ``graph``: the file is a graph of named nodes that mlflow-di reads and rewrites as it is (ONNX):
    describe lists its nodes, compress quantizes that graph rather than a re-export, repair appends
    its head to it; its white-box view is a conversion, which an int8 export may not have.
    ``lists_operators``: a black box whose runtime lists its operators (LiteRT), shown by describe.
    ``repairable``: repair can register a repaired version (graph formats as one graph, the others
    as a pyfunc of the model and its head). ``needs_architecture``: the file holds weights only, its
    reference names the architecture as well (``keras:ARCH:FILE``).

    How it is recognised: ``suffixes``, the file names it has (lower case, e.g. ``.onnx``); ``flavor``,
    the MLflow flavor its logged models carry, with ``flavor_data`` the flavor's key naming its data
    and ``flavor_file`` the file inside that data folder (None: the data is the file). Formats that share
    a flavor (PyTorch's pickle and pt2) are told apart by their file, in the order of :data:`FORMATS`.
    """

    name: str
    title: str
    made_with: str
    white_box: bool
    runs_code: bool
    open_module: Callable | None = None
    open_black_box: Callable | None = None
    graph: bool = False
    lists_operators: bool = False
    repairable: bool = False
    needs_architecture: bool = False
    suffixes: tuple[str, ...] = ()
    flavor: str | None = None
    flavor_data: str = "data"
    flavor_file: str | None = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _open_pickle(source):
    import torch

    from mlflow_di.models.trust import check_trusted, pickle_allowed

    path, uri = source.path, source.uri
    check_trusted(source.ref.name, uri)
    try:
        with pickle_allowed():
            loaded = torch.load(path, map_location="cpu", weights_only=False)
    except (pickle.UnpicklingError, ValueError, OSError, RuntimeError, EOFError, ImportError, AttributeError) as exc:
        raise UserError(f"cannot load PyTorch model '{uri}': {_first_line(exc)} (is it a file written by "
                        "torch.save(model, path)?)") from None
    metadata = ModelMetadata()
    if isinstance(loaded, dict) and "module" in loaded:
        metadata = ModelMetadata.from_block(loaded.get("mlflow_di", {}))
        loaded = loaded["module"]
    if isinstance(loaded, dict):
        raise UserError(f"'{uri}' holds a state dict, not a model; save the whole module (torch.save(model, path)) "
                        "or log it with mlflow.pytorch.log_model(model, name=..., input_example=x)")
    return loaded, metadata


def _open_pt2(source):
    from mlflow_di.models.pt2 import load_pt2
    from mlflow_di.models.trust import hidden_code_hint, may_run_hidden_code

    name, uri = source.ref.name, source.uri
    # a graph and tensors, read weights-only: a member that would run code is refused unless trusted
    return load_pt2(source.path, uri, may_run_hidden_code(name, uri), hidden_code_hint(name, uri)), ModelMetadata()


def _open_onnx_module(source):
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.models.onnx_torch import onnx_to_torch

    module = onnx_to_torch(source.path, source.uri)  # its operators as torch layers, checked against ORT
    return module, ModelMetadata(OnnxClassifier(source.path, name=source.uri).preprocessing)  # its props or input


def _open_keras(source):
    from mlflow_di.models.keras_import import import_keras

    model = import_keras(source.ref.arch, str(source.path))
    return model.module, ModelMetadata(model.preprocessing, model.metadata)


def _open_onnx(source, device) -> Classifier:
    from mlflow_di.models.classifier import OnnxClassifier

    return OnnxClassifier(source.path, name=source.ref.display_name, device=device)


def _open_tflite(source, device) -> Classifier:
    from mlflow_di.models.classifier import TFLiteClassifier

    return TFLiteClassifier(source.path, name=source.ref.display_name)


def _open_repaired(source, device) -> Classifier:
    return load_repaired(source.path, source.metadata.to_mlflow(), source.ref.display_name, device)


#: Every model format by name, in the order an MLflow model's flavors are tried (a live registry).
FORMATS = Registry("model format", ModelFormat, builtins=(
    ModelFormat("pytorch", "PyTorch pickle",
                "mlflow.pytorch.log_model(..., serialization_format='pickle'), torch.save(model, 'm.pt')",
                white_box=True, runs_code=True, open_module=_open_pickle, suffixes=(".pt", ".pth", ".pkl"),
                flavor="pytorch", flavor_data="model_data", flavor_file="model.pth"),
    ModelFormat("pytorch-pt2", "PyTorch pt2 (torch.export)",
                "mlflow.pytorch.log_model(model, name=..., input_example=x) (MLflow's default outside Databricks)",
                white_box=True, runs_code=False, open_module=_open_pt2, flavor="pytorch", flavor_data="model_data",
                flavor_file="model.pt2"),
    ModelFormat("onnx", "ONNX", "mlflow.onnx.log_model(onnx_model, name=...), a .onnx file, mlflow-di compress",
                white_box=True, runs_code=False, open_module=_open_onnx_module, open_black_box=_open_onnx, graph=True,
                repairable=True, suffixes=(".onnx",), flavor="onnx"),
    ModelFormat("keras", "Keras HDF5 reference weights", "keras:ARCH:FILE.h5, mlflow-di import-keras",
                white_box=True, runs_code=False, open_module=_open_keras, needs_architecture=True),
    ModelFormat("tflite", "TFLite / LiteRT", "a .tflite or .lite file", white_box=False, runs_code=False,
                open_black_box=_open_tflite, lists_operators=True, repairable=True, suffixes=(".tflite", ".lite")),
    ModelFormat("repaired", "repaired model (pyfunc: compressed model + head)", "mlflow-di repair",
                white_box=False, runs_code=False, open_black_box=_open_repaired),
))


def register_format(model_format: ModelFormat) -> ModelFormat:
    """Add a model format: references to its files (by suffix) and MLflow models of its flavor open as it in
    every command, which ask it what it can do."""
    if model_format.open_module is None and model_format.open_black_box is None:
        raise UserError(f"model format {model_format.name} needs open_module or open_black_box")
    taken = {suffix: fmt.name for fmt in FORMATS.values() for suffix in fmt.suffixes if fmt.name != model_format.name}
    clash = [suffix for suffix in model_format.suffixes if suffix in taken]
    if clash:
        raise UserError(f"model format {model_format.name}: {clash[0]} files are {taken[clash[0]]} models already")
    return FORMATS.register(model_format)


def unregister_format(name: str) -> None:
    """Forget a registered format (tests add toy ones); the built-ins stay."""
    FORMATS.unregister(name)


def format_of(name: str) -> ModelFormat:
    """The :class:`ModelFormat` called ``name``."""
    return FORMATS[name]


def format_of_file(path: pathlib.Path) -> ModelFormat | None:
    """The format whose ``suffixes`` include ``path``'s (None: no format claims it)."""
    suffix = pathlib.Path(path).suffix.lower()
    return next((fmt for fmt in FORMATS.values() if suffix in fmt.suffixes), None)


def file_suffixes() -> list[str]:
    """Every suffix a model file may have, in the formats' order."""
    return [suffix for fmt in FORMATS.values() for suffix in fmt.suffixes]


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
    from mlflow_di.models.classifier import OnnxClassifier, TFLiteClassifier

    base_path = folder / relative
    if base_path.suffix == ".onnx":
        base = OnnxClassifier(base_path, block.preprocessing, name=base_path.name, device=device)
    else:
        base = TFLiteClassifier(base_path, block.preprocessing, name=base_path.name)
    return RepairedClassifier(base, ProbabilityHead.load(folder / "head.npz"), name=name)
