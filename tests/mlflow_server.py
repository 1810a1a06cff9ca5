"""Test helpers: a real ``mlflow server`` on 127.0.0.1, and runs recorded as mlflow-di commands record them.

The server runs from this venv (``sys.executable -m mlflow server``) with a sqlite backend and a
local artifact store in a temporary folder, one worker and no job runner, in its own process
group so stopping it stops every process it started. Nothing here contacts any address but
127.0.0.1.
"""
from __future__ import annotations

import configparser
import dataclasses
import json
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

START_TIMEOUT = 120.0  # seconds; a cold start takes ~15-25 s on two busy cores
LOCAL_ONLY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class MlflowServer:
    """A running tracking server: ``url`` to use, ``stop()`` when done, ``log()`` when it misbehaves."""

    url: str
    process: subprocess.Popen
    log_path: pathlib.Path
    admin: tuple[str, str] | None = None  # (user, password) of a basic-auth server

    def log(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after ``grace`` seconds."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        except ProcessLookupError:
            pass


def _healthy(url: str) -> bool:
    try:
        with LOCAL_ONLY.open(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def write_auth_config(folder: pathlib.Path) -> tuple[pathlib.Path, tuple[str, str]]:
    """A basic-auth ini with our own admin password and a sqlite user store in ``folder``."""
    admin = ("admin", secrets.token_urlsafe(16))
    config = configparser.ConfigParser()
    config["mlflow"] = {
        "default_permission": "READ",
        "database_uri": f"sqlite:///{folder / 'basic_auth.db'}",
        "admin_username": admin[0],
        "admin_password": admin[1],
        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
        # cache verified credentials: otherwise every request pays a PBKDF2 hash (~0.5 s on a busy core)
        "auth_cache_ttl_seconds": "300",
    }
    path = folder / "basic_auth.ini"
    with path.open("w") as handle:
        config.write(handle)
    return path, admin


def start_server(folder: pathlib.Path, basic_auth: bool = False, timeout: float = START_TIMEOUT,
                 extra_env: dict | None = None, port: int | None = None) -> MlflowServer:
    """Start ``mlflow server`` storing everything in ``folder``; return once ``/health`` answers OK.
    ``extra_env``: more environment for the server (e.g. the ``MLFLOW_WEBHOOK_*`` settings); ``port``: the
    port to listen on (default: a free one).

    Raises RuntimeError with the server's log when it exits or stays unhealthy for ``timeout`` s.
    """
    folder.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    env.update(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.update(extra_env or {})
    admin = None
    extra = []
    if basic_auth:
        config_path, admin = write_auth_config(folder)
        env.update(MLFLOW_AUTH_CONFIG_PATH=str(config_path), MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16))
        extra = ["--app-name", "basic-auth"]
    port = port or free_port()  # a server started again on the same folder and port is "back"
    url = f"http://127.0.0.1:{port}"
    log_path = folder / "server.log"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
               "--serve-artifacts", "--artifacts-destination", str(folder / "artifacts"), *extra]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, cwd=folder, start_new_session=True)
    server = MlflowServer(url, process, log_path, admin)
    deadline = time.monotonic() + timeout
    delay = 0.1
    while not _healthy(url):
        if not server.alive():
            raise RuntimeError(f"mlflow server exited with code {process.returncode} before answering "
                               f"{url}/health; its log:\n{server.log()}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"mlflow server at {url} not healthy after {timeout:.0f} s; its log:\n{server.log()}")
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)  # poll often at first, then once a second
    return server


_RUNNING: dict[str, MlflowServer] = {}


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, request) -> MlflowServer:
    """One plain tracking server for the whole session, shared by every test module that imports
    this fixture (each module gets its own fixture instance; the first one starts and stops it)."""
    server = _RUNNING.get("plain")
    if server is None or not server.alive():
        server = start_server(tmp_path_factory.mktemp("mlflow-server"))
        _RUNNING["plain"] = server
        request.addfinalizer(server.stop)
    return server


