"""mlflow-di serve: the durable queue (one job per version, atomic claims, backoff, recovery),
MLflow's webhook signature, the workers' exit-code rules, a bad policy refused at start, and the
service end to end against a real ``mlflow server`` (webhook delivery, a bad signature refused,
a service killed mid-job resuming the job once)."""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from mlflow_di.cli import main
from mlflow_di.service import signature
from mlflow_di.service.queue import JobQueue, backoff_delay, outcome
from mlflow_di.service.worker import Runner, last_error_line, stop_orphan

from mlflow_server import free_port, start_server, use_server  # noqa: F401  (fixture)

REPO = pathlib.Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------------ the queue
def test_a_queue_file_from_before_inconclusive_is_migrated_with_its_jobs(tmp_path):
    """The jobs table's CHECK had no 'inconclusive': opening the file rebuilds the table, rows kept."""
    import sqlite3

    from mlflow_di.service.queue import _SCHEMA

    path = tmp_path / "jobs.sqlite"
    old = sqlite3.connect(path)
    old.executescript(_SCHEMA.replace(", 'inconclusive'", ""))
    old.execute("INSERT INTO jobs (model, version, state, next_attempt_at, created_at, updated_at) "
                "VALUES ('m', '1', 'failed', 0, 0, 0)")
    old.commit()
    old.close()
    queue = JobQueue(path)
    assert queue.job(1).state == "failed" and queue.enqueue("m", "2") is True
    queue.finish(queue.claim().id, "inconclusive", 3, "the evidence could not decide disagreement_rate")
    assert queue.counts()["inconclusive"] == 1 and queue.counts()["failed"] == 1
    queue.close()
    assert JobQueue(path).counts()["inconclusive"] == 1  # opened again: nothing to migrate


