"""Which tracking store mlflow-di talks to, whether it answers, and MLflow errors as one line.

Why a reachability check: MLflow's HTTP client retries a dead server with exponential backoff
(minutes of silence, then a several-hundred-character error). Before any work a command asks
the server twice, within one time budget (``--tracking-timeout``, default 30 s): ``/health`` must
answer 200 with MLflow's ``OK`` (any other page means something else listens there), and one
cheap API call must answer at all (a server whose ``/health`` answers while its API hangs took
minutes to fail, and the error then blamed the model). Either failure is one line that names
the server. Later calls get a bounded retry budget (:func:`bound_http_retries`), so a server that
goes away mid-run costs seconds, not minutes, and the command keeps its results locally (see
:mod:`mlflow_di.mlflow_edge.run_log`).
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.error
import urllib.request

from mlflow_di.errors import UserError

#: Seconds the reachability check may take in all (``--tracking-timeout``).
CHECK_BUDGET_S = 30.0
#: The cheapest API call every MLflow server answers (its reply, even 401/403, proves the API is alive).
_API_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"
#: MLflow HTTP settings the CLI uses unless the user set them: a few quick retries, short timeouts.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def tracking_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def store_hint() -> str:
    """How to point at another tracking store, for a name that is not found in this one: under ``mlflow run``
    the options cannot be given, the environment can (a relative sqlite store is the current folder's)."""
    return ("check the name/version/alias, or point at the store that holds it: --tracking-uri, or "
            "MLFLOW_TRACKING_URI=sqlite:////ABSOLUTE/PATH/mlflow.db (under `mlflow run` too, which reads the current "
            "folder's mlflow.db otherwise)")


def use_tracking_uri(uri: str | None) -> None:
    """Point MLflow at ``uri`` (None: MLflow's default, ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``)."""
    if uri:
        import mlflow

        mlflow.set_tracking_uri(uri)


def bound_http_retries() -> None:
    """Give MLflow's HTTP client a small retry budget unless the user chose one."""
    for key, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _check_sqlite(uri: str) -> None:
    """One line at once when the sqlite store at ``uri`` cannot be opened (or created) for writing."""
    import pathlib
    import sqlite3

    path = pathlib.Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    if str(path) in ("", ":memory:"):
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sqlite3.connect(str(path), timeout=5).close()
    except (sqlite3.Error, OSError) as exc:
        raise UserError(f"cannot open the tracking store {uri} (SQLite: {str(exc).strip().splitlines()[0]}); its "
                        "folder must exist and be writable: pick another --tracking-uri or fix the folder's "
                        "permissions") from None


def check_reachable(uri: str | None = None, budget_s: float = CHECK_BUDGET_S) -> None:
    """Raise a one-line :class:`UserError` naming the server unless the HTTP tracking server at
    ``uri`` answers ``/health`` with 200 ``OK`` and answers an API call, all within ``budget_s``.

    A sqlite store is opened once here: MLflow retries a store it cannot open ten times with growing
    pauses (102 s) before it says so; a file path store needs no check.
    """
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        _check_sqlite(uri)
    if not uri.startswith(("http://", "https://")):
        return
    deadline = time.monotonic() + budget_s
    base = uri.rstrip("/")
    advice = f"check that the MLflow server runs there (curl {base}/health) or pass --tracking-uri / set MLFLOW_TRACKING_URI"
    try:
        status, body = _get(base + "/health", deadline)
    except _NoAnswer as exc:
        raise UserError(f"the tracking server {uri} does not answer ({exc}); {advice}") from None
    if status != 200 or not body.strip().startswith(b"OK"):
        raise UserError(f"{uri} is not an MLflow tracking server: /health answered {status} "
                        f"{body[:40].decode(errors='replace').strip()!r}, not 200 'OK'; {advice}")
    try:
        _get(base + _API_PROBE, deadline)
    except _NoAnswer as exc:
        raise UserError(f"the tracking server {uri} answers /health but not its API ({exc}); check the server's "
                        "database and logs, or raise --tracking-timeout") from None


class _NoAnswer(Exception):
    """No HTTP answer in time (refused, unresolvable, timed out)."""


def _get(url: str, deadline: float) -> tuple[int, bytes]:
    """(status, first bytes of the body) of GET ``url``; any HTTP status is an answer."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _NoAnswer("no time left of --tracking-timeout")
    try:
        with urllib.request.urlopen(url, timeout=left) as reply:  # noqa: S310 (the user's own server)
            return reply.status, reply.read(256)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(256) if exc.fp is not None else b""
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (TimeoutError, socket.timeout)) or "timed out" in str(reason):
            reason = f"no reply within {max(left, 0):.0f} s"
        raise _NoAnswer(str(reason)) from None


def first_line(text) -> str:
    """The first non-empty line of an error message."""
    text = str(text).strip()
    return text.splitlines()[0] if text else "unknown error"


def mlflow_error_line(exc: BaseException) -> str | None:
    """The one line to show for an MLflow error that escaped a command; None for any other error."""
    from mlflow.exceptions import MlflowException

    return first_line(exc.message) if isinstance(exc, MlflowException) else None


@contextlib.contextmanager
def mlflow_errors(what: str):
    """Turn an ``MlflowException`` (or a dropped connection) inside the block into one line.

    ``what`` says what was being done, e.g. ``"cannot log model 'x'"``.
    """
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        raise UserError(f"{what} at {tracking_uri()}: {first_line(exc.message)}") from None
    except ConnectionError as exc:
        raise UserError(f"{what}: the tracking server {tracking_uri()} went away ({first_line(exc)})") from None


@contextlib.contextmanager
def permission_errors(uri: str, action: str, needed: str | None = None):
    """Turn the tracking server's 403/401 into one line naming the user and the permission needed.

    ``action`` is a verb phrase about ``uri``: ``"read"``, ``"write tags on"``, ``"move aliases of"``;
    ``needed`` the permission it takes (READ for reading, else EDIT unless given: removing an alias takes MANAGE).
    """
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        user = os.environ.get("MLFLOW_TRACKING_USERNAME") or "(anonymous)"
        if exc.error_code == "PERMISSION_DENIED":
            needed = needed or ("READ" if action == "read" else "EDIT")
            verb = "may not read" if action == "read" else f"may not {action}"
            raise UserError(f"user {user} {verb} {uri} (needs {needed} permission on the registered model)") from None
        if exc.error_code == "UNAUTHENTICATED":
            raise UserError(f"the tracking server {tracking_uri()} rejected the credentials of user {user}; "
                            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD") from None
        raise
