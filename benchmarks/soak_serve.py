"""Service soak: ``mlflow-di serve`` against hostile and bursty clients, on loopback only.

For each ``--workers`` value, in a fresh temporary folder: a real ``mlflow server`` and a real
``mlflow-di serve`` (webhooks on, polling off, a gate-only policy so that each version's pipeline
is short) start on 127.0.0.1. Then, while a sampler reads the service process's threads and
resident memory every half second:

1. ``--stalled`` connections each declare a 1 MB webhook body, send 3 bytes and stay open; ``--drippers``
   connections send a webhook request one byte every ``--drip-seconds`` (never idle long enough for the
   idle timeout: only the whole-request deadline closes them);
2. ``--versions`` versions of one registered model are registered in a burst;
3. ``--deliveries`` signed webhook deliveries are POSTed by 16 client threads: for every version
   the delivery MLflow would send and repeats of it, and a ``--malformed`` fraction of bad ones
   (wrong signature, a body that is not JSON, ``"data": "str"``, a version missing, a body nested
   100,000 deep);
4. the soak waits until every version has a verdict (``--timeout`` bounds it) and stops everything.

Reported per ``--workers``: drippers still open at the end and the seconds the last one took to be
closed (target: all closed within the deadline and a cleanup pass), deliveries lost (no HTTP answer; target 0) and
answered with an
unexpected status, jobs duplicated (more than one job or one pipeline run per version; target
0), versions without a verdict, the verdict latency per version (registration to the job's final
state), and the service's threads and memory at each phase. Nothing but 127.0.0.1 is contacted;
every process started is stopped by its PID (group), also on Ctrl-C.

    .venv/bin/python -m benchmarks.soak_serve [--workers 1,2] [--versions 100] [--stalled 500]
        [--deliveries 1000] [--malformed 0.1] [--timeout 1800]
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import logging
import os
import pathlib
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

import mlflow_di  # noqa: F401  (torchvision guard first)
from mlflow_di.service import signature
from tests.mlflow_server import free_port, start_server

LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))
SECRET_VAR = "MLFLOW_DI_SOAK_SECRET"
MODEL = "soak"
POLICY = "gate: {thresholds: {min_idc: 0}}\n"


def sample(pid: int) -> tuple[int, int]:
    """(threads, resident KiB) of process ``pid``."""
    fields = dict(line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


class Sampler(threading.Thread):
    """Threads and memory of one process every half second, with the phase they were taken in."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.phase, self.samples, self.done = pid, "idle", [], threading.Event()

    def run(self):
        while not self.done.wait(0.5):
            try:
                self.samples.append((self.phase, *sample(self.pid)))
            except (OSError, KeyError):
                return

    def by_phase(self) -> dict[str, dict]:
        phases = collections.OrderedDict()
        for phase, threads, rss in self.samples:
            phases.setdefault(phase, []).append((threads, rss))
        return {phase: {"threads_max": max(t for t, _ in values), "rss_mib_max": round(max(r for _, r in values) / 1024, 1)}
                for phase, values in phases.items()}


def deliveries(secret: str, versions: list[str], total: int, malformed: float, rng: random.Random) -> list[tuple]:
    """(kind, body, headers) of ``total`` deliveries: every version's at least once, a ``malformed`` share bad."""
    bad_count = round(total * malformed)
    good = [versions[i % len(versions)] for i in range(total - bad_count)]
    out = []
    for version in good:
        body = json.dumps({"entity": "model_version", "action": "created",
                           "data": {"name": MODEL, "version": version}}).encode()
        out.append(("good", body, _signed(secret, body)))
    for number in range(bad_count):
        kind = ("forged", "not-json", "data-str", "no-version", "deep")[number % 5]
        body = {"not-json": b"{this is not json", "deep": b"[" * 100_000 + b"]" * 100_000,
                "data-str": json.dumps({"entity": "model_version", "action": "created", "data": "str"}).encode(),
                "no-version": json.dumps({"entity": "model_version", "action": "created",
                                          "data": {"name": MODEL}}).encode()}.get(kind, b'{"entity": "model_version"}')
        out.append((kind, body, _signed("not-the-secret" if kind == "forged" else secret, body)))
    rng.shuffle(out)
    return out


def _signed(secret: str, body: bytes) -> dict:
    delivery, stamp = str(uuid.uuid4()), str(int(time.time()))
    return {signature.DELIVERY_ID_HEADER: delivery, signature.TIMESTAMP_HEADER: stamp,
            signature.SIGNATURE_HEADER: signature.sign(secret, delivery, stamp, body),
            "Content-Type": "application/json"}