@pytest.fixture()
def use_server(monkeypatch):
    """Point MLflow at a server for one test: ``use_server(server, user=None, password=None)`` -> client."""
    import mlflow
    import mlflow.tracking.fluent as fluent
    from mlflow import MlflowClient

    def use(server: MlflowServer, user: str | None = None, password: str | None = None):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        for name, value in (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        mlflow.set_tracking_uri(server.url)
        fluent._active_experiment_id = None
        return MlflowClient(server.url)

    yield use
    while mlflow.active_run():
        mlflow.end_run()
    fluent._active_experiment_id = None
    mlflow.set_tracking_uri(None)


# ------------------------------------------------------------------------ recorded runs
def as_recorded(metrics: dict) -> dict:
    """``metrics`` as the commands record them: every gated figure (a check's run metric, also prefixed
    ``held_out.``/``reference.`` or suffixed ``.SLUG``) with its 95% interval beside it. A figure given without
    one gets a degenerate interval (its value at both ends, n 10000), so tests of which run the gate reads
    judge the value alone; tests of intervals give ``NAME_low``/``_high``/``_n`` themselves. IDC's ``idc``
    is also recorded as ``idc_reachable`` (what the gate judges) unless given."""
    import math

    from mlflow_di.gate import CHECKS

    gated = {check.run_metric for check in CHECKS.values() if check.sample}
    out = dict(metrics)
    if "idc" in out and "idc_reachable" not in out:
        out["idc_reachable"] = out["idc"]
    for key, value in list(out.items()):
        base = key.removeprefix("held_out.").removeprefix("reference.").split(".", 1)[0]
        if base in gated and f"{key}_low" not in out and isinstance(value, (int, float)) and math.isfinite(value):
            out.update({f"{key}_low": value, f"{key}_high": value, f"{key}_n": 10000})
    return out


def record_run(client, experiment_id: str, command: str, subject=None, metrics: dict | None = None,
               tags: dict | None = None, status: str = "FINISHED", start_time: int | None = None,
               sized: bool = True) -> str:
    """A run as ``mlflow-di COMMAND`` records it (the contract's tags) about model version ``subject``;
    its gated figures with intervals (:func:`as_recorded`) unless ``sized`` is False (an older mlflow-di)."""
    metrics = as_recorded(metrics or {}) if sized else metrics
    run_tags = {"mlflow_di.command": command, "mlflow_di.version": "test"}
    if subject is not None:
        run_tags.update({"mlflow_di.model_name": subject.name, "mlflow_di.model_version": str(subject.version),
                         "mlflow_di.model_uri": f"models:/{subject.name}/{subject.version}"})
    run_tags.update(tags or {})
    run = client.create_run(experiment_id, start_time=start_time, tags=run_tags)
    for key, value in (metrics or {}).items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id, status=status)
    return run.info.run_id


def fuzz_tags(compressed) -> dict:
    """Tags of a fuzz run against the registered compressed version ``compressed``."""
    return {"mlflow_di.compressed_uri": f"models:/{compressed.name}/{compressed.version}",
            "mlflow_di.compressed_name": compressed.name, "mlflow_di.compressed_version": str(compressed.version)}


