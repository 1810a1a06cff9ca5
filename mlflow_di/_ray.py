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
    cluster is used and left running. ``num_cpus`` caps a ``local`` cluster (default: every core).
    """
    # before Ray is imported: no usage statistics sent anywhere, and a local cluster on the loopback address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address == LOCAL:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise UserError("running on Ray needs the ray extra: pip install 'mlflow-di[ray]'") from None
    if ray.is_initialized():
        return ray, False
    kwargs = dict(include_dashboard=False, configure_logging=False, log_to_driver=False)
    if address == LOCAL and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    try:
        ray.init(address=address, **kwargs)  # "local", "auto" and HOST:PORT are Ray's own address forms
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(f"cannot start or join Ray at '{address}': {first_line(exc)}") from None
    return ray, True


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type's name)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
