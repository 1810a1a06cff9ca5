"""What ``mlflow-di serve`` asks of the registry: new versions, whether mlflow-di made a version
itself, the job status as version tags, and its webhook.

New versions are found by creation time, newest first (``order_by creation_timestamp DESC``),
paging only until a version older than the start line: a poll costs one page when nothing is new.
A version made by mlflow-di itself (an export registered by ``compress`` or ``repair``) is never
a job: testing an export would compress the export, and so on. Such a version is known by its
creating run's ``mlflow_di.command`` tag, set when the run starts, so it is known at once (the
lineage version tags come a moment after the version exists).
"""
from __future__ import annotations

from mlflow_di.errors import UserError
from mlflow_di.mlflow_edge.connection import first_line, mlflow_errors, tracking_uri
from mlflow_di.mlflow_edge.registry import TAG_PREFIX, write_version_tags

STATUS_TAG = f"{TAG_PREFIX}status"
ATTEMPTS_TAG = f"{TAG_PREFIX}job_attempts"
#: Commands whose runs register versions (exports) that the service must not test.
PRODUCING_COMMANDS = ("compress", "repair")
WEBHOOK_EVENT = "model_version.created"


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def _quoted(name: str) -> str:
    return "'" + name.replace("\\", "\\\\").replace("'", "\\'") + "'"


def new_versions(since_ms: int, models: tuple[str, ...] = (), client=None) -> list:
    """Registry versions created at or after ``since_ms`` (Unix milliseconds; 0: every version),
    of ``models`` (every model when empty), oldest first, as ``ModelVersion`` objects."""
    client = client or _client()
    query = f"name IN ({', '.join(_quoted(name) for name in models)})" if models else None
    found, token = [], None
    with mlflow_errors("cannot list the registry's model versions"):
        while True:
            page = client.search_model_versions(query, max_results=200, order_by=["creation_timestamp DESC"],
                                                page_token=token)
            fresh = [version for version in page if (version.creation_timestamp or 0) >= since_ms]
            found.extend(fresh)
            token = page.token
            if not token or len(fresh) < len(page):
                break
    return found[::-1]


class VersionAbsent(UserError):
    """The registry answers that the version does not exist (a webhook naming one is answered 404, not retried)."""


def created_ms(name: str, version: str, client=None) -> int:
    """When ``name``/``version`` was created (Unix milliseconds); :class:`VersionAbsent` when it does not exist,
    :class:`UserError` when the registry cannot say."""
    from mlflow.exceptions import MlflowException

    client = client or _client()
    try:
        return int(client.get_model_version(name, str(version)).creation_timestamp or 0)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise VersionAbsent(f"models:/{name}/{version} is not in the registry") from None
        with mlflow_errors(f"cannot read models:/{name}/{version}"):
            raise


def made_by_mlflow_di(name: str, version: str, run_id: str | None = None, client=None) -> bool:
    """True when ``name``/``version`` is an export mlflow-di registered (see the module's docstring).

    Raises :class:`UserError` when the registry cannot say (the version does not exist, the
    server is down)."""
    from mlflow.exceptions import MlflowException

    client = client or _client()
    with mlflow_errors(f"cannot read models:/{name}/{version}"):
        found = client.get_model_version(name, str(version))
        if (found.tags or {}).get(f"{TAG_PREFIX}source_name"):
            return True
        run_id = run_id or found.run_id
        if not run_id:
            return False
        try:
            run = client.get_run(run_id)
        except MlflowException:
            return False  # the run was deleted (or is in a store we cannot read): not ours to judge
    return run.data.tags.get(f"{TAG_PREFIX}command") in PRODUCING_COMMANDS


def write_status(name: str, version: str, state: str, attempts: int, client=None) -> None:
    """Tag the version with its job's state (``mlflow_di.status``) and runs started (``mlflow_di.job_attempts``)."""
    import types

    target = types.SimpleNamespace(name=name, version=str(version))
    with mlflow_errors(f"cannot tag models:/{name}/{version}"):
        write_version_tags(target, {STATUS_TAG: state, ATTEMPTS_TAG: str(attempts)}, client or _client())


