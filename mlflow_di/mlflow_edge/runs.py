"""MLflow runs: start one in the right experiment, end it honestly, close the ones a crash left open.

Every command that records results does so inside :func:`tracked_run`. The run ends FINISHED
on success, FAILED on an error and KILLED on Ctrl-C or SIGTERM (the CLI turns SIGTERM into
:class:`~mlflow_di.errors.Terminated`, a ``KeyboardInterrupt``); whatever was logged before
stays logged. A run that a ``kill -9`` left RUNNING is found by its tags and closed by
:func:`close_orphaned_runs` (the fuzz command does so on ``--resume``).
"""
from __future__ import annotations

import contextlib
import os
import sys

import mlflow
from mlflow.exceptions import MlflowException

import mlflow_di
from mlflow_di.errors import UserError
from mlflow_di.mlflow_edge.connection import first_line, tracking_uri
from mlflow_di.mlflow_edge.run_log import RunLog, close_pending_runs
from mlflow_di.printable import name_problem, printable

DEFAULT_EXPERIMENT = "mlflow-di"
#: MLflow's experiment-kind tag: a classic-ML experiment opens on its runs, not on GenAI traces.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}

#: Inside ``mlflow run``: the experiment of the run it created, for the later runs of a pipeline.
_project_experiment: str | None = None


def check_experiment_name(name: str) -> None:
    """Refuse an experiment name MLflow would keep but no one could type or read back (empty, a newline
    or another control character), before any work is done under it."""
    problem = name_problem(name)
    if problem:
        raise UserError(f"'{printable(name)}' cannot name an experiment: {problem}; set MLFLOW_EXPERIMENT_NAME "
                        "to a name of letters, digits and punctuation, or unset it")


def use_experiment(name: str) -> str:
    """The id of experiment ``name``, created as a classic-ML experiment when it does not exist."""
    check_experiment_name(name)
    client = mlflow.MlflowClient()
    try:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            experiment_id = client.create_experiment(name, tags=EXPERIMENT_KIND)
        else:
            experiment_id = experiment.experiment_id
            if experiment.lifecycle_stage == "deleted":
                raise UserError(f"experiment '{name}' at {tracking_uri()} is deleted; restore it "
                                f"(mlflow experiments restore --experiment-id {experiment_id}) or pick another")
    except MlflowException as exc:
        raise UserError(f"cannot use experiment '{name}' at {tracking_uri()}: {first_line(exc.message)}") from None
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def _start_run(run_name: str, experiment: str | None, tags: dict, run_id: str | None = None):
    """The first run inside ``mlflow run`` is the one it created (``MLFLOW_RUN_ID``); later runs of
    the same process (the demo's steps) are new runs beside it; outside, runs go to ``experiment``.
    While a run is active (a pipeline's parent run) the new run is its child. ``run_id``: reopen
    that earlier run (a resumed pipeline's parent) instead of starting one."""
    global _project_experiment
    parent = mlflow.active_run()
    if parent is not None:
        return mlflow.start_run(experiment_id=parent.info.experiment_id, run_name=run_name, tags=tags, nested=True)
    if run_id:
        return mlflow.start_run(run_id=run_id, tags=tags)
    project_run = os.environ.pop("MLFLOW_RUN_ID", None)
    if project_run:
        run = mlflow.start_run(run_id=project_run, tags=tags)
        _project_experiment = run.info.experiment_id
        mlflow.set_tag("mlflow.runName", run_name)
        return run
    if _project_experiment is not None:
        return mlflow.start_run(experiment_id=_project_experiment, run_name=run_name, tags=tags)
    experiment_id = use_experiment(experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT)
    return mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=tags)


@contextlib.contextmanager
def tracked_run(run_name: str, experiment: str | None = None, tags: dict | None = None, run_id: str | None = None,
                status: str = "FINISHED"):
    """Start an MLflow run (a child of the active run, if one is active; ``run_id``: reopen that
    run) and yield its :class:`RunLog`; the run never stays RUNNING.

    ``status`` (FINISHED) when the block succeeds, FAILED on any error, KILLED on Ctrl-C / SIGTERM;
    ``status='KILLED'`` ends a child that holds the results of an interrupted campaign, which the
    gate must not read as finished. Whatever the command logged before the failure stays logged;
    whatever could not be logged (the server went away) is kept on disk and the command says where.
    """
    top_level = mlflow.active_run() is None
    if top_level:
        for closed in close_pending_runs():
            print(f"mlflow-di: ended run {closed}, left RUNNING when the tracking store went away", file=sys.stderr)
    try:
        run = _start_run(run_name, experiment, {"mlflow_di.version": mlflow_di.__version__, **(tags or {})}, run_id)
    except MlflowException as exc:
        raise UserError(f"cannot start a run at {tracking_uri()}: {first_line(exc.message)}") from None
    ended = status
    try:
        yield (log := RunLog(run))
    except KeyboardInterrupt:
        log.end(ended := "KILLED")
        raise
    except UserError:
        log.end(ended := "FAILED", announce=False)  # the error's own line says what to do
        raise
    except BaseException:
        log.end(ended := "FAILED")
        raise
    else:
        if log.fallback is not None:  # never FINISHED with results missing from the store
            log.end(ended := "FAILED", announce=False)
            raise UserError(log.unlogged_line())
        log.end(status)
    finally:
        if top_level:
            _announce_at_exit(run, ended)


