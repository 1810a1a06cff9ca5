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


#: Inside ``mlflow run``: the experiment of the run it created, for the later runs of a pipeline.
_project_experiment: str | None = None


def _start_run(run_name: str, experiment: str | None, tags: dict):
    """The first run inside ``mlflow run`` is the one it created (``MLFLOW_RUN_ID``); later runs of
    the same process (the demo's steps) are new runs beside it; outside, runs go to ``experiment``."""
    global _project_experiment
    project_run = os.environ.pop("MLFLOW_RUN_ID", None)
    if project_run:
        run = mlflow.start_run(run_id=project_run, tags=tags)
        _project_experiment = run.info.experiment_id
        return run
    if _project_experiment is not None:
        return mlflow.start_run(experiment_id=_project_experiment, run_name=run_name, tags=tags)
    try:
        mlflow.set_experiment(experiment or DEFAULT_EXPERIMENT)
    except MlflowException as exc:
        raise UserError(f"cannot use experiment '{experiment or DEFAULT_EXPERIMENT}' at "
                        f"{mlflow.get_tracking_uri()}: {exc.message.splitlines()[0]}") from None
    return mlflow.start_run(run_name=run_name, tags=tags)


@contextlib.contextmanager
def tracked_run(run_name: str, experiment: str | None = None, tags: dict | None = None):
    """Start an MLflow run that ends FINISHED on success, FAILED on any error and KILLED on Ctrl-C.

    Whatever the command logged before the failure stays logged: nothing is lost, and no run
    is ever left RUNNING.
    """
    run = _start_run(run_name, experiment, {"mlflow_di.version": mlflow_di.__version__, **(tags or {})})
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


def log_params(params: dict) -> None:
    """Log params, leaving out keys the run already has.

    Inside ``mlflow run`` the project's entry-point parameters are logged before the command
    starts (shell-quoted), and MLflow refuses to change a logged param: those stay as they are.
    """
    run = mlflow.active_run()
    existing = mlflow.get_run(run.info.run_id).data.params if run else {}
    fresh = {key: value for key, value in params.items() if key not in existing}
    if fresh:
        mlflow.log_params(fresh)


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


def write_json(payload: dict, path: str | None) -> None:
    """Write ``payload`` to ``path`` (the ``--json-out`` option), creating parent folders."""
    if not path:
        return
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, sort_keys=True))