def test_a_version_is_queued_once_ever(tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite")
    assert queue.enqueue("m", "1", "webhook") is True
    assert queue.enqueue("m", "1", "poll") is False  # the poller saw it too
    assert queue.enqueue("m", 2, "poll") is True and queue.enqueue("other", "1") is True
    job = queue.claim()
    queue.finish(job.id, "passed", 0)
    assert queue.enqueue("m", "1", "webhook") is False  # not even after it finished
    assert [(j.model, j.version, j.source) for j in queue.jobs()] == [("m", "1", "webhook"), ("m", "2", "poll"),
                                                                      ("other", "1", "")]
    assert queue.counts() == {"queued": 2, "running": 0, "passed": 1, "failed": 0, "inconclusive": 0, "error": 0}
    queue.close()
    again = JobQueue(tmp_path / "jobs.sqlite")  # durable
    assert again.find("m", "1").state == "passed" and again.enqueue("m", "1") is False


def test_claims_are_atomic_across_threads_and_connections(tmp_path):
    path = tmp_path / "jobs.sqlite"
    first, second = JobQueue(path), JobQueue(path)
    for number in range(60):
        first.enqueue("m", str(number))
    claimed, lock = [], threading.Lock()

    def take(queue):
        while (job := queue.claim()) is not None:
            with lock:
                claimed.append(job.id)

    threads = [threading.Thread(target=take, args=(queue,)) for queue in (first, second) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == sorted(set(claimed)) and len(claimed) == 60
    assert all(job.state == "running" and job.attempts == 1 for job in first.jobs())


def test_a_crashing_job_is_retried_with_backoff_then_an_error(tmp_path):
    clock = Clock()
    queue = JobQueue(tmp_path / "jobs.sqlite", clock=clock)
    queue.enqueue("m", "1")
    job = queue.claim()
    job = queue.retry(job.id, -9, "killed", max_attempts=3, base_delay=10)
    assert job.state == "queued" and job.next_attempt_at == 1010 and job.exit_code == -9
    assert queue.claim() is None  # not due yet
    clock.now = 1010
    job = queue.claim()
    assert job.attempts == 2
    job = queue.retry(job.id, 3, "crashed", max_attempts=3, base_delay=10)
    assert job.next_attempt_at == 1010 + 20  # doubled
    clock.now = 1030
    job = queue.retry(queue.claim().id, 3, "crashed", max_attempts=3, base_delay=10)
    assert job.state == "error" and "gave up after 3 attempts" in job.message
    assert queue.claim() is None
    assert [backoff_delay(n, 30) for n in (1, 2, 3)] == [30, 60, 120] and backoff_delay(30, 30) == 3600


def test_jobs_left_running_by_a_dead_service_run_again(tmp_path):
    path = tmp_path / "jobs.sqlite"
    dead = JobQueue(path)
    dead.enqueue("m", "1")
    dead.enqueue("m", "2")
    job = dead.claim()
    dead.set_pid(job.id, 4242)  # ... and the service is killed here
    restarted = JobQueue(path)
    left = restarted.recover()
    assert [(j.version, j.state, j.pid) for j in left] == [("1", "running", 4242)]
    job = restarted.job(job.id)
    assert job.state == "queued" and job.attempts == 0 and job.pid is None  # the interrupted run does not count
    assert restarted.claim().version == "1"  # due at once, before the younger job
    assert restarted.recover()[0].version == "1" and restarted.recover() == []


def test_final_states_and_the_tags_they_call_for(tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite")
    queue.enqueue("m", "1")
    assert [job.tag_mark for job in queue.untagged()] == ["queued/0"]
    queue.mark_tagged(1, "queued/0")
    assert queue.untagged() == []
    job = queue.claim()
    assert [j.tag_mark for j in queue.untagged()] == ["running/1"]
    queue.finish(job.id, "failed", 1, "gate said no")
    assert queue.job(job.id).state == "failed" and queue.claim() is None
    with pytest.raises(ValueError):
        queue.finish(job.id, "running")
    assert [outcome(code) for code in (0, 1, 2, 3, 4, -9, 130, 143)] == \
        ["passed", "failed", "error", "inconclusive", "retry", "retry", "retry", "retry"]
    first = queue.first_started_at()
    assert queue.first_started_at() == first  # recorded once


# ------------------------------------------------------------------------------ the workers
def _runner(tmp_path, queue, code_for, stop=None, **kwargs):
    lines = []
    runner = Runner(queue, argv=lambda job: [sys.executable, "-c", code_for(job)],
                    log_path=lambda job: tmp_path / "logs" / f"{job.model}-{job.version}.log", max_attempts=2,
                    backoff_s=0, stop=stop or threading.Event(), report=lambda job, text: lines.append(f"{job.key} {text}"),
                    **kwargs)
    return runner, lines


def test_exit_codes_decide_the_job(tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite")
    codes = {"1": 0, "2": 1, "3": 2, "4": 4, "5": 3}
    for version in codes:
        queue.enqueue("m", version)
    runner, lines = _runner(tmp_path, queue, lambda job: f"import sys; print('pipeline of {job.key}'); "
                            f"print('mlflow-di: error: models:/m/{job.version} has no such layer', file=sys.stderr); "
                            f"raise SystemExit({codes[job.version]})")
    while (job := queue.claim()) is not None:
        runner.run(job)
    states = {job.version: (job.state, job.attempts) for job in queue.jobs()}
    assert states == {"1": ("passed", 1), "2": ("failed", 1), "3": ("error", 1), "4": ("error", 2),  # 4: retried once
                      "5": ("inconclusive", 1)}
    assert queue.find("m", "3").message == "pipeline exited with code 2: models:/m/3 has no such layer"  # in /jobs
    assert "pipeline of m/4" in (tmp_path / "logs" / "m-4.log").read_text()
    assert (tmp_path / "logs" / "m-4.log").read_text().count("=== attempt") == 2
    assert any("m/4 queued again: pipeline exited with code 4" in line for line in lines)


def test_the_cause_of_an_error_is_the_last_attempts_own(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("\n=== attempt 1 at T\nmlflow-di: error: the model cannot be loaded\n"
                   "\n=== attempt 2 at T\nSegmentation fault\n")
    assert last_error_line(log) == ""  # the crash of attempt 2 is not attempt 1's cause
    log.write_text(log.read_text() + "\n=== attempt 3 at T\nmlflow-di: error: a\nmlflow-di: error: b\n")
    assert last_error_line(log) == "b"


def test_stopping_the_service_stops_the_pipeline_and_leaves_its_job_running(tmp_path):
    queue = JobQueue(tmp_path / "jobs.sqlite")
    queue.enqueue("m", "1")
    stop = threading.Event()
    runner, lines = _runner(tmp_path, queue, lambda job: "import time; print('started', flush=True); time.sleep(60)", stop)
    worker = threading.Thread(target=runner.loop)
    worker.start()
    deadline = time.monotonic() + 30
    while "started" not in ((tmp_path / "logs" / "m-1.log").read_text() if (tmp_path / "logs" / "m-1.log").exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    pid = queue.find("m", "1").pid
    stop.set()
    worker.join(30)
    assert not worker.is_alive() and queue.find("m", "1").state == "running"
    assert not pathlib.Path(f"/proc/{pid}").exists() or "Z" in pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]


def test_an_orphaned_pipeline_is_stopped_only_when_it_is_ours(tmp_path):
    marker = str(tmp_path / "pipelines" / "m-1")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker], start_new_session=True)
    try:
        cmdline, deadline = pathlib.Path(f"/proc/{child.pid}/cmdline"), time.monotonic() + 30
        while marker.encode() not in cmdline.read_bytes():  # empty while the child is still exec-ing
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert stop_orphan(child.pid, str(tmp_path / "pipelines" / "m-2")) is False  # someone else's
        assert child.poll() is None
        assert stop_orphan(child.pid, marker, grace=5) is True
        assert child.wait(10) is not None
    finally:
        if child.poll() is None:
            child.kill()


# ------------------------------------------------------------------------------ signatures
def _delivery(secret: str, body: bytes, timestamp: int | None = None, delivery_id: str | None = None) -> dict:
    """Headers as MLflow's own delivery code signs them (its private helper, so a change of scheme shows here)."""
    from mlflow.webhooks.delivery import _generate_hmac_signature

    delivery_id = delivery_id or str(uuid.uuid4())
    timestamp = str(int(time.time()) if timestamp is None else timestamp)
    return {signature.DELIVERY_ID_HEADER: delivery_id, signature.TIMESTAMP_HEADER: timestamp,
            signature.SIGNATURE_HEADER: _generate_hmac_signature(secret, delivery_id, timestamp, body.decode())}


class Headers(dict):
    """Case-insensitive ``get`` like ``http.client.HTTPMessage``."""

    def get(self, key, default=None):
        return next((value for name, value in self.items() if name.lower() == key.lower()), default)


def test_mlflow_signatures_are_verified():
    body = json.dumps({"entity": "model_version", "action": "created", "data": {"name": "m", "version": "1"}}).encode()
    headers = Headers(_delivery("s3cret", body))
    assert signature.check("s3cret", headers, body) is None
    assert signature.sign("s3cret", headers.get(signature.DELIVERY_ID_HEADER), headers.get(signature.TIMESTAMP_HEADER),
                          body) == headers.get(signature.SIGNATURE_HEADER)
    lower = Headers({name.lower(): value for name, value in headers.items()})
    assert signature.check("s3cret", lower, body) is None
    rotated = Headers({**headers, signature.SIGNATURE_HEADER: "v1,b2xk " + headers[signature.SIGNATURE_HEADER]})
    assert signature.check("s3cret", rotated, body) is None
    assert "does not match" in signature.check("other", headers, body)
    assert "does not match" in signature.check("s3cret", headers, body.replace(b'"1"', b'"2"'))
    forged_id = Headers({**headers, signature.DELIVERY_ID_HEADER: str(uuid.uuid4())})
    assert "does not match" in signature.check("s3cret", forged_id, body)
    for header in (signature.SIGNATURE_HEADER, signature.TIMESTAMP_HEADER, signature.DELIVERY_ID_HEADER):
        assert signature.check("s3cret", Headers({k: v for k, v in headers.items() if k != header}), body) == \
            f"no {header} header"
    old = Headers(_delivery("s3cret", body, timestamp=int(time.time()) - 3600))
    assert "replay" in signature.check("s3cret", old, body)
    assert "Unix seconds" in signature.check("s3cret", Headers({**headers, signature.TIMESTAMP_HEADER: "soon"}), body)


# ------------------------------------------------------------------------------ refused at start
def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_policy_with_a_mistake_is_refused_before_any_port_is_bound(tmp_path, capsys):
    policy = tmp_path / "policy.yaml"
    policy.write_text("gate: {thresholds: {min_idc: 0.5}}\ncompress: {methods: [int8-dynamic], amout: 0.2}\n")
    port = free_port()
    code = main(["serve", "--policy", str(policy), "--port", str(port), "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    import dataclasses

    from mlflow_di.compression.declarations import method_options
    from mlflow_di.policy import CompressPolicy

    # the section's own keys, then every declared method's own options (int8-static's recipe, ...)
    known = ", ".join([*(field.name for field in dataclasses.fields(CompressPolicy) if field.name != "method_options"),
                       *method_options()])
    assert known.startswith("methods, calib_data, eval_data, amount, ")
    assert known.endswith(", recipe, calibration, per_tensor, activation_symmetry, weight_symmetry")
    assert code == 2 and err.splitlines() == [f"mlflow-di: error: policy.yaml: unknown key compress.amout; known: {known}"]
    assert not (tmp_path / "state").exists() and _port_is_free(port)


def test_a_port_in_use_or_a_state_folder_in_use_is_refused(tmp_path, tracking_uri, capsys):
    import fcntl

    policy = tmp_path / "ok.yaml"
    policy.write_text("gate: {thresholds: {min_idc: 0.5}}\n")
    argv = ["serve", "--policy", str(policy), "--state-dir", str(tmp_path / "state"), "--poll-seconds", "1"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([*argv, "--port", str(port)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"mlflow-di: error: cannot listen on 127.0.0.1:{port}: "
                                                    "Address already in use (pass another --port)"]
    with (tmp_path / "state" / "serve.lock").open("a+") as lock:  # as a running service holds it
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main([*argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "another mlflow-di process" in err and "mlflow-di serve" in err and "--state-dir" in err and len(err.splitlines()) == 1


def test_a_service_stopped_in_process_gives_the_signal_handlers_back(tmp_path, tracking_uri, python_ctrl_c):
    """``wait`` ignores SIGINT and SIGTERM while it cleans up (a second Ctrl-C must not cut that short),
    then puts back the handlers it found: a process that served in-process goes on with its own."""
    import signal

    from mlflow_di.commands.serve import Service

    policy = tmp_path / "ok.yaml"
    policy.write_text("gate: {thresholds: {min_idc: 0.5}}\n")
    service = Service(tmp_path / "state", str(policy), (), workers=1, max_attempts=1, backoff_s=0.0, secret=None,
                      poll_seconds=0, backfill=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    service.start("127.0.0.1", 0, None)
    service.stop.set()
    service.wait()
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN


# ------------------------------------------------------------------------------ the registry side
def test_the_poller_sees_new_versions_only_and_never_exports(mlflow_client):
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import watch
    from mlflow_server import record_run, register_version

    register_version(mlflow_client, "m")  # before the service first started
    time.sleep(0.05)
    since = int(time.time() * 1000)
    subject = register_version(mlflow_client, "m")
    register_version(mlflow_client, "n")
    compress_run = record_run(mlflow_client, "0", "compress", subject)
    register_version(mlflow_client, "m-int8", compress_run)  # an export, tags not written yet
    found = [(v.name, str(v.version)) for v in watch.new_versions(since)]
    assert found == [("m", "2"), ("n", "1"), ("m-int8", "1")]  # oldest first
    assert [(v.name, str(v.version)) for v in watch.new_versions(since, ("m", "o'dd"))] == [("m", "2")]
    assert len(watch.new_versions(0)) == 4  # --backfill
    assert watch.made_by_mlflow_di("m-int8", "1") is True
    assert watch.made_by_mlflow_di("m", "2") is False and watch.made_by_mlflow_di("n", "1") is False
    with pytest.raises(UserError, match="cannot read models:/m/9"):
        watch.made_by_mlflow_di("m", "9")
    watch.write_status("m", "2", "running", 1)
    assert {k: v for k, v in mlflow_client.get_model_version("m", "2").tags.items() if "job" in k or "status" in k} == \
        {"mlflow_di.status": "running", "mlflow_di.job_attempts": "1"}
    with pytest.raises(UserError, match="delivers no webhooks"):
        watch.ensure_webhook("mlflow-di-serve", "http://127.0.0.1:9/webhook", "s")


@pytest.mark.parametrize("elapsed, poll_seconds, due", [
    (0, 60, 60), (10, 60, 70),  # polling: every --poll-seconds
    (0, 0, 90), (89, 0, 90),  # webhooks only: once more after the server's 60 s webhook cache ...
    (90, 0, 690), (1000, 0, 1600),  # ... then every 10 minutes
])
def test_the_registry_is_read_on_schedule_even_when_webhooks_bring_the_jobs(elapsed, poll_seconds, due):
    from mlflow_di.commands.serve import poll_due_after

    assert poll_due_after(elapsed, poll_seconds) == due


def test_a_job_whose_version_was_deleted_ends_in_error_and_its_tags_are_not_retried(mlflow_client, tmp_path, capsys):
    from mlflow_di.commands.serve import Service
    from mlflow_server import register_version

    register_version(mlflow_client, "fleeting")
    register_version(mlflow_client, "fleeting")
    service = Service(tmp_path / "state", "unused.yaml", (), workers=1, max_attempts=1, backoff_s=0.0, secret=None,
                      poll_seconds=0, backfill=True)
    service.queue = JobQueue(tmp_path / "jobs.sqlite")
    for version in ("1", "2"):
        service.queue.enqueue("fleeting", version, "reconcile")
    running = service.queue.claim()  # version 1 is running when both versions are deleted
    mlflow_client.delete_model_version("fleeting", "1")
    mlflow_client.delete_model_version("fleeting", "2")
    service._sync_tags({})
    assert service.queue.find("fleeting", "2").state == "error"
    assert service.queue.find("fleeting", "2").message == "the version was deleted from the registry"
    assert service.queue.find("fleeting", "1").state == "running" == running.state  # its pipeline decides
    assert not service.queue.untagged()
    out = capsys.readouterr().out
    assert "fleeting/2 is no longer in the registry; error, its tags given up" in out, out
    service._sync_tags({})  # nothing left to try
    assert "tags not written" not in capsys.readouterr().out


# ------------------------------------------------------------------------------ end to end
#: The smallest pipeline that runs every kind of step: seconds per version. It trusts no pickle:
#: the versions are logged as MLflow users log them (pt2), which runs no code when loaded.
TINY = """
compress: {methods: [int8-dynamic], eval_data: "digits[600:650]"}
coverage: {train_data: "digits[0:100]", test_data: ["digits[600:650]"], criteria: [idc], clusters: [2], idc_resamples: 5}
fuzz: {seed_data: "digits[600:650]", num_seeds: 2, max_queries: 10, timeout: 10}
gate: {thresholds: {min_idc: 0}}
"""
SECRET_VAR = "MLFLOW_DI_TEST_WEBHOOK_SECRET"
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _get(url: str) -> dict:
    with LOCAL.open(url, timeout=10) as response:
        return json.loads(response.read())


def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with LOCAL.open(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _wait(what: str, predicate, timeout: float, service=None, log=None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (urllib.error.URLError, OSError, KeyError):
            value = None
        if value:
            return value
        if service is not None and service.poll() is not None:
            pytest.fail(f"the service exited ({service.returncode}) while waiting for {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:.0f} s" + (f"; service log:\n{log.read_text()[-4000:]}" if log else ""))
        time.sleep(0.5)


def _register(name: str) -> None:
    """A new version of ``name``: an untrained digits-cnn (the gate's threshold is 0 anyway), logged
    with MLflow's own defaults (pt2, an input example, no mlflow_di metadata)."""
    import mlflow
    import numpy as np

    from mlflow_di.models import zoo

    example = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    with mlflow.start_run(run_name=f"train {name}"):
        mlflow.pytorch.log_model(zoo.build("digits-cnn", seed=0), name="model", registered_model_name=name,
                                 input_example=example)


@pytest.mark.slow
def test_the_service_gates_new_versions_once_and_resumes_after_a_kill(tmp_path, use_server, one_torch_thread):
    import signal

    server = start_server(tmp_path / "mlflow", extra_env={  # let it deliver webhooks to http://127.0.0.1
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true"})
    services = []
    try:
        client = use_server(server)
        policy = tmp_path / "tiny.yaml"
        policy.write_text(TINY)
        port, state, secret = free_port(), tmp_path / "service", uuid.uuid4().hex
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "MLFLOW_TRACKING_URI": server.url, SECRET_VAR: secret, "PYTHONPATH": str(REPO),
               "OMP_NUM_THREADS": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        log = tmp_path / "service.log"

        def start(*extra):
            with log.open("a") as out:
                process = subprocess.Popen([sys.executable, "-m", "mlflow_di.cli", "serve", "--policy", str(policy),
                                            "--state-dir", str(state), "--port", str(port), "--webhook-secret-env",
                                            SECRET_VAR, "--retry-backoff", "1", *extra], env=env, cwd=tmp_path,
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            services.append(process)
            _wait("/health", lambda: _get(f"{url}/health")["status"] == "ok", 120, process, log)
            return process

        def job(version: str) -> dict | None:
            return next((j for j in _get(f"{url}/jobs")["jobs"] if (j["model"], j["version"]) == ("svc", version)), None)

        def status(version: str) -> str | None:
            return client.get_model_version("svc", version).tags.get("mlflow_di.status")

        # 1. webhooks only: the service registers its webhook, the server's test delivery reaches it, and a version
        # the demo trains and registers (as a user would) is gated
        service = start("--register-webhook", f"{url}/webhook", "--poll-seconds", "0")
        assert "and tested: model_version.created" in log.read_text()
        trained = subprocess.run([sys.executable, "-m", "mlflow_di.cli", "demo", "--train-only", "--epochs", "1",
                                  "--register-as", "svc"], env=env, cwd=tmp_path, capture_output=True, text=True,
                                 timeout=300)
        assert trained.returncode == 0, trained.stderr[-2000:]
        assert _wait("svc/1 gated", lambda: status("1") in ("passed", "failed") and status("1"), 240, service, log)
        first = job("1")
        assert first["source"] == "webhook" and first["attempts"] == 1 and first["state"] == status("1")
        assert client.get_model_version("svc", "1").tags["mlflow_di.job_attempts"] == "1"

        # a bad signature is refused and queues nothing; a signed repeat changes nothing
        body = json.dumps({"entity": "model_version", "action": "created", "timestamp": "now",
                           "data": {"name": "svc", "version": "7"}}).encode()
        forged = _delivery("not-the-secret", body)
        assert _post(f"{url}/webhook", body, forged)[0] == 401
        assert _post(f"{url}/webhook", body, {})[0] == 401
        repeat = body.replace(b'"7"', b'"1"')
        code, answer = _post(f"{url}/webhook", repeat, _delivery(secret, repeat))
        assert code == 200 and answer["job"]["attempts"] == 1 and answer["job"]["state"] == first["state"]
        assert [(j["model"], j["version"]) for j in _get(f"{url}/jobs")["jobs"]] == [("svc", "1")]  # no export either

        # 2. killed mid-job: the restarted service resumes the job, and it runs once
        _register("svc")
        pipeline_state = state / "pipelines" / "svc-2" / "state.json"
        _wait("svc/2 compressed", lambda: "compress" in json.loads(pipeline_state.read_text())["done"], 240, service, log)
        orphan = job("2")["pid"]
        os.killpg(orphan, signal.SIGSTOP)  # frozen mid-job: still there when the service comes back
        os.kill(service.pid, signal.SIGKILL)
        service.wait(10)
        assert job_state_in_queue(state, "2") == "running"
        # polling now: sees svc/1 and svc/2 again, queues neither twice; the webhook is updated, not duplicated
        service = start("--poll-seconds", "1", "--register-webhook", f"{url}/webhook")
        assert _wait("svc/2 gated", lambda: status("2") in ("passed", "failed") and status("2"), 240, service, log)
        second = job("2")
        assert second["attempts"] == 1 and second["state"] == status("2")
        assert f"svc/2 stopped pipeline process {orphan} left by the previous service" in log.read_text()
        attempts_log = (state / "logs" / "svc-2.log").read_text()
        assert attempts_log.count("=== attempt 1") == 2  # the interrupted run and the resumed one
        assert "resuming from" in attempts_log and "compress: finished earlier, skipped" in attempts_log
        experiment = client.get_experiment_by_name("mlflow-di")
        pipelines = client.search_runs([experiment.experiment_id], "tags.mlflow_di.command = 'pipeline'")
        by_version = sorted(run.data.params["model_uri"] for run in pipelines)
        assert by_version == ["models:/svc/1", "models:/svc/2"]  # one parent run per version, also after the kill
        assert all(run.info.status == "FINISHED" for run in pipelines)
        gates = client.search_runs([experiment.experiment_id], "tags.mlflow_di.command = 'gate'")
        assert sorted(run.data.tags["mlflow_di.model_uri"] for run in gates) == ["models:/svc/1", "models:/svc/2"]
        assert [(j["model"], j["version"]) for j in _get(f"{url}/jobs")["jobs"]] == [("svc", "1"), ("svc", "2")]
        assert [hook.name for hook in client.list_webhooks()] == ["mlflow-di-serve"]
        health = _get(f"{url}/health")
        assert health["jobs"]["queued"] == health["jobs"]["running"] == 0

        # 3. SIGTERM: a quiet stop, exit 0
        os.kill(service.pid, signal.SIGTERM)
        assert service.wait(60) == 0, log.read_text()[-3000:]
        assert "stopped" in log.read_text().splitlines()[-1]

        # 4. the same server restarted: started without MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY, it encrypted the secret
        # with a key of that process's own, and cannot read its webhook now: the service says so in one line
        server.stop()
        server = start_server(tmp_path / "mlflow", port=int(server.url.rsplit(":", 1)[1]), extra_env={
            "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true"})
        refused = subprocess.run([sys.executable, "-m", "mlflow_di.cli", "serve", "--policy", str(policy), "--state-dir",
                                  str(tmp_path / "service-2"), "--port", str(free_port()), "--webhook-secret-env",
                                  SECRET_VAR, "--register-webhook", f"{url}/webhook", "--poll-seconds", "0"],
                                 env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
        assert "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY" in lines[0]
    finally:
        for process in services:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        server.stop()


def job_state_in_queue(state: pathlib.Path, version: str) -> str:
    queue = JobQueue(state / "jobs.sqlite")
    try:
        return queue.find("svc", version).state
    finally:
        queue.close()


def test_a_whitespace_secret_is_refused(monkeypatch):
    from mlflow_di.commands.serve import _secret
    from mlflow_di.errors import UserError

    monkeypatch.setenv("MLFLOW_DI_TEST_SECRET", "  \t ")
    with pytest.raises(UserError, match="only whitespace"):
        _secret("MLFLOW_DI_TEST_SECRET")


def test_models_whose_names_differ_only_in_unsafe_characters_never_share_a_folder():
    """'col a' and 'col_a' had shared pipelines/col_a-1 and one log file under serve --workers 2."""
    from mlflow_di.commands import pipeline
    from mlflow_di.commands.serve import _slug

    assert _slug("col_a-1") == "col_a-1"  # a name that needs no change keeps its folder
    assert len({_slug("col a-1"), _slug("col_a-1"), _slug("col/a-1")}) == 3
    assert pipeline._slug("models:/col a/1") != pipeline._slug("models:/col_a/1")