def register_version(client, name: str, run_id: str | None = None):
    """A registered model version (creating the model if needed) whose source is ``run_id``'s model
    (a new, empty run in the Default experiment when None: a server accepts only sources of real runs)."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    if run_id is None:
        run_id = client.create_run("0", tags={"mlflow.runName": f"train {name}"}).info.run_id
        client.set_terminated(run_id)
    return client.create_model_version(name, source=f"runs:/{run_id}/model", run_id=run_id)


@dataclasses.dataclass
class RecordedModel:
    """A subject version with a history of coverage, compress and fuzz runs (see :func:`record_history`)."""

    subject: object
    compressed: object
    other_compressed: object
    uri: str


def record_history(client, experiment_id: str, name: str, t0: int = 1_700_000_000_000) -> RecordedModel:
    """``models:/NAME/1`` with: coverage idc 0.40 (old), 0.62 (newest FINISHED), 0.99 (newer but FAILED);
    ``NAME-int8/1`` compressed from it (accuracy_drop 0.004, max_class_accuracy_drop 0.02,
    disagreement_rate 0.008) and fuzzed (success_rate 0.30, mean_queries 120, after an older 0.9/10
    run); ``NAME-prune/1`` compressed (accuracy_drop 0.05, max_class_accuracy_drop 0.2,
    disagreement_rate 0.1) and fuzzed (0.8, 40).
    Robustness: one run of both exports (worst-cell agreement int8 0.90, prune 0.60), then a newer one
    of int8 alone (0.95)."""
    subject = register_version(client, name)
    record_run(client, experiment_id, "coverage", subject, {"idc": 0.40}, start_time=t0)
    record_run(client, experiment_id, "coverage", subject, {"idc": 0.62, "nc": 0.9}, start_time=t0 + 10)
    record_run(client, experiment_id, "coverage", subject, {"idc": 0.99}, status="FAILED", start_time=t0 + 20)
    record_run(client, experiment_id, "coverage", register_version(client, name), {"idc": 0.95}, start_time=t0 + 30)
    compressed = {}
    for offset, (method, drop, class_drop, old, new) in enumerate([("int8", 0.004, 0.02, (0.9, 10.0), (0.30, 120.0)),
                                                                    ("prune", 0.05, 0.2, None, (0.8, 40.0))]):
        compressed[method] = record_export(client, experiment_id, subject, method, {
            "accuracy_drop": drop, "max_class_accuracy_drop": class_drop, "disagreement_rate": 2 * drop},
            [old, new], t0 + offset)
    uris = {method: f"models:/{version.name}/{version.version}" for method, version in compressed.items()}
    for step, measured in enumerate([{"int8": 0.90, "prune": 0.60}, {"int8": 0.95}]):
        slugs = {uris[method]: f"{name}-{method}_1" for method in measured}
        metrics = {f"robustness_agreement_min.{slugs[uris[method]]}": value for method, value in measured.items()}
        metrics["robustness_agreement_min"] = min(measured.values())
        record_run(client, experiment_id, "robustness", subject, metrics,
                   tags={"mlflow_di.robustness_compressed": json.dumps(slugs)}, start_time=t0 + 300 + step)
    return RecordedModel(subject, compressed["int8"], compressed["prune"], f"models:/{name}/1")


def record_export(client, experiment_id: str, subject, method: str, compress_metrics: dict, fuzzed: list,
                  t0: int = 1_700_000_000_000):
    """``SUBJECT_NAME-METHOD``: a new version registered from a compress run of ``subject`` (version
    tag ``mlflow_di.method`` as compress writes it), then one fuzz run per (success_rate, mean_queries)
    of ``fuzzed`` (None: skipped), oldest first."""
    run_id = record_run(client, experiment_id, "compress", subject, compress_metrics,
                        tags={"mlflow_di.method": method}, start_time=t0 + 100)
    version = register_version(client, f"{subject.name}-{method}", run_id)
    client.set_model_version_tag(version.name, version.version, "mlflow_di.method", method)
    for step, values in enumerate(fuzzed):
        if values is not None:
            record_run(client, experiment_id, "fuzz", subject,
                       {"success_rate": values[0], "mean_queries": values[1], "triggers": 5},
                       tags=fuzz_tags(version), start_time=t0 + 200 + step)
    return version


def record_candidate(client, experiment_id: str, name: str, idc: float | None, exports: dict,
                     t0: int = 1_750_000_000_000):
    """A new version of NAME with one coverage run (``idc``; None: none) and, per ``exports``
    entry ``method: (success_rate, mean_queries)``, an export compressed from it (accuracy_drop
    0.01) and fuzzed once: a candidate or a baseline for ``gate --baseline``."""
    subject = register_version(client, name)
    if idc is not None:
        record_run(client, experiment_id, "coverage", subject, {"idc": idc}, start_time=t0)
    for offset, (method, fuzz) in enumerate(exports.items()):
        record_export(client, experiment_id, subject, method, {"accuracy_drop": 0.01}, [fuzz], t0 + offset)
    return subject


# ------------------------------------------------------------------------------ the gate command
#: Thresholds that the history of :func:`record_history` passes.
PASSING = ["--min-idc", "0.6", "--max-success-rate", "0.85", "--min-mean-queries", "30", "--max-accuracy-drop", "0.06"]


def run_gate(capsys, *args) -> tuple[int, str, str]:
    """``mlflow-di gate ARGS`` in process: (exit code, stdout, stderr)."""
    from mlflow_di import cli

    code = cli.main(["gate", *args])
    out, err = capsys.readouterr()
    return code, out, err

