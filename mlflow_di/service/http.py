"""The service's HTTP endpoints (stdlib ``http.server``, one thread per request).

``GET /health`` and ``GET /jobs`` (``?state=queued`` to filter) answer JSON; ``POST /webhook``
receives MLflow registry webhooks. What each answers is the ``app``'s business (an object with
``health()``, ``jobs(state)`` and ``webhook(headers, body) -> (status, dict)``); this module only
routes, bounds the body and writes JSON. Binding is the caller's choice; the command binds
127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

import http.server
import json
import urllib.parse

#: A registry webhook is a few hundred bytes; anything above this is refused unread.
MAX_BODY = 1 << 20


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "mlflow-di-serve"
    protocol_version = "HTTP/1.1"

    def _send(self, status: int, payload: dict) -> None:
        body = (json.dumps(payload, sort_keys=True) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 - http.server's naming
        url = urllib.parse.urlsplit(self.path)
        app = self.server.app
        if url.path == "/health":
            self._send(200, app.health())
        elif url.path == "/jobs":
            state = urllib.parse.parse_qs(url.query).get("state", [None])[0]
            self._send(200, app.jobs(state))
        else:
            self._send(404, {"error": f"no such endpoint {url.path}; try /health, /jobs or POST /webhook"})

    def do_POST(self):  # noqa: N802
        url = urllib.parse.urlsplit(self.path)
        if url.path != "/webhook":
            self._send(404, {"error": f"no such endpoint {url.path}; webhooks go to POST /webhook"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self.close_connection = True
            self._send(413 if length > MAX_BODY else 400, {"error": "bad Content-Length"})
            return
        body = self.rfile.read(length)
        status, payload = self.server.app.webhook(self.headers, body)
        self._send(status, payload)

    def log_message(self, format, *args):  # noqa: A002 - quiet: the service logs job transitions itself
        pass


class ServiceServer(http.server.ThreadingHTTPServer):
    """An HTTP server on ``(host, port)`` (port 0: any free one) answering for ``app``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, app):
        self.app = app
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host if ':' not in host else f'[{host}]'}:{port}"
