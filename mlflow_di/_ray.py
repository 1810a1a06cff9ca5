"""Ray for every command that spreads work (``fuzz --workers``, ``coverage --workers``): addresses and connecting.

A ``local`` cluster is started on this machine bound to the loopback address, without its
dashboard and without usage statistics; ``auto`` and ``[ray://]HOST:PORT`` join a running one.
Ray is imported only here and inside the engines' Ray modules, never at the top of a module.
"""
from __future__ import annotations

import os
import re

from mlflow_di.errors import UserError

#: ``--ray-address`` values besides ``ray://HOST:PORT`` and ``HOST:PORT``.
LOCAL, AUTO = "local", "auto"
_ADDRESS = re.compile(r"(ray://)?[A-Za-z0-9_.-]+:\d+")


def check_address(address: str | None) -> str:
    """``address`` normalised: ``local`` (a new cluster on this machine), ``auto`` (the running one) or ``[ray://]HOST:PORT``."""
    value = LOCAL if address is None else str(address).strip()
    if value in (LOCAL, AUTO) or _ADDRESS.fullmatch(value):
        return value
    raise UserError(f"bad Ray address '{address}'; give local (start Ray on this machine), auto (the cluster "
                    "this machine belongs to) or ray://HOST:PORT")


def check_workers(workers: int, cpus_per_worker: float, gpus_per_worker: float, what: str) -> None:
    """One-line errors for worker settings no Ray pool can have (``what``: the work, for the message)."""
    if workers < 1:
        raise UserError(f"{what} on Ray needs at least 1 worker, got {workers}")
    if cpus_per_worker < 0 or gpus_per_worker < 0:
        raise UserError("--cpus-per-worker and --gpus-per-worker must not be negative")


def connect(address: str, num_cpus: int | None = None):
    """Ray, initialised for ``address``; True when this call started it (and should stop it).

    When Ray is already initialised in this process (a test session's cluster, a notebook), that
    cluster is used and left running; an address where nothing listens is refused even then, so a
    mistyped address is never silently taken for the cluster already joined. ``num_cpus`` caps a
    ``local`` cluster (default: every core).
    """
    # before Ray is imported: no usage statistics sent anywhere, and a local cluster on the loopback address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address == LOCAL or _on_loopback(address):  # Ray would swap a loopback host for this machine's address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise UserError("running on Ray needs the ray extra: pip install 'mlflow-di[ray]'") from None
    unreachable = _unreachable(address)
    if unreachable:
        raise UserError(f"cannot reach the Ray cluster at '{address}': {unreachable} (start it with `ray start --head`, "
                        "or pass the address its head printed)")
    if ray.is_initialized():
        return ray, False
    kwargs = dict(include_dashboard=False, configure_logging=False, log_to_driver=False)
    if address == LOCAL and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ours = _sigterm_handler()
    try:
        ray.init(address=address, **kwargs)  # "local", "auto" and HOST:PORT are Ray's own address forms
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(f"cannot start or join Ray at '{address}': {first_line(exc)}") from None
    finally:
        _restore_sigterm(ours)
    return ray, True


#: Seconds a cluster's head gets to accept a connection before the address is called unreachable.
REACH_TIMEOUT_S = 5.0


def _unreachable(address: str) -> str:
    """Why nothing listens at a ``[ray://]HOST:PORT`` address ('' when something does, or for ``local``/``auto``).

    Checked before ``ray.init``, which waits minutes on an address where no head listens.
    """
    import socket

    if address in (LOCAL, AUTO):
        return ""
    host, port = _host_and_port(address)
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return ""


def _sigterm_handler():
    """This process's SIGTERM handler (None off the main thread, where none can be set)."""
    import signal
    import threading

    return signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None


def _restore_sigterm(handler) -> None:
    """Put back the SIGTERM handler ``ray.init`` replaced with ``sys.exit(15)`` (and its native one): a command
    terminated while on Ray stops as it does without Ray (finished work kept, its run KILLED, exit 143)."""
    import signal

    if handler is not None:
        signal.signal(signal.SIGTERM, handler)


def _on_loopback(address: str) -> bool:
    """Whether ``address`` is ``[ray://]HOST:PORT`` with a loopback host (a cluster started on this machine's
    loopback address, as ``local`` and the tests' clusters are)."""
    if address in (LOCAL, AUTO):
        return False
    host = _host_and_port(address)[0]
    return host in ("localhost", "::1") or host.startswith("127.")


def _host_and_port(address: str) -> tuple[str, str]:
    """(host, port) of a ``[ray://]HOST:PORT`` address (one :func:`check_address` accepted)."""
    host, port = address.removeprefix("ray://").rsplit(":", 1)
    return host, port


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type's name)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
