"""The model registry side of mlflow-di: which version a URI means, what was recorded for it,
and the gate's tags and alias on it.

Recorded results are the runs of the ``mlflow-di`` commands, which all follow one contract:
every run about a registry version carries the tags ``mlflow_di.model_name`` /
``mlflow_di.model_version``; fuzz runs also name the compressed model
(``mlflow_di.compressed_uri``, and ``compressed_name``/``compressed_version`` for a registry
version); a compressed version is registered from its compress run (its ``run_id``). Runs are
searched across every experiment the user can read, newest first; only FINISHED runs count.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re

from mlflow_di.errors import UserError
from mlflow_di.gate import CRITERION, Measurement, missing_message

TAG_PREFIX = "mlflow_di."
_REGISTRY_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/]+))/?$")


@dataclasses.dataclass(frozen=True)
class RegistryRef:
    """``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` taken apart (exactly one of version/alias)."""

    name: str
    version: str | None = None
    alias: str | None = None


def parse_registry_uri(uri: str) -> RegistryRef | None:
    """The registry reference in ``uri``, None for any other kind of model reference."""
    match = _REGISTRY_URI.match(uri.strip()) if isinstance(uri, str) else None
    if not match:
        return None
    return RegistryRef(match["name"], match["version"], match["alias"])


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def resolve_version(uri: str, client=None):
    """The :class:`mlflow.entities.model_registry.ModelVersion` that ``uri`` names (aliases resolved)."""
    from mlflow.exceptions import MlflowException

    ref = parse_registry_uri(uri)
    if ref is None:
        raise UserError(f"'{uri}' is not a registered model version; give models:/NAME/VERSION or models:/NAME@ALIAS")
    client = client or _client()
    try:
        with permission_errors(uri, "read"):
            if ref.alias is not None:
                return client.get_model_version_by_alias(ref.name, ref.alias)
            return client.get_model_version(ref.name, ref.version)
    except MlflowException as exc:
        raise UserError(f"cannot find {uri} in the model registry at {_tracking_uri()}: "
                        f"{_first_line(exc.message)} (check the name/version/alias, or pass --tracking-uri)") from None


def model_version_tags(uri: str) -> dict:
    """Run tags naming the registry version ``uri`` is (aliases resolved); {} for other URIs.

    ``{"mlflow_di.model_name": NAME, "mlflow_di.model_version": VERSION, "mlflow_di.model_uri": uri}``
    """
    if parse_registry_uri(uri) is None:
        return {}
    return version_tags(resolve_version(uri), uri)


def version_tags(version, uri: str) -> dict:
    """The run tags of :func:`model_version_tags` for an already resolved ``version``."""
    return {f"{TAG_PREFIX}model_name": version.name, f"{TAG_PREFIX}model_version": str(version.version),
            f"{TAG_PREFIX}model_uri": uri}


def compressed_model_tags(uri: str) -> dict:
    """Fuzz-run tags naming the compressed model: its URI, and name/version when it is a registry version."""
    tags = {f"{TAG_PREFIX}compressed_uri": uri}
    if parse_registry_uri(uri) is not None:
        version = resolve_version(uri)
        tags[f"{TAG_PREFIX}compressed_name"] = version.name
        tags[f"{TAG_PREFIX}compressed_version"] = str(version.version)
    return tags


def version_uri(version) -> str:
    return f"models:/{version.name}/{version.version}"


# ------------------------------------------------------------------------------ recorded runs
def _quote(value: str) -> str:
    """A search-filter string literal (MLflow accepts '...' and "..." quoting)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise UserError(f"cannot search for runs tagged {value!r}: it contains both kinds of quote")


def _tag_filter(tags: dict) -> str:
    return " and ".join(f"tags.`{key}` = {_quote(str(value))}" for key, value in tags.items())


def _experiment_ids(client) -> list[str]:
    ids, token = [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        ids.extend(e.experiment_id for e in page)
        token = page.token
        if not token:
            return ids


def search_recorded_runs(command: str, tags: dict, metric: str, client=None, max_results: int = 1000) -> list:
    """FINISHED runs of ``mlflow-di COMMAND`` with ``tags`` that recorded ``metric``, newest first."""
    client = client or _client()
    experiment_ids = _experiment_ids(client)
    if not experiment_ids:
        return []
    query = (f"{_tag_filter({f'{TAG_PREFIX}command': command, **tags})} and attributes.status = 'FINISHED'"
             f" and metrics.`{metric}` > -1e300")  # the metric filter keeps only runs that logged it
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, query, max_results=max_results, page_token=token,
                                  order_by=["attributes.start_time DESC"])
        runs.extend(page)
        token = page.token
        if not token or len(runs) >= max_results:
            return runs


def measurements(subject_uri: str, compressed: list[str] | None = None, client=None) -> list[Measurement]:
    """Every gated value recorded for the version ``subject_uri`` names (see :mod:`mlflow_di.gate`).

    ``compressed``: the compressed models to read fuzz/compress results for (URIs as given to
    ``mlflow-di fuzz``); None or empty: every compressed model with a recorded fuzz or compress run.
    Missing values come back as measurements with ``value=None`` and a message saying what to run.
    """
    client = client or _client()
    subject = resolve_version(subject_uri, client)
    subject_tags = {f"{TAG_PREFIX}model_name": subject.name, f"{TAG_PREFIX}model_version": str(subject.version)}
    found = [_coverage(subject_uri, subject_tags, client)]
    targets = [_CompressedTarget.of(uri, client) for uri in compressed] if compressed else \
        _recorded_targets(subject_tags, client)
    for target in targets:
        found.extend(_fuzz(subject_uri, subject_tags, target, client))
        found.append(_compress(subject_uri, subject, target, client))
    return found


def _coverage(subject_uri: str, subject_tags: dict, client) -> Measurement:
    runs = search_recorded_runs("coverage", subject_tags, "idc", client, max_results=1)
    if not runs:
        return Measurement("idc", None, missing=missing_message(CRITERION["idc"], subject_uri))
    return Measurement("idc", runs[0].data.metrics["idc"], run_id=runs[0].info.run_id)


@dataclasses.dataclass
class _CompressedTarget:
    """A compressed model the gate reads results for: display key and the fuzz-run tags naming it."""

    key: str
    fuzz_tags: dict
    compress_run_id: str | None = None  # the run that registered it, for registry versions

    @classmethod
    def of(cls, uri: str, client) -> "_CompressedTarget":
        if parse_registry_uri(uri) is None:
            return cls(uri, {f"{TAG_PREFIX}compressed_uri": uri})
        version = resolve_version(uri, client)
        return cls(version_uri(version), {f"{TAG_PREFIX}compressed_name": version.name,
                                          f"{TAG_PREFIX}compressed_version": str(version.version)},
                   version.run_id)


def _recorded_targets(subject_tags: dict, client) -> list[_CompressedTarget]:
    """Every compressed model that has a fuzz run against the subject or was compressed from it."""
    targets: dict[str, _CompressedTarget] = {}
    for run in search_recorded_runs("fuzz", subject_tags, "success_rate", client):
        tags = run.data.tags
        name, number = tags.get(f"{TAG_PREFIX}compressed_name"), tags.get(f"{TAG_PREFIX}compressed_version")
        if name and number:
            key = f"models:/{name}/{number}"
            target = _CompressedTarget(key, {f"{TAG_PREFIX}compressed_name": name,
                                             f"{TAG_PREFIX}compressed_version": number})
        elif tags.get(f"{TAG_PREFIX}compressed_uri"):
            key = tags[f"{TAG_PREFIX}compressed_uri"]
            target = _CompressedTarget(key, {f"{TAG_PREFIX}compressed_uri": key})
        else:
            continue
        targets.setdefault(key, target)
    for run in search_recorded_runs("compress", subject_tags, "accuracy_drop", client):
        registered = client.search_model_versions(f"run_id = {_quote(run.info.run_id)}")
        for version in registered:
            key = version_uri(version)
            target = targets.setdefault(key, _CompressedTarget(key, {
                f"{TAG_PREFIX}compressed_name": version.name, f"{TAG_PREFIX}compressed_version": str(version.version)}))
            target.compress_run_id = run.info.run_id
    return [targets[key] for key in sorted(targets)]


def _fuzz(subject_uri: str, subject_tags: dict, target: _CompressedTarget, client) -> list[Measurement]:
    runs = search_recorded_runs("fuzz", {**subject_tags, **target.fuzz_tags}, "success_rate", client, max_results=1)
    if not runs:
        message = missing_message(CRITERION["success_rate"], subject_uri, target.key)
        return [Measurement(metric, None, target.key, missing=message) for metric in ("success_rate", "mean_queries")]
    run = runs[0]
    metrics, run_id = run.data.metrics, run.info.run_id
    mean_queries = metrics.get("mean_queries")
    if mean_queries is None or math.isnan(mean_queries):
        # no deviating input found: no mean per deviation, and the hardest outcome for an attacker
        found_none = metrics.get("triggers") == 0 or metrics.get("success_rate") == 0
        mean_queries = math.inf if found_none else None
    missing = "" if mean_queries is not None else f"fuzz run {run_id} recorded no mean_queries"
    return [Measurement("success_rate", metrics["success_rate"], target.key, run_id),
            Measurement("mean_queries", mean_queries, target.key, run_id, missing)]


def _producing_run(target: _CompressedTarget, client):
    """The run that created the compressed registry version ``target`` (None when unknown)."""
    from mlflow.exceptions import MlflowException

    try:
        if target.compress_run_id is None and parse_registry_uri(target.key) is not None:
            target.compress_run_id = resolve_version(target.key, client).run_id
        return client.get_run(target.compress_run_id) if target.compress_run_id else None
    except (MlflowException, UserError):
        return None


def _compress(subject_uri: str, subject, target: _CompressedTarget, client) -> Measurement:
    """accuracy_drop from the compress run that produced the compressed version."""
    missing = missing_message(CRITERION["accuracy_drop"], subject_uri, target.key)
    run = _producing_run(target, client)
    if run is None:
        return Measurement("accuracy_drop", None, target.key, missing=missing)
    tags = run.data.tags
    if (tags.get(f"{TAG_PREFIX}command") != "compress" or run.info.status != "FINISHED"
            or "accuracy_drop" not in run.data.metrics):
        return Measurement("accuracy_drop", None, target.key, missing=missing)
    source = (tags.get(f"{TAG_PREFIX}model_name"), tags.get(f"{TAG_PREFIX}model_version"))
    if source != (subject.name, str(subject.version)):
        origin = f"models:/{source[0]}/{source[1]}" if all(source) else "another model"
        return Measurement("accuracy_drop", None, target.key, missing=(
            f"{target.key} was compressed from {origin}, not from {version_uri(subject)}"))
    return Measurement("accuracy_drop", run.data.metrics["accuracy_drop"], target.key, run.info.run_id)


# ------------------------------------------------------------------------------ writing
def gate_tags(verdict, checked_at: str, run_id: str) -> dict:
    """The model-version tags recording ``verdict``.

    Every key is written on every check (a value not measured this time reads ``missing``), so
    no stale value survives and no tag is ever deleted: deleting needs MANAGE permission on the
    registered model, writing only EDIT.
    """
    thresholds = {name: value for name, value in verdict.thresholds.to_dict().items() if value is not None}
    tags = {f"{TAG_PREFIX}gate": "pass" if verdict.passed else "fail",
            f"{TAG_PREFIX}gate_checked_at": checked_at,
            f"{TAG_PREFIX}gate_summary": verdict.summary()[:4000],
            f"{TAG_PREFIX}gate_thresholds": json.dumps(thresholds, sort_keys=True),
            f"{TAG_PREFIX}gate_run_id": run_id}
    for metric in CRITERION:
        value = verdict.worst(metric)
        tags[f"{TAG_PREFIX}{metric}"] = "missing" if value is None else format_value(value)
    return tags


def format_value(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.6g}"


def write_version_tags(version, tags: dict, client=None) -> None:
    """Set ``tags`` on the model version (needs EDIT permission on the registered model)."""
    client = client or _client()
    with permission_errors(version_uri(version), "write tags on"):
        for key, value in tags.items():
            client.set_model_version_tag(version.name, str(version.version), key, value)


def set_alias(version, alias: str, client=None) -> None:
    """Point ``alias`` of the registered model at ``version``."""
    client = client or _client()
    with permission_errors(version_uri(version), "move aliases of"):
        client.set_registered_model_alias(version.name, alias, str(version.version))


@contextlib.contextmanager
def permission_errors(uri: str, action: str):
    """Turn the tracking server's 403/401 into one line naming the user and the permission needed."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        user = os.environ.get("MLFLOW_TRACKING_USERNAME") or "(anonymous)"
        if exc.error_code == "PERMISSION_DENIED":
            needed = "READ" if action == "read" else "EDIT"
            verb = "may not read" if action == "read" else f"may not {action}"
            raise UserError(f"user {user} {verb} {uri} (needs {needed} permission on the registered model)") from None
        if exc.error_code == "UNAUTHENTICATED":
            raise UserError(f"the tracking server {_tracking_uri()} rejected the credentials of user {user}; "
                            "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD") from None
        raise


def _tracking_uri() -> str:
    import mlflow

    return mlflow.get_tracking_uri()


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else "unknown error"
