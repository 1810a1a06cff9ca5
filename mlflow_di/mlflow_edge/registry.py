"""The model registry: which version a URI means, the tags that name it, lineage, tags and aliases.

Writing version tags always goes through :func:`write_version_tags`, which turns the server's
403/401 into one line naming the permission needed.
"""
from __future__ import annotations

import contextlib
import json
import math

from mlflow_di.errors import UserError
from mlflow_di.gate import CHECKS, RELATIONS, confidence_text
from mlflow_di.mlflow_edge.connection import first_line, permission_errors, store_hint, tracking_uri
from mlflow_di.models.reference import ModelRef, RefKind

TAG_PREFIX = "mlflow_di."


def registry_ref(uri) -> ModelRef | None:
    """The parsed reference when ``uri`` is ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``, else None."""
    try:
        ref = ModelRef.parse(uri)
    except UserError:
        return None
    return ref if ref.kind is RefKind.REGISTRY else None


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def resolve_version(uri: str, client=None):
    """The :class:`mlflow.entities.model_registry.ModelVersion` that ``uri`` names (aliases resolved)."""
    from mlflow.exceptions import MlflowException

    ref = registry_ref(uri)
    if ref is None:
        raise UserError(f"'{uri}' is not a registered model version; give models:/NAME/VERSION or models:/NAME@ALIAS")
    client = client or _client()
    try:
        with permission_errors(uri, "read"):
            if ref.alias is not None:
                return client.get_model_version_by_alias(ref.name, ref.alias)
            return client.get_model_version(ref.name, ref.version)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            raise UserError(f"the model registry at {tracking_uri()} failed to answer for {uri} ({exc.error_code}: "
                            f"{first_line(exc.message)}); it is the server's error, not the name's: try again, or "
                            "check the server's log") from None
        raise UserError(f"cannot find {uri} in the model registry at {tracking_uri()}: "
                        f"{first_line(exc.message)} ({store_hint()})") from None


def resolve_if_set(uri: str, client=None):
    """:func:`resolve_version`, but None when ``uri`` is ``models:/NAME@ALIAS`` of an existing
    registered model that has no such alias (yet)."""
    from mlflow.exceptions import MlflowException

    ref = registry_ref(uri)
    if ref is not None and ref.alias is not None:
        client = client or _client()
        try:
            with permission_errors(uri, "read"):
                aliases = client.get_registered_model(ref.name).aliases or {}
        except MlflowException:
            aliases = None  # no such model: resolve_version says so
        if aliases is not None and ref.alias not in aliases:
            return None
    return resolve_version(uri, client)


def previous_version(version, client=None):
    """The predecessor of the resolved ``version``: the highest version number of the same
    registered model below its own, or None when it is the first (lowest) one."""
    from mlflow.exceptions import MlflowException

    client = client or _client()
    number, best, token = int(version.version), None, None
    name = f"'{version.name}'" if "'" not in version.name else f'"{version.name}"'
    try:
        with permission_errors(version_uri(version), "read"):
            while True:
                page = client.search_model_versions(f"name = {name}", page_token=token)
                for other in page:
                    if other.name == version.name and int(other.version) < number and \
                            (best is None or int(other.version) > int(best.version)):
                        best = other
                token = page.token
                if not token:
                    break
    except MlflowException as exc:
        raise UserError(f"cannot list the versions of '{version.name}' in the model registry at {tracking_uri()}: "
                        f"{first_line(exc.message)}") from None
    # search results may leave out tags (the lineage tags matter): read the version itself
    return None if best is None else resolve_version(version_uri(best), client)


def model_version_tags(uri: str) -> dict:
    """Run tags naming the registry version ``uri`` is (aliases resolved); {} for other URIs.

    ``{"mlflow_di.model_name": NAME, "mlflow_di.model_version": VERSION, "mlflow_di.model_uri": uri}``
    """
    if registry_ref(uri) is None:
        return {}
    return version_tags(resolve_version(uri), uri)


def version_tags(version, uri: str) -> dict:
    """The run tags of :func:`model_version_tags` for an already resolved ``version``."""
    return {f"{TAG_PREFIX}model_name": version.name, f"{TAG_PREFIX}model_version": str(version.version),
            f"{TAG_PREFIX}model_uri": uri}


def compressed_model_tags(uri: str) -> dict:
    """Fuzz-run tags naming the compressed model: its URI, and name/version when it is a registry version."""
    tags = {f"{TAG_PREFIX}compressed_uri": uri}
    if registry_ref(uri) is not None:
        version = resolve_version(uri)
        tags[f"{TAG_PREFIX}compressed_name"] = version.name
        tags[f"{TAG_PREFIX}compressed_version"] = str(version.version)
    return tags


