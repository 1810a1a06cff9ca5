"""What a command records in its run: params, metrics and artifacts, through one object.

Commands never call ``mlflow.log_*`` themselves: they hand plain values (dicts, rows, images,
text, folders) to the :class:`RunLog` that :func:`~mlflow_di.mlflow_edge.runs.tracked_run`
yields. When the tracking server goes away mid-run (or the artifact store fills up), nothing is
lost: each item that cannot be logged is written under ``mlflow-di-unlogged/RUN_ID/`` instead, and
the command fails in one line (exit 2) saying how to log that folder later. A run the store could
not even end is noted there (``end.json``) and ended by the next command that reaches the store
(:func:`close_pending_runs`), so it is not left RUNNING.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys

import mlflow
from mlflow.exceptions import MlflowException

from mlflow_di.mlflow_edge.connection import first_line

UNLOGGED = pathlib.Path("mlflow-di-unlogged")
PENDING_END = "end.json"  # in a run's unlogged folder: the status its run must still be ended with
#: Errors that mean "the store cannot take this now" (server gone, refused, timed out).
_STORE_ERRORS = (MlflowException, ConnectionError, OSError)


class RunLog:
    """The active MLflow run of one command, with a local fallback for whatever cannot be logged."""

    def __init__(self, run):
        self.run = run
        self.run_id: str = run.info.run_id
        self.fallback: pathlib.Path | None = None  # set once something could not be logged
        self.reason = ""  # why the store refused (the first error), for the closing line

    @property
    def info(self):
        """The run's :class:`mlflow.entities.RunInfo` (id, experiment, artifact URI)."""
        return self.run.info

    # ---------------------------------------------------------------- what commands log
    def params(self, params: dict) -> None:
        """Log params, leaving out keys the run already has.

        Inside ``mlflow run`` the project's entry-point parameters are logged before the command
        starts (shell-quoted), and MLflow refuses to change a logged param: those stay as they are.
        """
        def write():
            existing = mlflow.get_run(self.run_id).data.params
            fresh = {key: value for key, value in params.items() if key not in existing}
            if fresh:
                mlflow.log_params(fresh)
        self._log(write, "params.json", lambda path: _merge_json(path, params))

    def metrics(self, metrics: dict, step: int | None = None, model_id: str | None = None, dataset=None) -> None:
        """Log metrics; with ``model_id`` (a LoggedModel's id, see ``registry.logged_model_id``) they are
        also the model's own metrics (its page in the UI), with ``dataset`` (a ``SpecDataset``) the data
        they were measured on."""
        clean = {key: float(value) for key, value in metrics.items() if value is not None}
        extra = {"model_id": model_id, "dataset": dataset} if model_id else {}
        self._log(lambda: mlflow.log_metrics(clean, step=step, **extra), "metrics.json",
                  lambda path: _merge_json(path, clean))

    def metric_series(self, key: str, values: dict[int, float]) -> None:
        """One metric at several steps ({step: value}) in one request: a curve in the run's charts."""
        from mlflow.entities import Metric
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        points = [Metric(key, float(value), now, int(step)) for step, value in values.items()]
        self._log(lambda: mlflow.MlflowClient().log_batch(self.run_id, metrics=points),
                  f"metric_series/{key}.json", lambda path: path.write_text(json.dumps(
                      {str(step): float(value) for step, value in values.items()})))

    def input(self, dataset, context: str) -> None:
        """Record that the run read ``dataset`` (a ``datasets.SpecDataset``) as ``context``
        (``training``, ``test``, ``seeds``, ``calibration``, ``evaluation``, ``inspection``).

        MLflow keeps one input per dataset and run (a second context of the same dataset is
        dropped): a dataset read in several roles goes through :meth:`inputs`."""
        from mlflow_di.mlflow_edge.datasets import ensure_registered

        ensure_registered()
        self._log(lambda: mlflow.log_input(dataset, context=context), "inputs.json",
                  lambda path: _merge_json(path, {f"{context}: {dataset.name}": dataset.to_dict()}))

    def inputs(self, pairs) -> None:
        """:meth:`input` for each (dataset, context); the same data (name and digest) in several roles is
        one input whose context names them all (``calibration,evaluation``)."""
        roles: dict = {}
        for dataset, context in pairs:
            roles.setdefault((dataset.name, dataset.digest), (dataset, []))[1].append(context)
        for dataset, contexts in roles.values():
            self.input(dataset, ",".join(dict.fromkeys(contexts)))

    def image_series(self, images, key: str) -> None:
        """Images as one stepped series (step 0, 1, ...): the UI's image slider for ``key``."""
        def keep(path):
            from PIL import Image

            path.mkdir(parents=True, exist_ok=True)
            for step, image in enumerate(images):
                Image.fromarray(_pil_ready(image)).save(path / f"{step}.png")

        def write():
            for step, image in enumerate(images):
                mlflow.log_image(image, key=key, step=step, synchronous=True)
        self._log(write, f"images/{key}", keep)

    def tags(self, tags: dict) -> None:
        self._log(lambda: mlflow.set_tags(tags), "tags.json", lambda path: _merge_json(path, tags))

    def json(self, payload: dict, artifact_path: str) -> None:
        self._log(lambda: mlflow.log_dict(payload, artifact_path), artifact_path,
                  lambda path: path.write_text(json.dumps(payload, indent=2, default=str)))

    def table(self, rows: list[dict], artifact_path: str) -> None:
        """Rows of equal keys as an MLflow table (previewed in the UI); nothing for no rows."""
        if not rows:
            return
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        self._log(lambda: mlflow.log_table(columns, artifact_path), artifact_path,
                  lambda path: path.write_text(json.dumps(columns, default=str)))

    def image(self, image, artifact_path: str) -> None:
        def keep(path):
            from PIL import Image

            Image.fromarray(_pil_ready(image)).save(path)
        self._log(lambda: mlflow.log_image(image, artifact_path), artifact_path, keep)

    def text(self, text: str, artifact_path: str) -> None:
        self._log(lambda: mlflow.log_text(text, artifact_path), artifact_path, lambda path: path.write_text(text))

    def folder(self, local_dir, artifact_path: str) -> None:
        self._log(lambda: mlflow.log_artifacts(str(local_dir), artifact_path), artifact_path,
                  lambda path: shutil.copytree(local_dir, path, dirs_exist_ok=True))

    # ---------------------------------------------------------------- plumbing
    def _log(self, write, artifact_path: str, keep) -> None:
        if self.fallback is None:
            try:
                write()
                return
            except _STORE_ERRORS as exc:
                self._start_fallback(exc)
        target = self.fallback / artifact_path
        target.parent.mkdir(parents=True, exist_ok=True)
        keep(target)

    def _start_fallback(self, exc: BaseException) -> None:
        self.fallback = UNLOGGED / self.run_id
        self.fallback.mkdir(parents=True, exist_ok=True)
        message = exc.message if isinstance(exc, MlflowException) else exc
        self.reason = first_line(message)

    def unlogged_line(self) -> str:
        """The one line a command fails with when something could not be logged: why, where it is, how to log it."""
        from mlflow_di.mlflow_edge.connection import tracking_uri

        ended = (f"run {self.run_id} ended FAILED" if not (self.fallback / PENDING_END).exists() else
                 f"run {self.run_id} could not be ended either (it shows RUNNING until `mlflow-di close-runs`, or any "
                 "mlflow-di command run here, reaches the store and ends it FAILED)")
        return (f"could not log to the tracking store {tracking_uri()} ({self.reason}); {ended}, and what it could not "
                f"log is in {self.fallback}/: once the store takes writes again, log it with "
                f"`mlflow artifacts log-artifacts --local-dir {self.fallback} --run-id {self.run_id}`")

    def end(self, status: str, announce: bool = True) -> None:
        """End the run with ``status``. When the store cannot end it, note the status beside the unlogged results
        (the next command that reaches the store ends it); with ``announce``, say where the results are."""
        try:
            mlflow.end_run(status=status)
        except _STORE_ERRORS as exc:
            if self.fallback is None:  # (MLflow has already dropped the run from this process's stack)
                self._start_fallback(exc)
            from mlflow_di.mlflow_edge.connection import tracking_uri

            (self.fallback / PENDING_END).write_text(json.dumps(
                {"run_id": self.run_id, "status": status, "tracking_uri": tracking_uri()}))
        if self.fallback is not None and announce:
            print(f"mlflow-di: results that could not be logged are in {self.fallback}/; once the server is back, "
                  f"log them with: mlflow artifacts log-artifacts --local-dir {self.fallback} --run-id {self.run_id}",
                  file=sys.stderr)


def close_pending_runs() -> list[str]:
    """End the runs of this tracking store that an earlier command could not end (its server was gone), with the
    status that command noted; the ids of those ended. A store that still refuses leaves the note for next time."""
    from mlflow_di.mlflow_edge.connection import tracking_uri

    if not UNLOGGED.is_dir():
        return []
    uri, ended = tracking_uri(), []
    for note in sorted(UNLOGGED.glob(f"*/{PENDING_END}")):
        try:
            pending = json.loads(note.read_text())
            if pending.get("tracking_uri") != uri:
                continue
            mlflow.MlflowClient().set_terminated(pending["run_id"], pending["status"])
        except (ValueError, KeyError, *_STORE_ERRORS):
            continue
        note.unlink(missing_ok=True)
        ended.append(pending["run_id"])
    return ended


def _pil_ready(image):
    """An image array PIL can take: (H, W, 1) grey becomes (H, W)."""
    import numpy as np

    image = np.asarray(image)
    return image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image


def _merge_json(path: pathlib.Path, values: dict) -> None:
    existing = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**existing, **values}, indent=2, default=str))
