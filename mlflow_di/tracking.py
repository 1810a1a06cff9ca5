"""Everything that talks to MLflow: runs, model logging with mlflow-di metadata, the registry.

Engines never import this module; commands call it at their edges.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib

import mlflow
from mlflow.exceptions import MlflowException

import mlflow_di
from mlflow_di.errors import UserError
from mlflow_di.models.torch_model import TorchModel

DEFAULT_EXPERIMENT = "mlflow-di"


@contextlib.contextmanager
def tracked_run(run_name: str, experiment: str | None = None, tags: dict | None = None):
    """Start an MLflow run that ends FINISHED on success, FAILED on any error and KILLED on Ctrl-C.

    Whatever the command logged before the failure stays logged: nothing is lost, and no run
    is ever left RUNNING.
    """
    resuming = os.environ.get("MLFLOW_RUN_ID")  # inside `mlflow run`: log into the run it created
    if mlflow.active_run() is None and not resuming:
        try:
            mlflow.set_experiment(experiment or DEFAULT_EXPERIMENT)
        except MlflowException as exc:
            raise UserError(f"cannot use experiment '{experiment or DEFAULT_EXPERIMENT}' at "
                            f"{mlflow.get_tracking_uri()}: {exc.message.splitlines()[0]}") from None
    run = mlflow.start_run(run_name=None if resuming else run_name,
                           tags={"mlflow_di.version": mlflow_di.__version__, **(tags or {})})
    try:
        yield run
    except KeyboardInterrupt:
        mlflow.end_run(status="KILLED")
        raise
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run(status="FINISHED")


def model_metadata(model: TorchModel, **extra) -> dict:
    """The ``mlflow_di`` metadata block stored in the MLflow model: preprocessing and facts."""
    return {"mlflow_di": {"preprocessing": model.preprocessing.to_dict(),
                          "version": mlflow_di.__version__, **model.metadata, **extra}}


def log_torch_model(model: TorchModel, name: str = "model", registered_model_name: str | None = None):
    """Log a PyTorch model with pickle serialization (white-box analysis needs module hooks,
    which MLflow's default pt2 format lacks) and its preprocessing in the model metadata."""
    import torch

    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow-di=={mlflow_di.__version__}"]
    try:
        return mlflow.pytorch.log_model(
            model.module, name=name, serialization_format="pickle", registered_model_name=registered_model_name,
            metadata=model_metadata(model), pip_requirements=requirements,
        )
    except MlflowException as exc:
        raise UserError(f"cannot log model '{name}' to {mlflow.get_tracking_uri()}: {exc.message.splitlines()[0]}") from None


def log_json(payload: dict, artifact_file: str) -> None:
    """Log a JSON artifact (kept as an artifact so the MLflow UI shows it)."""
    mlflow.log_dict(payload, artifact_file)


def write_json(payload: dict, path: str | None) -> None:
    """Write ``payload`` to ``path`` (the ``--json-out`` option), creating parent folders."""
    if not path:
        return
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, sort_keys=True))
