"""Models in the tracking store: fetch one to a local folder, log PyTorch and ONNX models.

Logged models carry the ``mlflow_di`` metadata block (:mod:`mlflow_di.models.metadata`), so a
later ``models:/`` load knows the preprocessing without being told.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import re
import sys
import warnings

import mlflow

import mlflow_di
from mlflow_di.errors import UserError
from mlflow_di.mlflow_edge.connection import mlflow_errors, store_hint
from mlflow_di.models.metadata import ModelMetadata


@dataclasses.dataclass
class DownloadedModel:
    """An MLflow model fetched to local disk: the file mlflow-di loads, its kind and metadata.

    ``input_shape``/``input_dtype``/``input_example``: the signature's first tensor input and the
    logged input example, when there are (what :mod:`mlflow_di.models.signature` reads
    preprocessing from); ``recorded``: preprocessing recorded on the registry version by
    ``describe --set-preprocessing`` (JSON), when there is.
    """

    kind: str  # "pytorch", "pytorch-pt2", "onnx" or "repaired" (a folder: base model + repair head)
    path: pathlib.Path
    metadata: dict
    input_shape: tuple | None = None
    input_dtype: str | None = None
    input_example: object = None
    recorded: str | None = None


def download_model(uri: str) -> DownloadedModel:
    """Fetch the MLflow model ``uri`` (registry, run, artifact URI or local model folder)."""
    from mlflow.models import Model

    what = f"cannot load model '{uri}' from the tracking store"
    try:
        with mlflow_errors(what):
            local = pathlib.Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
            model = Model.load(str(local))
    except UserError as exc:
        raise UserError(f"{exc} ({store_hint()})") from None
    except OSError as exc:
        raise UserError(f"cannot load model '{uri}': {exc}") from None
    found = _model_file(uri, local, model)
    found.input_shape, found.input_dtype = _signature_input(model)
    found.input_example = _input_example(model, local)
    if found.input_shape is None and found.input_example is not None:  # mlflow.onnx logs no signature
        found.input_shape = (-1, *found.input_example.shape[1:])
        found.input_dtype = str(found.input_example.dtype)
    found.recorded = recorded_preprocessing(uri)
    return found


def _inside(uri: str, local: pathlib.Path, relative) -> pathlib.Path:
    """``local / relative``, or a one-line UserError when the MLmodel file points outside the model's folder."""
    path = (local / str(relative)).resolve()
    if not path.is_relative_to(local.resolve()):
        raise UserError(f"model '{uri}': its MLmodel file names '{relative}' as its data, which is outside the model's "
                        "folder; refusing to load it (log the model again with mlflow.pytorch or mlflow.onnx)")
    return path


def _model_file(uri: str, local: pathlib.Path, model) -> DownloadedModel:
    """The model file of the first format (in :data:`~mlflow_di.models.formats.FORMATS`' order) whose MLflow
    flavor the model carries and whose file is there; a pyfunc that mlflow-di repair logged is the repaired format."""
    from mlflow_di.models.formats import FORMATS

    flavors, metadata = model.flavors, model.metadata or {}
    expected = []
    for fmt in (fmt for fmt in FORMATS.values() if fmt.flavor in flavors):
        data = _inside(uri, local, flavors[fmt.flavor].get(fmt.flavor_data, "data"))
        path = data / fmt.flavor_file if fmt.flavor_file else data
        if path.exists():
            return DownloadedModel(fmt.name, path, metadata)
        expected.append(path.name)
    if expected:
        raise UserError(f"model '{uri}' names its data as {' or '.join(expected)}, which is not in the model's folder; "
                        "log the model again")
    if "python_function" in flavors and REPAIRED_BASE in (metadata.get("mlflow_di") or {}):
        return DownloadedModel("repaired", local / "artifacts", metadata)
    readable = sorted({fmt.flavor for fmt in FORMATS.values() if fmt.flavor})
    raise UserError(f"model '{uri}' has flavors {sorted(flavors)}; mlflow-di reads the {' and '.join(readable)} "
                    "flavors (log the model with mlflow.pytorch or mlflow.onnx)")