def compressed_key(uri: str) -> str:
    """How the gate names a compressed model: ``models:/NAME/VERSION`` for a registry version
    (aliases resolved), else the URI as given."""
    return version_uri(resolve_version(uri)) if registry_ref(uri) is not None else uri


def logged_model_id(uri: str, client=None) -> str | None:
    """The id of the LoggedModel behind the registry version ``uri`` (``models:/NAME/VERSION`` or
    ``@ALIAS``): the version's ``model_id`` (MLflow 3), else the ``m-...`` id of a ``models:/m-...``
    source; None for other URIs, for versions registered from a run artifact (MLflow 2 style) and
    when the registry cannot be read (results are then logged to the run only)."""
    if registry_ref(uri) is None:
        return None
    try:
        version = resolve_version(uri, client)
    except UserError:
        return None
    return version_model_id(version)


def version_model_id(version) -> str | None:
    """The LoggedModel id of an already resolved ``version`` (see :func:`logged_model_id`)."""
    model_id = getattr(version, "model_id", None)
    if model_id:
        return model_id
    source = getattr(version, "source", None) or ""
    if source.startswith("models:/m-"):
        return source.removeprefix("models:/").split("/")[0]
    return None


def version_uri(version) -> str:
    return f"models:/{version.name}/{version.version}"


def lineage_source(version, client=None):
    """The registry version an export was made from (its ``mlflow_di.source_name`` /
    ``source_version`` tags, written by ``compress``), or None when ``version`` is no export of one."""
    name, number = (version.tags or {}).get(f"{TAG_PREFIX}source_name"), (version.tags or {}).get(
        f"{TAG_PREFIX}source_version")
    if not name or not number:
        return None
    return resolve_version(f"models:/{name}/{number}", client)


# ------------------------------------------------------------------------------ writing
#: Tags earlier versions of the gate wrote and this one no longer does (removed when met).
RETIRED_GATE_TAGS = ("gate", "gate_summary")


def gate_tags(verdict, checked_at: str, run_id: str) -> dict:
    """The model-version tags recording ``verdict``: ``mlflow_di.verdict`` (PASS, FAIL, INCONCLUSIVE or
    ERROR), when and by which run, the thresholds, and the value of each check that was asked for and
    measured (the least favourable over the compressed models), with ``METRIC_interval`` (its 95%
    interval, sample size and method) and ``METRIC_result`` (that check's PASS, FAIL or INCONCLUSIVE).
    A check nobody asked for gets no tag; one that was asked for but not measured gets none either
    (the verdict is then ERROR and the description says what to run). The description holds the
    full table (:func:`write_verdict_description`).
    """
    thresholds = {name: value for name, value in verdict.thresholds.to_dict().items() if value is not None}
    tags = {f"{TAG_PREFIX}verdict": verdict.outcome,
            f"{TAG_PREFIX}gate_checked_at": checked_at,
            f"{TAG_PREFIX}gate_thresholds": json.dumps(thresholds, sort_keys=True),
            f"{TAG_PREFIX}gate_run_id": run_id,
            # the runs whose values were judged: what to open to check the verdict
            f"{TAG_PREFIX}gate_evidence": ",".join(sorted({c.run_id for c in verdict.checks if c.run_id}))[:5000] or "-"}
    asked = {check.criterion for check in verdict.checks}
    for metric in CHECKS:
        value = verdict.worst(metric) if metric in asked else None
        if value is not None:
            tags[f"{TAG_PREFIX}{metric}"] = format_value(value)
            check = next((c for c in verdict.checks if c.metric == metric and c.relation is None
                          and c.measured == value), None)
            if check is not None and check.compressed:  # a per-export check: which export the least favourable is
                tags[f"{TAG_PREFIX}{metric}_export"] = check.compressed
            if check is not None:
                tags[f"{TAG_PREFIX}{metric}_result"] = check.outcome
                if check.interval is not None:
                    tags[f"{TAG_PREFIX}{metric}_interval"] = interval_tag(check)
    if any(check.relation for check in verdict.checks):  # "none": asked for, not set yet (--baseline-optional)
        tags[f"{TAG_PREFIX}gate_baseline"] = verdict.baseline_uri or "none"
    for relation in RELATIONS:
        check = verdict.worst_change(relation) if relation in asked else None
        if check is not None:
            tags[f"{TAG_PREFIX}{relation}"] = format_value(check.change)
            tags[f"{TAG_PREFIX}{relation}_baseline"] = format_value(check.baseline)
    return tags


def interval_tag(check) -> str:
    """A check's interval as its tag holds it, e.g. ``0.003274-0.02332 (95% CI, n=497, Clopper-Pearson)``."""
    low, high = check.interval
    size = f", n={check.n}" if check.n else ""
    method = f", {check.interval_method}" if check.interval_method else ""
    return f"{format_value(low)}-{format_value(high)} ({confidence_text(check.confidence)} CI{size}{method})"