def post(url: str, body: bytes, headers: dict) -> int | str:
    """The HTTP status, or why there was none."""
    try:
        with LOCAL.open(urllib.request.Request(url, data=body, headers=headers), timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError) as exc:
        return f"lost: {exc}"


class Drippers(threading.Thread):
    """``count`` connections each sending a webhook request one byte every ``every`` seconds; records when the
    service closed each (a send that fails, or the end of the stream)."""

    REQUEST = b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 400\r\n\r\n" + b"x" * 400

    def __init__(self, port: int, count: int, every: float):
        super().__init__(daemon=True)
        self.every, self.started = every, time.monotonic()
        self.connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
        self.closed_after: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self):
        for position in range(len(self.REQUEST)):
            for number, connection in enumerate(self.connections):
                if number in self.closed_after:
                    continue
                try:
                    connection.sendall(self.REQUEST[position:position + 1])
                    connection.settimeout(0.001)
                    if connection.recv(1) == b"":
                        raise ConnectionResetError
                except TimeoutError:
                    pass
                except OSError:
                    self.closed_after[number] = time.monotonic() - self.started
            if len(self.closed_after) == len(self.connections) or self.stop.wait(self.every):
                return

    def close(self) -> dict:
        self.stop.set()
        self.join(30)
        for connection in self.connections:
            connection.close()
        closed = sorted(self.closed_after.values())
        return {"drippers": len(self.connections), "drippers_open": len(self.connections) - len(closed),
                "dripper_closed_max_s": round(closed[-1], 1) if closed else None}


def get_json(url: str) -> dict:
    with LOCAL.open(url, timeout=30) as reply:
        return json.loads(reply.read())