def ensure_webhook(name: str, url: str, secret: str, client=None) -> tuple[str, str]:
    """A webhook called ``name`` sending ``model_version.created`` to ``url``, signed with
    ``secret``: an existing one with that name or URL is updated (no duplicates when the service
    restarts), else one is created. Returns (webhook id, "created" or "updated")."""
    client = client or _client()
    uri = tracking_uri()
    if not uri.startswith(("http://", "https://")):
        raise UserError(f"--register-webhook needs an MLflow tracking server (http[s]://...), and {uri} "
                        "delivers no webhooks; poll it instead (--poll-seconds)")
    if not hasattr(client, "create_webhook"):
        raise UserError("this MLflow has no webhooks (they came with MLflow 3.3); poll instead (--poll-seconds)")
    from mlflow.exceptions import MlflowException

    try:
        existing, token = None, None
        while existing is None:
            page = client.list_webhooks(max_results=100, page_token=token)
            existing = next((hook for hook in page if hook.name == name or hook.url == url), None)
            token = page.token
            if not token:
                break
        if existing is not None:
            client.update_webhook(existing.webhook_id, name=name, url=url, events=[WEBHOOK_EVENT], secret=secret,
                                  status="ACTIVE")
            return existing.webhook_id, "updated"
        hook = client.create_webhook(name=name, url=url, events=[WEBHOOK_EVENT], secret=secret,
                                     description="mlflow-di serve: run the pipeline for every new model version")
        return hook.webhook_id, "created"
    except MlflowException as exc:
        line = first_line(exc.message)
        if any(word in line.lower() for word in ("scheme", "private", "public ip", "resolve")):
            line += f" ({_DELIVERY_SETTINGS})"
        elif exc.error_code == "INTERNAL_ERROR" or "500" in line:
            line += f" ({_UNREADABLE_SECRETS})"
        raise UserError(f"cannot register the webhook {url} at {uri}: {line}") from None


#: What a stock ``mlflow server`` needs to deliver webhooks to a service on this machine.
_DELIVERY_SETTINGS = ("a tracking server delivers to http:// or private addresses only when it was started with "
                      "MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true")
#: Why a tracking server fails on its own stored webhooks (MLflow's own behaviour, seen with MLflow 3.17).
_UNREADABLE_SECRETS = ("a tracking server started without MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY encrypts webhook secrets "
                       "with a key of its own process, so after a restart, or in another worker, it cannot decrypt "
                       "them and fails on its stored webhooks: start it with that variable set to one Fernet key, "
                       "always the same, and delete the webhooks it can no longer read from its `webhooks` table")


def check_delivery(webhook_id: str, url: str, client=None) -> str:
    """Ask the tracking server to send ``webhook_id``'s test delivery; "" when it reached the service and was
    accepted as signed (any answer but 401: the test payload names a model that is not registered), else one
    line saying what is missing."""
    from mlflow.exceptions import MlflowException

    client = client or _client()
    try:
        result = client.test_webhook(webhook_id)
    except MlflowException as exc:
        return f"the tracking server failed to send a test delivery ({first_line(exc.message)}): {_UNREADABLE_SECRETS}"
    status, error = result.response_status, result.error_message or ""
    if status is not None and status != 401:
        return ""
    if status == 401:
        return ("the tracking server's test delivery was signed with another secret than --webhook-secret-env's: "
                f"{_UNREADABLE_SECRETS}")
    if "InvalidToken" in error or "decrypt" in error.lower():
        return f"the tracking server cannot decrypt the webhook's secret: {_UNREADABLE_SECRETS}"
    return f"the tracking server could not deliver to {url} ({first_line(error)[:200]}): {_DELIVERY_SETTINGS}"