def stale_gate_tags(version, tags: dict) -> list[str]:
    """Keys of gate tags ``version`` carries from an earlier gate that ``tags`` (this gate's) lacks."""
    ours = {f"{TAG_PREFIX}{name}" for name in (*CHECKS, *(f"{c}{suffix}" for c in CHECKS
                                                          for suffix in ("_export", "_result", "_interval")), *RELATIONS,
                                               *(f"{r}_baseline" for r in RELATIONS), "gate_baseline",
                                               *RETIRED_GATE_TAGS)}
    return sorted(key for key in (version.tags or {}) if key in ours and key not in tags)


def remove_version_tags(version, keys, client=None) -> None:
    """Delete ``keys`` from the version's tags; where the user may not delete (MLflow may ask more
    permission for it than for writing), mark them ``-`` instead, so no stale value reads as current."""
    from mlflow.exceptions import MlflowException

    client = client or _client()
    for key in keys:
        try:
            client.delete_model_version_tag(version.name, str(version.version), key)
        except MlflowException:
            write_version_tags(version, {key: "-"}, client)


#: The verdict tag (the commit of a verdict: written last) and the reason an ERROR verdict carries.
VERDICT, VERDICT_REASON = f"{TAG_PREFIX}verdict", f"{TAG_PREFIX}verdict_reason"


def begin_verdict(version, run_id: str, client=None) -> None:
    """The first write of a verdict (it needs EDIT, so a user without it gets one line and nothing is
    written): ``mlflow_di.verdict`` ERROR, with the reason that gate run ``run_id`` is writing. A reader
    who looks while the verdict is written, or after the gate was killed mid-write, reads ERROR and why,
    never half of one verdict and half of another; :func:`commit_verdict` is the last write."""
    write_version_tags(version, {VERDICT_REASON: f"gate run {run_id} is writing the verdict; if this stays, that gate "
                                 "was stopped before it finished: gate the version again", VERDICT: "ERROR"}, client)


def commit_verdict(version, outcome: str, client=None) -> None:
    """The last write of a verdict: its outcome in ``mlflow_di.verdict``, the writing note removed."""
    write_version_tags(version, {VERDICT: outcome}, client)
    remove_version_tags(version, [VERDICT_REASON], client)


def abandon_verdict(version, run_id: str, reason: str, client=None) -> None:
    """After a failed write of a verdict: the version says ERROR and why, in its tag and at the top of its
    description, so tags, description and alias never disagree silently. Best effort: the failure may be
    the server's, and then the ERROR that :func:`begin_verdict` wrote stays."""
    from mlflow.exceptions import MlflowException

    text = f"gate run {run_id} could not finish writing its verdict: {reason}"
    with contextlib.suppress(MlflowException, UserError, OSError):
        write_version_tags(version, {VERDICT_REASON: text[:5000], VERDICT: "ERROR"}, client)  # the reason first
        write_verdict_description(version, f"## mlflow-di gate: ERROR\n\n{text}\n", client)


#: The line that ends the verdict mlflow-di writes at the top of a version's description; the
#: user's own text below it is kept when the verdict is written again.
DESCRIPTION_END = "<!-- end of the mlflow-di verdict; text below is kept -->"


def write_verdict_description(version, verdict_text: str, client=None) -> None:
    """Put ``verdict_text`` (Markdown) at the top of the version's description, replacing an earlier
    verdict and keeping whatever else the description says."""
    client = client or _client()
    current = client.get_model_version(version.name, str(version.version)).description or ""
    kept = current.split(DESCRIPTION_END, 1)[1].lstrip("\n") if DESCRIPTION_END in current else current
    # a name holding the marker must not end the verdict early (each later gate would keep the old one below)
    verdict_text = verdict_text.replace(DESCRIPTION_END, DESCRIPTION_END.replace("<!--", "<!\u2060--"))
    text = f"{verdict_text.rstrip()}\n\n{DESCRIPTION_END}\n" + (f"\n{kept}" if kept.strip() else "")
    with permission_errors(version_uri(version), "write the description of"):
        client.update_model_version(version.name, str(version.version), description=text)


def drop_alias_from(version, alias: str, client=None) -> bool:
    """Remove ``alias`` when it points at ``version`` (which no longer passes); an alias on another
    version (an earlier PASS) stays. True when it was removed."""
    from mlflow.exceptions import MlflowException

    client = client or _client()
    try:
        current = client.get_model_version_by_alias(version.name, alias)
    except MlflowException:
        return False
    if str(current.version) != str(version.version):
        return False
    with permission_errors(version_uri(version), f"remove the alias '{alias}' from", "MANAGE"):
        client.delete_registered_model_alias(version.name, alias)
    return True


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
