"""``serve --ray-address``: each job's pipeline in an actor on a local multi-node Ray cluster (started by
tests/ray_cluster.py in its own process). A new version is gated end to end; a SIGTERM of the service
leaves no pipeline running; a restarted service resumes the job; an actor killed mid-job is retried by
the queue's rules; an address where no cluster listens is one line at start."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from mlflow_di import processes
from tests.conftest import REPO
from tests.test_serve import TINY, _get, _register, _wait, job_state_in_queue
from mlflow_server import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (mlflow-di[ray])")]


def _processes_with(text: str) -> list[int]:
    """Pids of this user's processes whose command line contains ``text``."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture
def ray_cluster(tmp_path):
    """The address of a cluster of a head without CPUs and one 2-CPU node; shut down (its processes with it) after."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    process = subprocess.Popen([sys.executable, "-m", "tests.ray_cluster", "2"], cwd=tmp_path, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("{"), "the cluster did not start"
        yield json.loads(line)["address"]
    finally:
        process.stdin.close()  # the script shuts its cluster down
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_an_address_where_no_cluster_listens_is_one_line_at_start(tmp_path):
    policy = tmp_path / "tiny.yaml"
    policy.write_text(TINY)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    started = time.monotonic()
    refused = subprocess.run([sys.executable, "-m", "mlflow_di.cli", "serve", "--policy", str(policy), "--state-dir",
                              str(tmp_path / "service"), "--port", str(free_port()), "--ray-address",
                              f"127.0.0.1:{free_port()}"], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    assert "cannot reach the Ray cluster at '127.0.0.1:" in lines[0] and "ray start --head" in lines[0]
    assert time.monotonic() - started < 60  # Ray's own connect waits minutes on such an address


def test_the_service_runs_each_pipeline_on_the_cluster_stops_it_and_retries_a_lost_actor(tmp_path, ray_cluster,
                                                                                       monkeypatch):
    policy = tmp_path / "tiny.yaml"
    policy.write_text(TINY)
    port, state = free_port(), tmp_path / "service"
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    log = tmp_path / "service.log"
    services = []

    def start():
        with log.open("a") as out:
            process = subprocess.Popen([sys.executable, "-m", "mlflow_di.cli", "serve", "--policy", str(policy),
                                        "--state-dir", str(state), "--port", str(port), "--ray-address", ray_cluster,
                                        "--poll-seconds", "1", "--retry-backoff", "1", "--backfill"], env=env,
                                       cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        services.append(process)
        _wait("/health", lambda: _get(f"{url}/health")["status"] == "ok", 120, process, log)
        return process

    def job(version: str) -> dict | None:
        return next((j for j in _get(f"{url}/jobs")["jobs"] if (j["model"], j["version"]) == ("svc", version)), None)

    def ended(version: str):
        found = job(version)
        return found and found["state"] in ("passed", "failed", "error", "inconclusive") and found

    try:
        _register("svc")
        service = start()
        health = _get(f"{url}/health")
        assert health["ray_address"] == ray_cluster and health["workers"] == 2  # the node's 2 CPUs, 1 per job
        assert "pipelines on Ray at" in log.read_text()

        # 1. a version gated end to end by a pipeline on the cluster's node
        first = _wait("svc/1 gated", lambda: ended("1"), 300, service, log)
        job_log = (state / "logs" / "svc-1.log").read_text()
        assert first["state"] in ("passed", "failed"), job_log[-3000:]
        assert "on Ray node" in job_log and "the service's folder, seen from this node" in job_log
        assert "pipeline run" in job_log and "verdict" in job_log  # the pipeline's output came back through the actor
        assert json.loads((state / "pipelines" / "svc-1" / "state.json").read_text())["done"]["gate"]

        # 2. SIGTERM mid-job: the pipeline on the cluster is stopped (no orphan), the job stays running
        _register("svc")
        pipeline_folder = state / "pipelines" / "svc-2"
        _wait("svc/2 compressed", lambda: "compress" in json.loads((pipeline_folder / "state.json").read_text())["done"],
              300, service, log)
        assert _processes_with(f"--state-dir {pipeline_folder}")
        os.kill(service.pid, signal.SIGTERM)
        assert service.wait(90) == 0, log.read_text()[-3000:]
        assert not _processes_with(f"--state-dir {pipeline_folder}")
        assert job_state_in_queue(state, "2") == "running"

        # 3. restarted: the job runs again and resumes; its actor killed mid-run is a lost attempt, retried
        service = start()
        job_log = state / "logs" / "svc-2.log"

        def pipeline_pid_of_this_attempt():
            attempt = job_log.read_text().rsplit("=== attempt", 1)[-1]
            found = re.search(r"pipeline pid (\d+)", attempt)
            return found and int(found.group(1))

        pipeline = _wait("svc/2's pipeline running again", pipeline_pid_of_this_attempt, 120, service, log)
        for pid in _processes_with("ray::PipelineProcess"):
            os.kill(pid, signal.SIGKILL)
        # its pipeline is told to stop when its actor's process dies (no orphan on the node)
        _wait("the lost actor's pipeline gone", lambda: not processes.alive(pipeline), 60, service, log)
        second = _wait("svc/2 gated", lambda: ended("2"), 300, service, log)
        text = (state / "logs" / "svc-2.log").read_text()
        assert second["state"] in ("passed", "failed"), text[-3000:]
        assert second["attempts"] == 2, second  # the lost actor's attempt, then the one that finished
        assert "resuming from" in text and "compress: finished earlier, skipped" in text
        assert "the Ray actor running the pipeline was lost" in log.read_text()
        os.kill(service.pid, signal.SIGTERM)
        assert service.wait(90) == 0, log.read_text()[-3000:]
    finally:
        for process in services:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
