"""The service's HTTP layer against hostile clients: stalled bodies, hang-ups, bursts, bad payloads
and endpoint errors. Everything on 127.0.0.1, against a stand-in app (the routing and the server
are what is tested; the real service's answers are tested in test_serve.py)."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from mlflow_di.service import http as service_http

LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StandIn:
    """An app whose webhook answers 202 with the body's length, or raises when told to."""

    def __init__(self):
        self.fail = False
        self.status = "ok"

    def health(self):
        return {"status": self.status}

    def jobs(self, state):
        if self.fail:
            raise RuntimeError("the queue's database is locked\nsecond line")
        return {"jobs": [], "state": state}

    def webhook(self, headers, body):
        return 202, {"length": len(body), "delivery": headers.get("x-mlflow-delivery-id")}


@pytest.fixture()
def served(monkeypatch):
    monkeypatch.setattr(service_http, "IDLE_TIMEOUT_S", 2)
    errors = []
    app = StandIn()
    server = service_http.ServiceServer("127.0.0.1", 0, app, on_error=errors.append)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, app, errors
    server.shutdown()
    thread.join(10)
    assert not thread.is_alive()


def get(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with LOCAL.open(url, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def stalled_connection(port: int) -> socket.socket:
    """A client that declares a 1 MB body and sends 3 bytes of it."""
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nabc")
    return client


def test_routes_answer_json_and_wrong_methods_are_405(served):
    server, _, _ = served
    assert get(server.url + "/health") == (200, {"status": "ok"})
    assert get(server.url + "/jobs?state=queued") == (200, {"jobs": [], "state": "queued"})
    status, answer = get(server.url + "/nowhere")
    assert status == 404 and "/health" in answer["error"]
    assert get(server.url + "/webhook")[0] == 405
    request = urllib.request.Request(server.url + "/webhook", data=b"{}", headers={"X-MLflow-Delivery-Id": "d1"})
    with LOCAL.open(request, timeout=10) as reply:
        assert reply.status == 202 and json.loads(reply.read()) == {"length": 2, "delivery": "d1"}


def test_a_server_whose_trigger_closed_itself_still_shuts_down(served):
    # waitress closes its wake-up pipe when the loop finds it closed under it (a double close elsewhere in the
    # process): shutdown must not fail on the dead pipe, and the fixture checks the loop thread has ended
    server, _, _ = served
    assert get(server.url + "/health")[0] == 200
    server._server.trigger.close()


def test_health_is_503_until_the_service_has_started(served):
    server, app, _ = served
    app.status = "starting"  # the webhook's test delivery is still on its way, no worker runs yet
    assert get(server.url + "/health") == (503, {"status": "starting"})
    app.status = "ok"
    assert get(server.url + "/health") == (200, {"status": "ok"})


def test_an_endpoint_error_is_a_json_500_and_one_line(served):
    server, app, errors = served
    app.fail = True
    status, answer = get(server.url + "/jobs")
    assert status == 500 and "RuntimeError" in answer["error"]
    assert errors == ["GET /jobs failed: RuntimeError: the queue's database is locked"]


def test_stalled_clients_hold_no_threads_and_are_dropped_while_others_are_served(served):
    server, _, _ = served
    port = int(server.url.rsplit(":", 1)[1])
    threads_before = threading.active_count()
    stalled = [stalled_connection(port) for _ in range(200)]
    try:
        started = time.perf_counter()
        assert get(server.url + "/health", timeout=5)[0] == 200  # served at once beside 200 stalled clients
        assert time.perf_counter() - started < 2
        assert threading.active_count() <= threads_before + service_http.HANDLER_THREADS
        time.sleep(service_http.IDLE_TIMEOUT_S + 3)  # the idle timeout (2 s here) and a cleanup pass
        closed = 0
        for client in stalled:
            client.settimeout(1)
            try:
                closed += client.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 0
        assert closed == len(stalled)
    finally:
        for client in stalled:
            client.close()


def test_a_burst_loses_no_request_and_hang_ups_print_nothing(served, capfd):
    server, _, errors = served
    port = int(server.url.rsplit(":", 1)[1])
    for _ in range(50):  # clients that send a request and hang up before the answer
        client = socket.create_connection(("127.0.0.1", port))
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        client.close()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        statuses = list(pool.map(lambda _: get(server.url + "/health", timeout=30)[0], range(300)))
    assert statuses == [200] * 300
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "BrokenPipe" not in out + err and errors == []


def test_a_body_above_the_limit_is_refused_unread(served):
    """The client declares a body one byte over the limit and sends none of it: the answer is 413
    without the server waiting for the body (a client that streamed the body could be reset
    mid-send, which is the server's right, so the test does not stream it)."""
    server, _, _ = served
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % (service_http.MAX_BODY + 1))
        answer = b""
        while b"\r\n" not in answer:
            chunk = client.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.split(b"\r\n", 1)[0].split()[1] == b"413"


class Lookup(dict):
    """Headers looked up case-insensitively, as the server hands them to the app."""

    def get(self, key, default=None):
        return super().get(key.lower(), default)


def signed(payload) -> tuple[Lookup, bytes]:
    """(headers, body) of ``payload`` delivered and signed as MLflow signs a webhook with secret ``s3cret``."""
    from mlflow_di.service import signature

    body = json.dumps(payload).encode()
    stamp = str(int(time.time()))
    return Lookup({"x-mlflow-delivery-id": "d", "x-mlflow-timestamp": stamp,
                   "x-mlflow-signature": signature.sign("s3cret", "d", stamp, body)}), body


def service_offering(offer):
    """A Service with webhooks on (secret ``s3cret``) whose ``offer`` is ``offer``; nothing else set up."""
    from mlflow_di.commands.serve import Service

    service = Service.__new__(Service)
    service.secret, service._say, service.offer = "s3cret", lambda line: None, offer
    return service


@pytest.mark.parametrize("payload", [
    {"entity": "model_version", "action": "created", "data": "str"},
    {"entity": "model_version", "action": "created", "data": {"name": "m", "version": [1]}},
    {"entity": "model_version", "action": "created", "data": {"name": ["m"], "version": "1"}},
    {"entity": "model_version", "action": "created", "data": {"name": "m", "version": True}},
    {"entity": "model_version", "action": "created", "data": {"name": "m", "version": "abc"}},  # not a number: a 503
    {"entity": "model_version", "action": "created", "data": {"name": "m", "version": "-1"}},   # made MLflow retry
    {"entity": "model_version", "action": "created", "data": {"name": "a/b", "version": "1"}},  # forever
    ["not", "an", "object"],
    "just a string",
])
def test_a_signed_payload_of_the_wrong_shape_is_a_400(payload):
    service = service_offering(lambda *args: pytest.fail("a malformed payload must not be offered"))
    status, answer = service.webhook(*signed(payload))
    assert status == 400 and "error" in answer


@pytest.mark.parametrize("version", ["3", 3])
def test_a_signed_payload_of_the_right_shape_is_offered(version):
    service = service_offering(lambda name, number, run_id, source: (200, {"offered": [name, number, source]}))
    payload = {"entity": "model_version", "action": "created", "data": {"name": "m", "version": version}}
    assert service.webhook(*signed(payload)) == (200, {"offered": ["m", "3", "webhook"]})


def test_the_registry_decides_404_for_an_absent_version_and_ignores_one_older_than_the_service(mlflow_client):
    """Nothing to retry for a version that does not exist (MLflow redelivers what fails with a 5xx), and a
    delivery for a version created before the service started is not a job (only --backfill queues those)."""
    from mlflow_di.commands.serve import Service
    from mlflow_server import register_version

    old = register_version(mlflow_client, "m")
    service = Service.__new__(Service)
    service.models, service.backfill, service.since_ms = (), False, old.creation_timestamp + 1
    service._say, service.queue = (lambda line: None), None
    status, answer = service.offer("m", "7", None, "webhook")
    assert status == 404 and "models:/m/7 is not in the registry" in answer["error"]
    status, answer = service.offer("m", "1", None, "webhook")
    assert status == 200 and "created before this service started (--backfill" in answer["ignored"]


def test_a_signed_body_nested_a_hundred_thousand_deep_is_a_400_not_a_500():
    service = service_offering(lambda *args: pytest.fail("a malformed payload must not be offered"))
    from mlflow_di.service import signature

    body = b"[" * 100_000 + b"]" * 100_000
    stamp = str(int(time.time()))
    headers = Lookup({"x-mlflow-delivery-id": "d", "x-mlflow-timestamp": stamp,
                      "x-mlflow-signature": signature.sign("s3cret", "d", stamp, body)})
    status, answer = service.webhook(headers, body)
    assert status == 400 and "not a JSON webhook payload" in answer["error"]


def test_a_client_that_drips_its_request_is_closed_at_the_deadline_while_others_are_served(monkeypatch):
    """One byte a second never looks idle (the idle timeout is 4 s here); the whole-request deadline (3 s here,
    checked at each 1 s cleanup pass) closes it."""
    monkeypatch.setattr(service_http, "IDLE_TIMEOUT_S", 4)
    monkeypatch.setattr(service_http, "REQUEST_DEADLINE_S", 3)
    server = service_http.ServiceServer("127.0.0.1", 0, StandIn())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = int(server.url.rsplit(":", 1)[1])
    drippers = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        started, closed_at = time.perf_counter(), {}
        request = b"POST /webhook HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
        for position in range(len(request)):
            for number, client in enumerate(drippers):
                if number in closed_at:
                    continue
                try:
                    client.sendall(request[position:position + 1])
                except OSError:
                    closed_at[number] = time.perf_counter() - started
            if len(closed_at) == len(drippers) or time.perf_counter() - started > 15:
                break
            assert get(server.url + "/health", timeout=5)[0] == 200  # the others are served meanwhile
            time.sleep(1)
        for number, client in enumerate(drippers):  # a closed connection reads as the end of the stream
            client.settimeout(2)
            try:
                if number not in closed_at and client.recv(1) == b"":
                    closed_at[number] = time.perf_counter() - started
            except (ConnectionResetError, TimeoutError):
                pass
        assert len(closed_at) == len(drippers) and max(closed_at.values()) < 10, closed_at
    finally:
        for client in drippers:
            client.close()
        server.shutdown()
        thread.join(10)
