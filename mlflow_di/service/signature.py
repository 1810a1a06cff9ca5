"""MLflow 3 webhook signatures, checked without MLflow.

The scheme, as ``mlflow/webhooks/delivery.py`` (MLflow 3.x) signs a delivery: headers
``X-MLflow-Delivery-Id`` (a UUID), ``X-MLflow-Timestamp`` (Unix seconds) and
``X-MLflow-Signature: v1,<base64 HMAC-SHA256>``, where the HMAC key is the webhook's secret and
the message is ``"{delivery_id}.{timestamp}.{body}"``, the body being the exact bytes POSTed.
Following Standard Webhooks, the header may hold several space-separated ``v1,...`` values
(key rotation); one match is enough. A timestamp further than ``tolerance`` seconds from now is
refused, so a captured delivery cannot be replayed later (and replaying it within the window
changes nothing: a version is queued at most once).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import time

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
SIGNATURE_VERSION = "v1"
#: Seconds a delivery's timestamp may be away from this machine's clock.
TOLERANCE_S = 300


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The ``X-MLflow-Signature`` value MLflow sends for ``body``."""
    message = f"{delivery_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode("utf-8"), message, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode('ascii')}"


def check(secret: str, headers, body: bytes, now: float | None = None, tolerance: float = TOLERANCE_S) -> str | None:
    """None when ``body`` with ``headers`` (a case-insensitive mapping with ``.get``, e.g. an
    ``http.client.HTTPMessage``) is a delivery signed with ``secret``; else why not, in words."""
    signatures = headers.get(SIGNATURE_HEADER)
    delivery_id = headers.get(DELIVERY_ID_HEADER)
    timestamp = headers.get(TIMESTAMP_HEADER)
    for name, value in ((SIGNATURE_HEADER, signatures), (DELIVERY_ID_HEADER, delivery_id),
                        (TIMESTAMP_HEADER, timestamp)):
        if not value:
            return f"no {name} header"
    try:
        sent = int(timestamp)
    except ValueError:
        return f"{TIMESTAMP_HEADER} is not Unix seconds"
    now = time.time() if now is None else now
    if abs(now - sent) > tolerance:
        return f"{TIMESTAMP_HEADER} is {int(now - sent)} s from now (more than {tolerance:g} s: a replay or a skewed clock)"
    expected = sign(secret, delivery_id, timestamp, body)
    if any(hmac.compare_digest(expected, candidate) for candidate in signatures.split()):
        return None
    return "the signature does not match (a different secret, or the body was changed)"
