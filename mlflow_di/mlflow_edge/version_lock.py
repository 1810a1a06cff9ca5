"""One writer per registry version: a gate or a pipeline writes a version's verdict only while it holds
the version's lock, kept in the tracking store so that it holds across machines.

The verdict is several writes (tags, description, alias); two gates interleaving them left a version
that said FAIL with the PASS gate's run and heading. MLflow's API has one compare-and-set that works on
every store, a server behind authentication included: creating a registered model (a second create of
one name fails). Experiments are unique by name too, but a deleted one keeps its name until an admin
purges it, so a lock could not be released; tags have no compare-and-set at all. So a version's lock is
a registered model, ``mlflow-di-lock.<hash of the model's name>.v<version>``, created by its holder and
deleted when it is done: registry users see it in the model list while a gate writes (seconds) or a
pipeline runs, its description saying what it is.

Its tags name the holder (command, host, process, run) and carry a heartbeat the holder refreshes every
:data:`HEARTBEAT_S` seconds. A lock record is judged before anyone waits for it (:func:`stale_reason`):
a heartbeat older than :data:`STALE_S` seconds, a heartbeat or start time in the future (a forged
record, or a clock far ahead), or a holder on this host whose process is gone make it stale, and the
next process takes it over at once, marking the dead holder's RUNNING runs KILLED with the reason. A
registered model under the lock's name that is no lock (no holder tag, or versions of its own) is a
user's model: it is left alone and the lock moves to the next name (``...v<version>~2``), which every
process computes the same way. A holder confirms its lock after creating it, so two processes that
both took over a stale lock do not both go on. Within one process the lock is re-entrant: the gate a
pipeline runs works under the pipeline's lock.

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
import types

from mlflow_di import processes
from mlflow_di.errors import UserError

#: seconds between a holder's heartbeats, and without one after which a lock is stale
HEARTBEAT_S, STALE_S = 30.0, 300.0
#: seconds a lock's heartbeat or start may lie ahead of this host's clock before the record counts as forged
CLOCK_SKEW_S = 60.0
#: names tried for one version's lock when users' own models hold the first ones (``~2``, ``~3``, ...)
MAX_NAMES = 5
HOLDER = "mlflow_di.lock.holder"
#: seconds between two looks at a held lock while waiting
POLL_S = 1.0
PREFIX = "mlflow-di-lock."


class VersionBusy(UserError):
    """Another mlflow-di process is writing this version's verdict: try again later (exit code 75)."""

    exit_code = 75


#: the locks this context holds: lock name -> (its client, its holder record)
_held: contextvars.ContextVar[types.MappingProxyType] = contextvars.ContextVar(
    "mlflow_di_version_locks", default=types.MappingProxyType({}))


def lock_name(name: str, version) -> str:
    """The registered model that is the lock of version ``version`` of ``name`` (any name fits in it)."""
    return f"{PREFIX}{hashlib.sha256(name.encode()).hexdigest()[:16]}.v{version}"


@contextlib.contextmanager
def version_lock(name: str, version, command: str, wait_s: float = 0.0, client=None):
    """Hold the lock of ``models:/name/version`` for the block (see the module docstring)."""
    base = lock_name(name, version)
    if any(key.split("~")[0] == base for key in _held.get()):  # this process holds it already (a pipeline's gate)
        yield
        return
    from mlflow import MlflowClient

    client = client or MlflowClient()
    holder = _holder(command)
    key = _acquire(client, base, name, version, holder, wait_s)
    token = _held.set(types.MappingProxyType({**_held.get(), key: (client, holder)}))
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


def record_holder_run(run_id: str) -> None:
    """Name the run this process works in on every lock it holds that names no run yet (a pipeline's
    run, not the gate it runs inside), and the lock on the run, so that whoever takes a lock over after
    this process died can mark that run (and its children) KILLED."""
    from mlflow.exceptions import MlflowException

    for key, (client, holder) in _held.get().items():
        if holder.get("mlflow_di.lock.run_id"):
            continue
        holder["mlflow_di.lock.run_id"] = run_id
        with contextlib.suppress(MlflowException, OSError):
            client.set_tag(run_id, "mlflow_di.lock", f"{key} {holder[HOLDER]}")
            client.set_registered_model_tag(key, "mlflow_di.lock.run_id", run_id)


def stale_reason(tags: dict, now: float, host: str | None = None, alive=None) -> str | None:
    """Why the lock record ``tags`` no longer holds (None: it does): no heartbeat for
    :data:`STALE_S` seconds, a heartbeat or start time more than :data:`CLOCK_SKEW_S` seconds
    ahead of ``now`` (forged, or a clock that would hold it forever), or a holder on ``host`` (this
    one) whose process is gone (``alive(pid)`` False)."""
    try:
        heartbeat = float(tags.get("mlflow_di.lock.heartbeat", ""))
    except ValueError:
        return "it has no heartbeat"
    if heartbeat != heartbeat:  # NaN
        return "it has no heartbeat"
    if heartbeat > now + CLOCK_SKEW_S:
        return f"its heartbeat is {heartbeat - now:.0f} s in the future (a forged record or a wrong clock)"
    since = _since_seconds(tags.get("mlflow_di.lock.since", ""))
    if since is not None and since > now + CLOCK_SKEW_S:
        return f"it says it started {since - now:.0f} s in the future (a forged record or a wrong clock)"
    if now - heartbeat > STALE_S:
        return f"its holder has not been heard of for {now - heartbeat:.0f} s (more than {STALE_S:.0f})"
    pid = tags.get("mlflow_di.lock.pid", "")
    if host is not None and tags.get("mlflow_di.lock.host") == host and pid.isdigit() and alive is not None \
            and not alive(int(pid)):
        return f"its holder, process {pid} on this host, is gone"
    return None