def _signature_input(model) -> tuple[tuple | None, str | None]:
    """The shape and dtype name of the signature's first tensor input; (None, None) without one."""
    signature = model.signature
    if signature is None or signature.inputs is None or not signature.inputs.is_tensor_spec():
        return None, None
    spec = signature.inputs.inputs[0]
    return tuple(int(value) for value in spec.shape), str(spec.type)


def _input_example(model, local: pathlib.Path):
    """The logged input example as an array, or None (none logged, or not a tensor)."""
    import numpy as np

    try:
        example = model.load_input_example(str(local))
    except Exception:  # noqa: BLE001 - a missing or unreadable example only means no value range
        return None
    if isinstance(example, dict) and len(example) == 1:
        example = next(iter(example.values()))
    return example if isinstance(example, np.ndarray) else None


#: Registry version tag holding preprocessing recorded by ``describe --set-preprocessing`` (JSON).
RECORDED_PREPROCESSING = "mlflow_di.preprocessing"


def recorded_preprocessing(uri: str) -> str | None:
    """The preprocessing recorded on the registry version ``uri`` names (JSON), or None."""
    from mlflow_di.mlflow_edge.registry import registry_ref, resolve_version

    if registry_ref(uri) is None:
        return None
    return (resolve_version(uri).tags or {}).get(RECORDED_PREPROCESSING)


def record_preprocessing(uri: str, preprocessing) -> str:
    """Record ``preprocessing`` on the registry version ``uri`` names; returns ``NAME/VERSION``."""
    from mlflow_di.mlflow_edge.registry import registry_ref, resolve_version, write_version_tags

    if registry_ref(uri) is None:
        raise UserError(f"'{uri}' is not a registry version; preprocessing is recorded on registered versions "
                        "(models:/NAME/VERSION or models:/NAME@ALIAS); for other models pass --preprocessing")
    version = resolve_version(uri)
    write_version_tags(version, {RECORDED_PREPROCESSING: preprocessing.to_json()})
    return f"{version.name}/{version.version}"


def log_torch_model(model, name: str = "model", registered_model_name: str | None = None,
                    serialization_format: str = "pt2"):
    """Log a :class:`~mlflow_di.models.torch_model.TorchModel` with its ``mlflow_di`` metadata block.

    pt2 (MLflow's own default, torch.export) by default: mlflow-di reads it weights-only, so policies
    and the service need no trust for it, and mlflow-di rebuilds its layers (:mod:`mlflow_di.models.pt2`).
    The export traces the model on two images of its input shape; a model without a known input
    shape, or ``serialization_format="pickle"``, is pickled.
    """
    import torch

    metadata = ModelMetadata(model.preprocessing, {"version": mlflow_di.__version__, **model.metadata})
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow-di=={mlflow_di.__version__}"]
    shape = model.preprocessing.input_shape
    if shape is None:
        serialization_format = "pickle"
    example = None
    if serialization_format == "pt2":
        import numpy as np

        example = model.to_tensor(np.zeros((2, *shape), np.uint8)).numpy()  # what the model takes, 2 images
    module = model.module
    if example is not None and model.device.type != "cpu":  # the export traces on the CPU example
        import copy

        module = copy.deepcopy(module).cpu()
    with mlflow_errors(f"cannot log model '{name}'"), _quiet_registration():
        return mlflow.pytorch.log_model(
            module, name=name, serialization_format=serialization_format,
            registered_model_name=registered_model_name, metadata=metadata.to_mlflow(),
            pip_requirements=requirements, input_example=example)