#: The MLflow UI's address for a local store (``mlflow ui`` on a sqlite file or a folder), when it
#: is not on ``mlflow ui``'s default port, or is served elsewhere: every printed link uses it.
UI_URL_ENV = "MLFLOW_DI_UI_URL"
#: Where ``mlflow ui`` listens when started with no ``--port``/``--host``.
DEFAULT_UI = "http://127.0.0.1:5000"


def ui_base() -> str | None:
    """The address of the UI that shows this store: the tracking server itself (http/https), else
    ``$MLFLOW_DI_UI_URL``; None for a local store with no UI address given."""
    import os

    uri = tracking_uri()
    if _served(uri):
        return uri.rstrip("/")
    configured = os.environ.get(UI_URL_ENV, "").strip()
    return configured.rstrip("/") or None


def run_line(run, status: str) -> str:
    """Where to find ``run`` in the MLflow UI, in one line: its page under :func:`ui_base`, else the
    page's address under ``mlflow ui`` started on this store (its default address)."""
    page = _run_page(run.info.experiment_id, run.info.run_id)
    base = ui_base()
    if base is not None:
        where = f"{base}/{page}"
    else:
        where = (f"{DEFAULT_UI}/{page} after `mlflow ui --backend-store-uri {tracking_uri()}` (another address: "
                 f"set {UI_URL_ENV})")
    return f"run {run.info.run_id} ({status}): {where}"


def ui_line() -> str:
    """How to open this store in the MLflow UI, in one line (the closing "where to look" blocks)."""
    base = ui_base()
    if base is not None:
        return f"open {base}" + ("" if _served(tracking_uri()) else f"   # the UI on this store ({UI_URL_ENV})")
    return f"mlflow ui --backend-store-uri {tracking_uri()}   # then open {DEFAULT_UI} (or set {UI_URL_ENV})"


def _served(uri: str) -> bool:
    """Whether the tracking URI is a server whose UI is already up (http/https), not a local store."""
    return uri.startswith(("http://", "https://"))


def _run_page(experiment_id: str, run_id: str) -> str:
    """A run's page in the MLflow UI, relative to the UI's address."""
    return f"#/experiments/{experiment_id}/runs/{run_id}"


def _announce_at_exit(run, status: str) -> None:
    """Print :func:`run_line` as the command's last output (commands print their own results
    after their run ends); outside a command (the Python API) nothing is printed."""
    import click

    context = click.get_current_context(silent=True)
    if context is None:
        return
    root = context.find_root()
    pending = root.meta.setdefault("mlflow_di.run_lines", [])
    if not pending:
        root.call_on_close(lambda: [click.echo(line) for line in pending])
    pending.append(run_line(run, status))


def take_run_lines() -> list[str]:
    """The run lines a command has collected so far (each run's :func:`run_line`), taken so that
    they are not printed again at exit: for a command that shows them in its own closing block."""
    import click

    context = click.get_current_context(silent=True)
    if context is None:
        return []
    pending = context.find_root().meta.get("mlflow_di.run_lines", [])
    taken = list(pending)
    pending.clear()
    return taken


def close_orphaned_runs(tags: dict, reason: str) -> list[str]:
    """End as KILLED every RUNNING run carrying ``tags`` (left by a process that was killed hard).

    Returns their ids. The run keeps everything it logged; the tag ``mlflow_di.closed_by`` says why.
    """
    from mlflow_di.mlflow_edge.gate_evidence import experiment_ids, matching, tag_filter

    client = mlflow.MlflowClient()
    ids = experiment_ids(client)
    if not ids:
        return []
    orphans = matching(client.search_runs(ids, f"{tag_filter(tags)} and attributes.status = 'RUNNING'"), tags)
    for run in orphans:
        client.set_tag(run.info.run_id, "mlflow_di.closed_by", reason)
        client.set_terminated(run.info.run_id, status="KILLED")
    return [run.info.run_id for run in orphans]


def end_project_run(status: str) -> None:
    """End the run ``mlflow run`` created for this process when the command failed before using it,
    so that run is never left RUNNING."""
    run_id = os.environ.pop("MLFLOW_RUN_ID", None)
    if run_id:
        with contextlib.suppress(MlflowException, OSError):
            mlflow.MlflowClient().set_terminated(run_id, status=status)


def descendant_run_ids(run_id: str) -> list[str]:
    """The ids of every run nested under ``run_id`` (children, their children, ...), e.g. a
    pipeline's step runs and the per-export runs of its fuzz step."""
    client = mlflow.MlflowClient()
    experiment = client.get_run(run_id).info.experiment_id
    found, frontier = [], [run_id]
    while frontier:
        query = f"tags.`mlflow.parentRunId` = '{frontier[0]}'"
        children = [run.info.run_id for run in client.search_runs([experiment], query, max_results=1000)]
        frontier = frontier[1:] + children
        found.extend(children)
    return found


def run_links(run_ids, relative: bool = False) -> dict[str, str]:
    """{run id: its page in the MLflow UI} under :func:`ui_base` (an http(s) tracking server, or
    ``$MLFLOW_DI_UI_URL`` for a local store); {} without a UI address and for runs that cannot be read.
    ``relative``: ``#/experiments/...`` links, for text the UI itself shows (a version's description): they
    open the run on whatever host and port the UI is served from, a local store included."""
    base = "" if relative else ui_base()
    if base is None:
        return {}
    client, links = mlflow.MlflowClient(), {}
    for run_id in dict.fromkeys(r for r in run_ids if r):
        try:
            page = _run_page(client.get_run(run_id).info.experiment_id, run_id)
        except MlflowException:
            continue
        links[run_id] = page if relative else f"{base}/{page}"
    return links
