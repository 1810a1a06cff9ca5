"""Reading and adding artifacts of an earlier run (e.g. a coverage run's fitted model and report).

``inspect --coverage RUN_ID`` and ``generate --coverage RUN_ID`` read the IDC model a ``coverage``
run logged (:func:`coverage_idc`); ``inspect`` writes the labels of its important neurons back
onto that run, so the coverage report shows them.
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


def latest_coverage(coverage: str | None, model_uri: str) -> str | None:
    """``coverage`` as given, or for ``latest`` the newest coverage run of the registry version
    ``model_uri`` (:func:`~mlflow_di.mlflow_edge.gate_evidence.latest_run`)."""
    if coverage != "latest":
        return coverage
    from mlflow_di.mlflow_edge.gate_evidence import latest_run
    from mlflow_di.mlflow_edge.registry import model_version_tags

    return latest_run("--coverage", "coverage", "idc", model_version_tags(model_uri), model_uri)


def coverage_idc(coverage: str, model):
    """The fitted IDC of a coverage run id, or of a folder a coverage run saved (``coverage/model``), attached to ``model``."""
    import os

    from mlflow_di.coverage.idc import ImportanceDrivenCoverage
    from mlflow_di.coverage.suite import IDC_FILE

    folder = pathlib.Path(coverage) if os.path.isdir(coverage) else download_run_folder(coverage, "coverage/model")
    if not (folder / IDC_FILE).is_file():
        raise UserError(f"--coverage {coverage} holds no IDC model ({IDC_FILE} missing); give a coverage run "
                        f"that measured idc")
    return ImportanceDrivenCoverage.load(folder / IDC_FILE, model)
