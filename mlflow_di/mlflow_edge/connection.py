"""Which tracking store mlflow-di talks to, whether it answers, and MLflow errors as one line.

Why a reachability check: MLflow's HTTP client retries a dead server with exponential backoff
(minutes of silence, then a several-hundred-character error). A command checks the server's
``/health`` once with a short timeout before it starts any work, and fails in seconds with the
URI and what to check. Later calls get a bounded retry budget (:func:`bound_http_retries`), so
a server that goes away mid-run costs seconds, not minutes, and the command keeps its results
locally (see :mod:`mlflow_di.mlflow_edge.run_log`).
"""
from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.request

from mlflow_di.errors import UserError

#: Seconds the reachability check waits for ``/health``.
HEALTH_TIMEOUT_S = 5.0
#: MLflow HTTP settings the CLI uses unless the user set them: a few quick retries, short timeouts.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def tracking_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def use_tracking_uri(uri: str | None) -> None:
    """Point MLflow at ``uri`` (None: MLflow's default, ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``)."""
    if uri:
        import mlflow

        mlflow.set_tracking_uri(uri)


def bound_http_retries() -> None:
    """Give MLflow's HTTP client a small retry budget unless the user chose one."""
    for key, value in _HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


def check_reachable(uri: str | None = None, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """Raise a one-line :class:`UserError` when an HTTP tracking server does not answer ``/health``.

    Local stores (sqlite, file paths) need no check: opening them reports its own errors.
    """
    uri = uri or tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return
    health = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout):  # noqa: S310 (the user's own server)
            return
    except urllib.error.HTTPError:
        return  # it answered (a proxy or auth layer may refuse /health): the server is there
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"the tracking server {uri} does not answer ({reason}); check that it runs "
                        f"(curl {health}) or pass --tracking-uri / set MLFLOW_TRACKING_URI") from None


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
def permission_errors(uri: str, action: str):
    """Turn the tracking server's 403/401 into one line naming the user and the permission needed.

    ``action`` is a verb phrase about ``uri``: ``"read"``, ``"write tags on"``, ``"move aliases of"``.
    """
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        user = os.environ.get("MLFLOW_TRACKING_USERNAME") or "(anonymous)"
        if exc.error_code == "PERMISSION_DENIED":
            needed = "READ" if action == "read" else "EDIT"
            verb = "may not read" if action == "read" else f"may not {action}"
            raise UserError(f"user {user} {verb} {uri} (needs {needed} permission on the registered model)") from None
        if exc.error_code == "UNAUTHENTICATED":
            raise UserError(f"the tracking server {tracking_uri()} rejected the credentials of user {user}; "
                            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD") from None
        raise
