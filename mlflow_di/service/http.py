"""The service's HTTP endpoints, served by waitress.

``GET /health`` and ``GET /jobs`` (``?state=queued`` to filter) answer JSON; ``POST /webhook``
receives MLflow registry webhooks. What each answers is the ``app``'s business (an object with
``health()``, ``jobs(state)`` and ``webhook(headers, body) -> (status, dict)``); this module only
routes and writes JSON. Binding is the caller's choice; the command binds 127.0.0.1 unless told
otherwise.

Why waitress and not ``http.server``: a thread-per-connection server gives a client that
declares a body and never sends it a thread forever (300 such clients held 300 threads), prints
a traceback for every client that hangs up, and drops connections beyond a listen backlog of 5.
waitress reads requests in one event loop and hands only complete ones to a fixed pool of
threads, closes connections idle for :data:`IDLE_TIMEOUT_S`, refuses bodies above
:data:`MAX_BODY` with 413, and listens with a backlog of 1024. Every error an endpoint raises
becomes a JSON 500 and one line through ``on_error``, never a traceback.
"""
from __future__ import annotations

import http
import json
import logging
import threading
import urllib.parse

#: A registry webhook is a few hundred bytes; a larger body is refused (413) before it reaches the app.
MAX_BODY = 1 << 20
#: Seconds a connection may stay silent (mid-request included) before it is closed.
IDLE_TIMEOUT_S = 20
#: Seconds a request may take to arrive whole, from its first byte: a client that drips one byte every
#: few seconds never looks idle, so without it it could keep its connection forever.
REQUEST_DEADLINE_S = 30
#: Requests handled at once; further complete requests wait in waitress's queue.
HANDLER_THREADS = 8
#: Open connections at most (stalled ones included); beyond it new ones wait in the listen backlog.
MAX_CONNECTIONS = 2000
#: Connections the kernel queues before the server accepts them.
BACKLOG = 1024


class ServiceServer:
    """An HTTP server on ``(host, port)`` (port 0: any free one) answering for ``app``; errors of
    the app are reported as one line to ``on_error``."""

    def __init__(self, host: str, port: int, app, on_error=None):
        from waitress import create_server

        self.app = app
        self.on_error = on_error or (lambda line: None)
        logging.getLogger("waitress").setLevel(logging.ERROR)  # no "Serving on", no queue-depth warnings
        self._server = create_server(
            self._wsgi, host=host, port=port, threads=HANDLER_THREADS, channel_timeout=IDLE_TIMEOUT_S,
            cleanup_interval=max(1, IDLE_TIMEOUT_S // 4), connection_limit=MAX_CONNECTIONS, backlog=BACKLOG,
            max_request_body_size=MAX_BODY, asyncore_use_poll=True, log_socket_errors=False,
            expose_tracebacks=False, ident="mlflow-di-serve", clear_untrusted_proxy_headers=True)
        self._stopped = threading.Event()
        self._server.maintenance = self._with_deadline(self._server)

    @staticmethod
    def _with_deadline(server):
        """waitress's periodic maintenance (closing idle connections), plus: a connection whose request has been
        arriving for more than :data:`REQUEST_DEADLINE_S` is closed. Runs in the server's loop thread."""
        idle = server.maintenance

        def maintenance(now: float) -> None:
            idle(now)
            for channel in list(server.active_channels.values()):
                request = getattr(channel, "request", None)  # a request still being received
                if request is None:
                    continue
                started = getattr(request, "mlflow_di_started", None)
                if started is None:
                    request.mlflow_di_started = now
                elif now - started > REQUEST_DEADLINE_S:
                    channel.will_close = True
        return maintenance

    @property
    def url(self) -> str:
        host, port = self._server.effective_host, self._server.effective_port
        return f"http://{host if ':' not in str(host) else f'[{host}]'}:{port}"

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (run it in a thread)."""
        try:
            self._server.run()
        finally:
            self._stopped.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close every connection and the listening socket, then stop the handler threads."""
        from waitress import wasyncore

        server = self._server
        try:
            server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))  # runs in the loop's thread
        except OSError:
            # The trigger closed itself: the loop's poll found a descriptor of its pipe closed under it
            # (POLLNVAL), which a double close elsewhere in the process does (seen once in the test suite).
            # Its pipe is gone and out of the map; the rest is closed from here and the loop ends on its
            # empty map.
            wasyncore.close_all(server._map, ignore_all=True)
        self._stopped.wait(timeout)
        server.task_dispatcher.shutdown(cancel_pending=True, timeout=timeout)

    def server_close(self) -> None:
        """Release the socket of a server that never served (a failed start)."""
        if not self._stopped.is_set():
            from waitress import wasyncore

            wasyncore.close_all(self._server._map)
            self._server.task_dispatcher.shutdown(cancel_pending=True, timeout=1)
            self._stopped.set()

    # ------------------------------------------------------------------------------ WSGI
    def _wsgi(self, environ, start_response):
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "")
        try:
            status, payload = self._route(method, path, environ)
        except Exception as exc:  # noqa: BLE001 - an endpoint's bug must not cost the client an answer
            text = str(exc).strip().splitlines()
            self.on_error(f"{method} {path} failed: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": "))
            status, payload = 500, {"error": f"internal error ({type(exc).__name__}); see the service's log"}
        body = (json.dumps(payload, sort_keys=True, default=str) + "\n").encode()
        start_response(f"{status} {http.HTTPStatus(status).phrase}",
                       [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    def _route(self, method: str, path: str, environ) -> tuple[int, dict]:
        if method == "GET" and path == "/health":
            health = self.app.health()  # 503 while starting: a readiness probe waits for the workers
            return (200 if health["status"] == "ok" else 503), health
        if method == "GET" and path == "/jobs":
            state = urllib.parse.parse_qs(environ.get("QUERY_STRING", "")).get("state", [None])[0]
            return 200, self.app.jobs(state)
        if method == "POST" and path == "/webhook":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length) if length > 0 else b""
            return self.app.webhook(Headers(environ), body)
        if path in ("/health", "/jobs", "/webhook"):
            return 405, {"error": f"{method} {path} is not served; use {'POST' if path == '/webhook' else 'GET'}"}
        return 404, {"error": f"no such endpoint {path}; try /health, /jobs or POST /webhook"}


class Headers:
    """A request's headers from a WSGI environ, looked up case-insensitively with ``get``."""

    def __init__(self, environ):
        self._values = {key[5:].replace("_", "-").lower(): value for key, value in environ.items()
                        if key.startswith("HTTP_")}

    def get(self, name: str, default=None):
        return self._values.get(name.lower(), default)
