"""Reading and adding artifacts of an earlier run (e.g. a coverage run's fitted model and report).

``inspect --coverage RUN_ID`` reads the IDC model a ``coverage`` run logged and writes the labels
of its important neurons back onto that run, so the coverage report shows them.
"""
from __future__ import annotations

import pathlib
import tempfile

from mlflow_di.errors import UserError
from mlflow_di.mlflow_edge.connection import mlflow_errors


def download_run_folder(run_id: str, artifact_path: str, destination: str | None = None) -> pathlib.Path:
    """The run's ``artifact_path`` on local disk; one line when the run or the artifact is missing."""
    import mlflow

    with mlflow_errors(f"cannot read run '{run_id}'"):
        mlflow.tracking.MlflowClient().get_run(run_id)
    try:
        with mlflow_errors(f"cannot read '{artifact_path}' of run '{run_id}'"):
            return pathlib.Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=artifact_path,
                                                                    dst_path=destination))
    except OSError as exc:
        raise UserError(f"run '{run_id}' has no artifact '{artifact_path}' ({exc})") from None


def add_text_artifact(run_id: str, text: str, artifact_path: str) -> None:
    """Write ``text`` as ``artifact_path`` (a file path in the run's artifacts) of the run ``run_id``."""
    import mlflow

    target = pathlib.PurePosixPath(artifact_path)
    with tempfile.TemporaryDirectory(prefix="mlflow-di-artifact-") as folder:
        local = pathlib.Path(folder) / target.name
        local.write_text(text, encoding="utf-8")
        with mlflow_errors(f"cannot add '{artifact_path}' to run '{run_id}'"):
            mlflow.tracking.MlflowClient().log_artifact(run_id, str(local), str(target.parent) or None)
