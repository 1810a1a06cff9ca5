"""One writer per registry version: a gate or a pipeline writes a version's verdict only while it holds
the version's lock, kept in the tracking store so that it holds across machines.

The verdict is several writes (tags, description, alias); two gates interleaving them left a version
that said FAIL with the PASS gate's run and heading. MLflow has no compare-and-set, but creating a
registered model is atomic on every store (a second create of one name fails), so a version's lock is
a registered model, ``mlflow-di-lock.<hash of the model's name>.v<version>``, created by its holder
and deleted when it is done. Its tags name the holder (command, host, process, run) and carry a
heartbeat the holder refreshes every :data:`HEARTBEAT_S` seconds; a lock without a heartbeat for
:data:`STALE_S` seconds was left by a process that died, and the next one takes it over. A holder
confirms its lock after creating it, so two processes that both took over a stale lock do not both
go on. Within one process the lock is re-entrant: the gate a pipeline runs works under the
pipeline's lock.

A process that finds the lock held waits for it up to ``wait_s`` seconds (a gate: they take seconds),
then stops with :class:`VersionBusy` (exit code 75, "try again later": the service retries such a job).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import socket
import threading
import time

from mlflow_di.errors import UserError

#: seconds between a holder's heartbeats, and without one after which a lock is stale
HEARTBEAT_S, STALE_S = 30.0, 300.0
#: seconds between two looks at a held lock while waiting
POLL_S = 1.0
PREFIX = "mlflow-di-lock."


class VersionBusy(UserError):
    """Another mlflow-di process is writing this version's verdict: try again later (exit code 75)."""

    exit_code = 75


_held: contextvars.ContextVar[frozenset] = contextvars.ContextVar("mlflow_di_version_locks", default=frozenset())


def lock_name(name: str, version) -> str:
    """The registered model that is the lock of version ``version`` of ``name`` (any name fits in it)."""
    return f"{PREFIX}{hashlib.sha256(name.encode()).hexdigest()[:16]}.v{version}"


@contextlib.contextmanager
def version_lock(name: str, version, command: str, wait_s: float = 0.0, client=None):
    """Hold the lock of ``models:/name/version`` for the block (see the module docstring)."""
    key = lock_name(name, version)
    if key in _held.get():  # this process holds it already (a pipeline's own gate)
        yield
        return
    from mlflow import MlflowClient

    client = client or MlflowClient()
    holder = _holder(command)
    _acquire(client, key, name, version, holder, wait_s)
    token = _held.set(_held.get() | {key})
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(client, key, stop), name="mlflow-di-lock-heartbeat", daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join(5)
        _held.reset(token)
        _release(client, key, holder)


def _holder(command: str) -> dict:
    return {"mlflow_di.lock.holder": f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}",
            "mlflow_di.lock.command": f"mlflow-di {command}", "mlflow_di.lock.host": socket.gethostname(),
            "mlflow_di.lock.pid": str(os.getpid()), "mlflow_di.lock.run_id": os.environ.get("MLFLOW_RUN_ID", ""),
            "mlflow_di.lock.since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _acquire(client, key: str, name: str, version, holder: dict, wait_s: float) -> None:
    from mlflow.exceptions import MlflowException

    deadline = time.monotonic() + wait_s
    while True:
        try:
            client.create_registered_model(key, tags={**holder, "mlflow_di.lock.heartbeat": str(time.time())},
                                           description=f"mlflow-di is writing the verdict of models:/{name}/{version} "
                                                       "(deleted when done)")
            if _confirmed(client, key, holder):
                return
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        tags = _tags(client, key)
        if tags is not None and time.time() - float(tags.get("mlflow_di.lock.heartbeat") or 0) > STALE_S:
            with contextlib.suppress(MlflowException):  # its holder died: take it over (confirmed above)
                client.delete_registered_model(key)
            continue
        if time.monotonic() >= deadline:
            raise VersionBusy(_busy_line(name, version, key, tags or {}))
        time.sleep(POLL_S)


def _confirmed(client, key: str, holder: dict) -> bool:
    """Whether the lock still names ``holder`` a moment after it was created (another process that took a stale
    lock over at the same time may have replaced it)."""
    time.sleep(0.2)
    tags = _tags(client, key)
    return tags is not None and tags.get("mlflow_di.lock.holder") == holder["mlflow_di.lock.holder"]


def _tags(client, key: str) -> dict | None:
    from mlflow.exceptions import MlflowException

    try:
        return dict(client.get_registered_model(key).tags or {})
    except MlflowException:
        return None


def _heartbeat(client, key: str, stop: threading.Event) -> None:
    from mlflow.exceptions import MlflowException

    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(MlflowException, OSError):
            client.set_registered_model_tag(key, "mlflow_di.lock.heartbeat", str(time.time()))


def _release(client, key: str, holder: dict) -> None:
    """Delete the lock if it is still this holder's (never another process's)."""
    from mlflow.exceptions import MlflowException

    tags = _tags(client, key)
    if tags is not None and tags.get("mlflow_di.lock.holder") == holder["mlflow_di.lock.holder"]:
        with contextlib.suppress(MlflowException, OSError):
            client.delete_registered_model(key)


def _busy_line(name: str, version, key: str, tags: dict) -> str:
    who = tags.get("mlflow_di.lock.command", "another mlflow-di process")
    where = f"process {tags.get('mlflow_di.lock.pid', '?')} on {tags.get('mlflow_di.lock.host', '?')}"
    run = f", run {tags['mlflow_di.lock.run_id']}" if tags.get("mlflow_di.lock.run_id") else ""
    return (f"models:/{name}/{version} is being judged by `{who}` ({where}{run}, since "
            f"{tags.get('mlflow_di.lock.since', '?')}); try again when it is done (a lock whose holder died is taken "
            f"over after {STALE_S / 60:.0f} minutes, or delete the registered model {key})")