def log_onnx_model(path, preprocessing, lineage: dict):
    """Log (not yet register: see :func:`register_logged_model`) an ONNX file with its preprocessing
    and ``lineage`` (``mlflow_di.*`` tags) in the active run."""
    import onnx

    facts = {key.removeprefix("mlflow_di."): value for key, value in lineage.items()}
    metadata = ModelMetadata(preprocessing, facts)
    with mlflow_errors(f"cannot log the model '{pathlib.Path(path).name}'"):
        return mlflow.onnx.log_model(onnx.load(str(path)), name="model", metadata=metadata.to_mlflow(), tags=lineage,
                                     pip_requirements=["onnx", "onnxruntime"], save_as_external_data=False)


def register_logged_model(info, registered_model_name: str, lineage: dict):
    """Register the logged model ``info`` as a new version of ``registered_model_name``, its
    ``lineage`` tags created with it. The commands call this last, once the model's figures are
    logged: a command stopped before leaves a logged model and no registered version, never a
    version without its figures. Returns the ModelVersion."""
    with mlflow_errors(f"cannot register '{registered_model_name}'"), _quiet_registration():
        return mlflow.register_model(info.model_uri, registered_model_name, tags=lineage)


#: Metadata fact of a repaired pyfunc model: the file name of its base (compressed) model in artifacts/.
REPAIRED_BASE = "repaired_base"
REPAIR_HEAD = "head.npz"


# MLflow warns, when the class is defined, that predict() has no type hints: its input is raw images
# of any shape, which its type-hint validation cannot describe. (Its own filter shows that warning
# "once" whatever filter is set outside, so the warning is recorded here and dropped.)
with warnings.catch_warnings(record=True):

    class RepairedPyfunc(mlflow.pyfunc.PythonModel):
        """A compressed model (TFLite or another single-file backend) followed by a repair head, as an
        MLflow pyfunc: ``predict`` takes raw uint8 NHWC images and returns repaired probabilities."""

        def load_context(self, context):
            from mlflow_di.models.formats import load_repaired

            self.classifier = load_repaired(pathlib.Path(context.artifacts["head"]).parent, self.metadata)

        def __init__(self, metadata: dict):
            self.metadata = metadata

        def predict(self, context, model_input, params=None):
            import numpy as np

            return self.classifier.predict_proba(np.asarray(model_input, np.uint8))


def log_repaired_pyfunc(base_path, head, preprocessing, lineage: dict):
    """Log (not yet register: see :func:`register_logged_model`) a non-ONNX compressed model plus its
    repair head as a pyfunc (see :class:`RepairedPyfunc`)."""
    import tempfile

    base_path = pathlib.Path(base_path)
    facts = {key.removeprefix("mlflow_di."): value for key, value in lineage.items()}
    facts[REPAIRED_BASE] = base_path.name
    metadata = ModelMetadata(preprocessing, facts).to_mlflow()
    with tempfile.TemporaryDirectory(prefix="mlflow-di-repair-") as scratch:
        head_path = pathlib.Path(scratch) / REPAIR_HEAD
        head.save(head_path)
        with mlflow_errors(f"cannot log the repaired model of '{base_path.name}'"):
            return mlflow.pyfunc.log_model(
                name="model", python_model=RepairedPyfunc(metadata),
                artifacts={"base": str(base_path), "head": str(head_path)}, metadata=metadata, tags=lineage,
                pip_requirements=[f"mlflow-di=={mlflow_di.__version__}", "ai-edge-litert"])


def download_campaign(run_id: str) -> pathlib.Path:
    """The campaign folder a ``fuzz`` run logged (its ``fuzz/campaign`` artifacts), fetched to local disk."""
    with mlflow_errors(f"cannot fetch the campaign of run '{run_id}'"):
        return pathlib.Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="fuzz/campaign"))


@contextlib.contextmanager
def _quiet_registration():
    """MLflow prints "Successfully registered model ...", "Created version ..." (and "... already
    exists") to stderr itself; the commands say what they registered in their own words, so those
    lines are held back and anything else written meanwhile is passed on."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True) if not _REGISTRATION_CHATTER.match(line)]
        sys.stderr.write("".join(kept))


_REGISTRATION_CHATTER = re.compile(r"^(Successfully registered model|Created version|Registered model .* already exists)")