def _since_seconds(text: str) -> float | None:
    import datetime

    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def _holder(command: str) -> dict:
    return {HOLDER: f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}",
            "mlflow_di.lock.command": f"mlflow-di {command}", "mlflow_di.lock.host": socket.gethostname(),
            "mlflow_di.lock.pid": str(os.getpid()), "mlflow_di.lock.run_id": os.environ.get("MLFLOW_RUN_ID", ""),
            "mlflow_di.lock.since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _acquire(client, base: str, name: str, version, holder: dict, wait_s: float) -> str:
    """Create the lock (the first of its names no user's model holds); returns the name taken."""
    from mlflow.exceptions import MlflowException

    deadline = time.monotonic() + wait_s
    while True:
        key, tags = _free_name(client, base)
        try:
            client.create_registered_model(key, tags={**holder, "mlflow_di.lock.heartbeat": str(time.time())},
                                           description=f"mlflow-di is writing the verdict of models:/{name}/{version} "
                                                       "(a lock, deleted when done; see mlflow-di's docs/commands/gate.md)")
            if _confirmed(client, key, holder):
                return key
            continue
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        tags = _tags(client, key)  # read again: the holder may have changed since
        if tags is not None and _foreign(client, key, tags):
            continue  # a user's model appeared under the name: the next name
        why = stale_reason(tags, time.time(), socket.gethostname(), processes.alive) if tags is not None else None
        if why is not None:
            _take_over(client, key, tags, why)
            continue
        if time.monotonic() >= deadline:  # (tags None: released meanwhile, or unreadable; the next round decides)
            raise VersionBusy(_busy_line(name, version, key, tags or {}))
        time.sleep(POLL_S)


def _free_name(client, base: str) -> tuple[str, dict | None]:
    """The first of the lock's names that holds no user's model, and that lock's tags when one holds it."""
    for number in range(1, MAX_NAMES + 1):
        key = base if number == 1 else f"{base}~{number}"
        tags = _tags(client, key)
        if tags is None or not _foreign(client, key, tags):
            return key, tags
    raise UserError(f"registered models that are not mlflow-di locks hold every name of this version's lock "
                    f"({base} to {base}~{MAX_NAMES}); rename or delete them")


def _foreign(client, key: str, tags: dict) -> bool:
    """Whether the registered model ``key`` is a user's, not a lock: no holder tag, or versions of its own."""
    from mlflow.exceptions import MlflowException

    if HOLDER not in tags:
        return True
    try:
        return bool(client.search_model_versions(f"name = '{key}'", max_results=1))
    except MlflowException:
        return False


def _take_over(client, key: str, tags: dict, why: str) -> None:
    """Delete the stale lock ``key`` and mark its dead holder's RUNNING runs (the run it named, and that
    run's RUNNING children) KILLED, each with a tag saying why; a run is touched only when it carries
    this lock's holder record (so a forged record cannot end other people's runs)."""
    import click
    from mlflow.exceptions import MlflowException

    with contextlib.suppress(MlflowException):
        client.delete_registered_model(key)
    who = f"process {tags.get('mlflow_di.lock.pid', '?')} on {tags.get('mlflow_di.lock.host', '?')}"
    click.echo(f"note: took over the lock {key} of `{tags.get('mlflow_di.lock.command', '?')}` ({who}): {why}",
               err=True)
    run_id = tags.get("mlflow_di.lock.run_id")
    if not run_id:
        return
    reason = f"its process ({who}) stopped while holding {key}: {why}; marked KILLED by the process that took over"
    with contextlib.suppress(MlflowException, OSError):
        run = client.get_run(run_id)
        if run.info.status != "RUNNING" or run.data.tags.get("mlflow_di.lock") != f"{key} {tags.get(HOLDER)}":
            return
        children = client.search_runs([run.info.experiment_id],
                                       f"tags.`mlflow.parentRunId` = '{run_id}' and attributes.status = 'RUNNING'")
        for dead in [*children, run]:
            client.set_tag(dead.info.run_id, "mlflow_di.killed_reason", reason)
            client.set_terminated(dead.info.run_id, "KILLED")


def _confirmed(client, key: str, holder: dict) -> bool:
    """Whether the lock still names ``holder`` a moment after it was created (another process that took a stale
    lock over at the same time may have replaced it)."""
    time.sleep(0.2)
    tags = _tags(client, key)
    return tags is not None and tags.get(HOLDER) == holder[HOLDER]


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
    if tags is not None and tags.get(HOLDER) == holder[HOLDER]:
        with contextlib.suppress(MlflowException, OSError):
            client.delete_registered_model(key)


def _busy_line(name: str, version, key: str, tags: dict) -> str:
    who = tags.get("mlflow_di.lock.command", "another mlflow-di process")
    where = f"process {tags.get('mlflow_di.lock.pid', '?')} on {tags.get('mlflow_di.lock.host', '?')}"
    run = f", run {tags['mlflow_di.lock.run_id']}" if tags.get("mlflow_di.lock.run_id") else ""
    return (f"models:/{name}/{version} is being judged by `{who}` ({where}{run}, since "
            f"{tags.get('mlflow_di.lock.since', '?')}); try again when it is done (a lock whose holder died is taken "
            f"over at once on its own host, after {STALE_S / 60:.0f} minutes without a heartbeat elsewhere, or delete "
            f"the registered model {key})")