def soak(workers: int, args, folder: pathlib.Path) -> dict:
    import mlflow
    import numpy as np

    from mlflow_di.models import zoo

    server = start_server(folder / "mlflow")
    service = None
    try:
        mlflow.set_tracking_uri(server.url)
        client = mlflow.MlflowClient()
        with mlflow.start_run(run_name="soak model", log_system_metrics=False) as run:
            example = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
            logged = mlflow.pytorch.log_model(zoo.build("digits-cnn", seed=0), name="model", input_example=example)
        client.create_registered_model(MODEL)
        (folder / "policy.yaml").write_text(POLICY)
        port, secret = free_port(), uuid.uuid4().hex
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "MLFLOW_TRACKING_URI": server.url, SECRET_VAR: secret, "OMP_NUM_THREADS": "1",
               "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
        with (folder / "service.log").open("w") as log:
            service = subprocess.Popen([sys.executable, "-m", "mlflow_di.cli", "serve", "--policy",
                                        str(folder / "policy.yaml"), "--state-dir", str(folder / "state"), "--port",
                                        str(port), "--workers", str(workers), "--poll-seconds", "0",
                                        "--webhook-secret-env", SECRET_VAR], env=env, cwd=folder, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                get_json(f"{url}/health")
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline or service.poll() is not None:
                    raise RuntimeError(f"the service did not start:\n{(folder / 'service.log').read_text()[-3000:]}")
                time.sleep(0.5)
        sampler = Sampler(service.pid)
        sampler.start()
        time.sleep(2)

        sampler.phase = "stalled clients"
        stalled = []
        for _ in range(args.stalled):
            connection = socket.create_connection(("127.0.0.1", port))
            connection.sendall(b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nabc")
            stalled.append(connection)
        drippers = Drippers(port, args.drippers, args.drip_seconds)
        drippers.start()
        time.sleep(2)

        sampler.phase = "registration burst"
        registered_at = {}
        for _ in range(args.versions):
            version = client.create_model_version(MODEL, f"models:/{logged.model_id}", run_id=run.info.run_id,
                                                  model_id=logged.model_id)
            registered_at[str(version.version)] = time.time()

        sampler.phase = "deliveries"
        plan = deliveries(secret, sorted(registered_at, key=int), args.deliveries, args.malformed, random.Random(0))
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda item: (item[0], post(f"{url}/webhook", item[1], item[2])), plan))
        delivery_seconds = time.perf_counter() - started
        expected = {"good": 200, "forged": 401, "not-json": 400, "data-str": 400, "no-version": 400, "deep": 400}
        lost = [status for _, status in answers if isinstance(status, str)]
        unexpected = collections.Counter(f"{kind}->{status}" for kind, status in answers
                                         if not isinstance(status, str) and status != expected[kind])

        sampler.phase = "pipelines"
        deadline = time.monotonic() + args.timeout
        while True:
            jobs = get_json(f"{url}/jobs")["jobs"]
            final = [job for job in jobs if job["state"] in ("passed", "failed", "error")]
            if len(final) >= len(registered_at) or time.monotonic() > deadline:
                break
            time.sleep(2)
        sampler.done.set()
        for connection in stalled:
            connection.close()
        from mlflow_di.service.http import IDLE_TIMEOUT_S, REQUEST_DEADLINE_S

        wait_until = drippers.started + REQUEST_DEADLINE_S + IDLE_TIMEOUT_S + 2 * args.drip_seconds
        while len(drippers.closed_after) < args.drippers and time.monotonic() < wait_until:
            time.sleep(1)  # the deadline, a cleanup pass and a dripper's next byte
        dripped = drippers.close()
        keys = collections.Counter((job["model"], job["version"]) for job in jobs)
        experiment = client.get_experiment_by_name("mlflow-di")
        pipeline_runs = collections.Counter(
            r.data.params.get("model_uri") for r in client.search_runs(
                [experiment.experiment_id], "tags.mlflow_di.command = 'pipeline'", max_results=5000)) if experiment else {}
        latencies = sorted(job["updated_at"] - registered_at[job["version"]] for job in final
                           if job["version"] in registered_at)
        return {
            "workers": workers, "versions": len(registered_at), "stalled": args.stalled, "deliveries": len(plan),
            "malformed": sum(kind != "good" for kind, *_ in plan), "delivery_seconds": round(delivery_seconds, 1),
            "lost": len(lost), "unexpected": dict(unexpected),
            "jobs": len(jobs), "jobs_duplicated": sum(count - 1 for count in keys.values()),
            "pipeline_runs_duplicated": sum(count - 1 for count in pipeline_runs.values() if count > 1),
            "without_verdict": len(registered_at) - len(final),
            "states": dict(collections.Counter(job["state"] for job in final)),
            "latency_s": {"min": round(latencies[0], 1), "median": round(statistics.median(latencies), 1),
                          "p90": round(latencies[int(0.9 * (len(latencies) - 1))], 1), "max": round(latencies[-1], 1)}
            if latencies else None,
            "phases": sampler.by_phase(), **dripped,
        }
    finally:
        if service is not None and service.poll() is None:
            os.killpg(service.pid, signal.SIGTERM)
            try:
                service.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(service.pid, signal.SIGKILL)
        server.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--versions", type=int, default=100)
    parser.add_argument("--stalled", type=int, default=500)
    parser.add_argument("--deliveries", type=int, default=1000)
    parser.add_argument("--malformed", type=float, default=0.1)
    parser.add_argument("--drippers", type=int, default=300, help="connections that send one byte at a time")
    parser.add_argument("--drip-seconds", type=float, default=10.0, help="seconds between a dripper's bytes")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for every verdict")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM too stops what the soak started
    import mlflow  # noqa: F401  (configures its loggers on import; quieted below)

    logging.getLogger("mlflow").setLevel(logging.ERROR)  # its per-version "Waiting up to 300 seconds" lines
    results = []
    for workers in (int(n) for n in args.workers.split(",")):
        with tempfile.TemporaryDirectory(prefix="soak-") as folder:
            results.append(soak(workers, args, pathlib.Path(folder)))
        print(json.dumps(results[-1], indent=1), flush=True)
    print("\n| workers | versions | deliveries (bad) | lost | unexpected | jobs dup. | runs dup. | no verdict | states "
          "| latency median / p90 / max s | threads max (stalled, burst, deliveries, pipelines) | RSS max MiB "
          "| drippers open / last closed s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        phases = r["phases"]
        threads = ", ".join(str(phases.get(p, {}).get("threads_max", "-"))
                            for p in ("stalled clients", "registration burst", "deliveries", "pipelines"))
        latency = r["latency_s"] or {}
        print(f"| {r['workers']} | {r['versions']} | {r['deliveries']} ({r['malformed']}) | {r['lost']} | "
              f"{sum(r['unexpected'].values())} | {r['jobs_duplicated']} | {r['pipeline_runs_duplicated']} | "
              f"{r['without_verdict']} | {', '.join(f'{k} {v}' for k, v in sorted(r['states'].items()))} | "
              f"{latency.get('median')} / {latency.get('p90')} / {latency.get('max')} | "
              f"{threads} | {max(p['rss_mib_max'] for p in phases.values())} | "
              f"{r['drippers_open']} of {r['drippers']} / {r['dripper_closed_max_s']} |")


if __name__ == "__main__":
    main()
