"""The gate's search: what the ``mlflow-di`` commands recorded about a registry version.

Recorded results are the runs of the ``mlflow-di`` commands, which all follow one contract:
every run about a registry version carries the tags ``mlflow_di.model_name`` /
``mlflow_di.model_version``; fuzz runs also name the compressed model
(``mlflow_di.compressed_uri``, and ``compressed_name``/``compressed_version`` for a registry
version); a compressed version is registered from its compress run (its ``run_id``) and names
its source in the version tags ``mlflow_di.source_name`` / ``source_version``; robustness runs
map each compressed model they measured (``models:/NAME/VERSION`` or its URI) to the slug of its
metrics in the JSON tag ``mlflow_di.robustness_compressed``. Coverage and fuzz results are read
first from the runs that logged them on the version's LoggedModel (what the model's page shows,
:func:`logged_model_runs`), else searched across every experiment the user can read; newest
first either way, and only FINISHED runs with the contract's tags count.

Gating an export (a version with source tags) reads coverage from its source version (coverage
is a property of the PyTorch model and its tests) and fuzz/compress results of the source
against this export.

Each compressed model's measurements carry its compression method (the version tag
``mlflow_di.method`` that ``compress`` writes, else the producing run's tag of that name), by
which :func:`mlflow_di.gate.pair` matches a candidate's export with a baseline's.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math

from mlflow_di.errors import UserError
from mlflow_di.fuzz.strategies import REALISM
from mlflow_di.gate import CHECKS, PINNED, RULE, Baseline, Evidence, Measurement, missing_message
from mlflow_di.mlflow_edge.evidence_tags import EVIDENCE_DATA, EVIDENCE_HELD_OUT, EVIDENCE_ROLE
from mlflow_di.mlflow_edge.registry import (TAG_PREFIX, _client, lineage_source, previous_version, registry_ref,
                                            resolve_if_set, resolve_version, version_model_id, version_uri)


def _quote(value: str) -> str:
    """A search-filter string literal (MLflow accepts '...' and "..." quoting)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise UserError(f"cannot search for runs tagged {value!r}: it contains both kinds of quote")


def data_param(run, key: str) -> str:
    """A run's data-spec param without the shell quotes ``mlflow run`` logs around it (``'digits[1300:]'``)."""
    value = str(run.data.params.get(key, "") or "")
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def tag_filter(tags: dict) -> str:
    """A search filter for runs with ``tags``. A value holding both kinds of quote cannot be written as
    a literal: it is matched with LIKE, each ``'`` a one-character wildcard, so the filter may match
    more runs than the tags name; :func:`matching` keeps the exact ones."""
    def condition(key: str, value: str) -> str:
        if "'" in value and '"' in value:
            return f"tags.`{key}` LIKE '{value.replace(chr(39), '_')}'"
        return f"tags.`{key}` = {_quote(value)}"

    return " and ".join(condition(key, str(value)) for key, value in tags.items())


def matching(runs: list, tags: dict) -> list:
    """The runs whose tags equal ``tags`` exactly (see :func:`tag_filter`)."""
    return [run for run in runs if all(run.data.tags.get(key) == str(value) for key, value in tags.items())]


def experiment_ids(client) -> list[str]:
    ids, token = [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        ids.extend(e.experiment_id for e in page)
        token = page.token
        if not token:
            return ids


#: The runs the gate may read (None: any, the newest of each kind); see :func:`only_runs`.
_pinned: contextvars.ContextVar = contextvars.ContextVar("mlflow_di_pinned_runs", default=None)


@contextlib.contextmanager
def only_runs(run_ids):
    """Inside the block the searches below find only the runs ``run_ids`` (None or empty: any run).
    How a gate judges exactly the evidence it was given (a pipeline's own step runs) instead of
    whichever run of each kind is newest."""
    token = _pinned.set(frozenset(run_ids) if run_ids else None)
    try:
        yield
    finally:
        _pinned.reset(token)


def search_recorded_runs(command: str, tags: dict, metric: str, client=None, max_results: int = 1000) -> list:
    """FINISHED runs of ``mlflow-di COMMAND`` with ``tags`` that recorded ``metric``, newest first."""
    client = client or _client()
    experiments = experiment_ids(client)
    if not experiments:
        return []
    query = (f"{tag_filter({f'{TAG_PREFIX}command': command, **tags})} and attributes.status = 'FINISHED'"
             f" and metrics.`{metric}` > -1e300")  # the metric filter keeps only runs that logged it
    if _pinned.get() is not None:
        query += f" and attributes.run_id IN ({', '.join(_quote(run_id) for run_id in sorted(_pinned.get()))})"
    runs, token = [], None
    while True:
        page = client.search_runs(experiments, query, max_results=max_results, page_token=token,
                                  order_by=["attributes.start_time DESC"])
        runs.extend(matching(page, {f"{TAG_PREFIX}command": command, **tags}))
        token = page.token
        if not token or len(runs) >= max_results:
            return runs


def logged_model_runs(model_id: str | None, command: str, tags: dict, metric: str, client=None,
                      max_results: int = 100) -> list:
    """The runs that logged ``metric`` on the LoggedModel ``model_id`` (the model's own page in the
    UI), newest first, kept only when they pass :func:`search_recorded_runs`'s test: FINISHED runs
    of ``mlflow-di COMMAND`` carrying ``tags``; at most ``max_results`` (runs are fetched only until
    then). Empty for no id or a LoggedModel that cannot be read."""
    from mlflow.exceptions import MlflowException

    if not model_id:
        return []
    client = client or _client()
    try:
        logged = client.get_logged_model(model_id)
    except MlflowException:
        return []
    wanted = {f"{TAG_PREFIX}command": command, **{key: str(value) for key, value in tags.items()}}
    runs, seen = [], set()
    for entry in sorted((m for m in logged.metrics or [] if m.key == metric and m.run_id),
                        key=lambda m: m.timestamp, reverse=True):
        if entry.run_id in seen or (_pinned.get() is not None and entry.run_id not in _pinned.get()):
            continue
        seen.add(entry.run_id)
        try:
            run = client.get_run(entry.run_id)
        except MlflowException:
            continue
        if run.info.status == "FINISHED" and metric in run.data.metrics and \
                all(run.data.tags.get(key) == value for key, value in wanted.items()):
            runs.append(run)
            if len(runs) >= max_results:
                break
    return runs


def recorded_runs(command: str, tags: dict, metric: str, client=None, model_id: str | None = None,
                  max_results: int = 1) -> list:
    """What the gate reads: up to ``max_results`` runs the LoggedModel ``model_id`` shows ``metric``
    from, when it has any (:func:`logged_model_runs`), else :func:`search_recorded_runs` across experiments."""
    return logged_model_runs(model_id, command, tags, metric, client, max_results) or \
        search_recorded_runs(command, tags, metric, client, max_results=max_results)


def gate_subject(uri: str, client=None) -> tuple:
    """(the version ``uri`` names, the version it was exported from or None)."""
    client = client or _client()
    version = resolve_version(uri, client)
    return version, lineage_source(version, client)


def measurements(subject_uri: str, compressed: list[str] | None = None, client=None,
                 resolved: tuple | None = None, semantics: str = "host", allow_calibration_evidence: bool = False,
                 exclude: tuple[str, ...] = (), realism_budget=None, runtime=None) -> list[Measurement]:
    """Every gated value recorded for the version ``subject_uri`` names (see :mod:`mlflow_di.gate`).

    ``compressed``: the compressed models to read fuzz/compress results for (URIs as given to
    ``mlflow-di fuzz``); None or empty: every compressed model with a recorded fuzz or compress run.
    When ``subject_uri`` is an export, its source's coverage counts and the only compressed model
    is the export itself. Missing values come back as measurements with ``value=None`` and a
    message saying what to run. ``resolved``: :func:`gate_subject`'s answer, when the caller has it.
    ``semantics``: which answers of an int8 export the compress criteria read (host, reference or both).
    ``allow_calibration_evidence``: judge compress figures measured on calibration or training data
    (refused by default, :func:`_compress_evidence`). ``exclude``: exports not to judge (registry URIs).
    ``realism_budget``: the realism check's budget (a :class:`~mlflow_di.fuzz.realism.Constraint`; default
    its DEFAULT_BUDGET): only campaigns that searched inside one at least as strict count for it.
    ``runtime``: a :class:`~mlflow_di.models.runtimes.RuntimeChoice` whose answers are judged (None: whatever
    runtime each figure was measured on, named in its evidence): only campaigns run on it count, and a compress
    run's figures on it (its own, or ``runtime.SLUG.*`` beside them).
    Each measured value carries its :class:`~mlflow_di.gate.Evidence`, chosen by :data:`~mlflow_di.gate.RULE`.
    """
    client = client or _client()
    subject, source = resolved or gate_subject(subject_uri, client)
    if source is not None:  # an export: coverage belongs to its source, fuzzing compares the two
        compressed = [version_uri(subject)]
        subject, subject_uri = source, version_uri(source)
    subject_tags = {f"{TAG_PREFIX}model_name": subject.name, f"{TAG_PREFIX}model_version": str(subject.version)}
    found = _coverage(subject_uri, subject_tags, client, version_model_id(subject))
    robustness_runs = search_recorded_runs("robustness", subject_tags, ROBUSTNESS_METRIC, client)
    targets = [_CompressedTarget.of(uri, client) for uri in compressed] if compressed else \
        _recorded_targets(subject_tags, client, robustness_runs)
    excluded = {_CompressedTarget.of(uri, client).key for uri in exclude}
    for target in (t for t in targets if t.key not in excluded):
        of_target = [*_fuzz(subject_uri, subject_tags, target, client, realism_budget, runtime),
                     *_compress(subject_uri, subject, target, client=client, semantics=semantics,
                                allow_calibration_evidence=allow_calibration_evidence, runtime=runtime),
                     _robustness(subject_uri, target, robustness_runs)]
        method = _method(target, client)
        for measurement in of_target:
            measurement.method = method
        found.extend(of_target)
    return found


PREVIOUS = "previous"


def baseline_version(uri: str, optional: bool = False, client=None, candidate_uri: str | None = None):
    """The version ``--baseline uri`` names; None when it is an alias not set yet and ``optional``.

    ``uri`` ``previous`` means the predecessor of the candidate ``candidate_uri``: the highest
    version number of the same registered model below the candidate's
    (:func:`~mlflow_di.mlflow_edge.registry.previous_version`); the first version has none, which
    is treated like an alias not set yet. An alias not set yet on an existing registered model
    (the first version ever) is a one-line error unless ``optional``; so is any other baseline
    that cannot be found.
    """
    client = client or _client()
    if uri.strip() == PREVIOUS:
        candidate = resolve_version(candidate_uri, client)
        version = previous_version(candidate, client)
        if version is None and not optional:
            raise UserError(f"--baseline previous: {version_uri(candidate)} has no previous version (the first "
                            f"version?); pass --baseline-optional to pass the relative checks as 'no baseline'")
        return version
    try:
        version = resolve_if_set(uri, client)
    except UserError as exc:
        raise UserError(f"--baseline: {exc}") from None
    if version is None and not optional:
        raise UserError(f"--baseline {uri}: the registered model has no such alias yet (the first version?); "
                        f"pass --baseline-optional to pass the relative checks as 'no baseline' until it is set")
    return version


def baseline(uri: str, version, candidate, client=None) -> Baseline:
    """The measurements of the baseline ``version`` (that ``uri`` named; None: not set yet) to compare
    ``candidate`` (a resolved version) with, read as :func:`measurements` reads the candidate's.
    A baseline that is the candidate itself is an error."""
    if version is None:
        if uri.strip() == PREVIOUS:
            return Baseline(None, absent=f"no baseline: {version_uri(candidate)} has no previous version "
                                         f"(--baseline-optional)")
        return Baseline(None, absent=f"no baseline: {uri} is not set yet (--baseline-optional)")
    client = client or _client()
    if (version.name, str(version.version)) == (candidate.name, str(candidate.version)):
        raise UserError(f"--baseline {uri} is the candidate itself ({version_uri(version)}); compare with another "
                        f"version, e.g. the one the champion alias points to")
    source = lineage_source(version, client)
    return Baseline(version_uri(version), measurements(version_uri(version), client=client, resolved=(version, source)),
                    is_export=source is not None)


def sized(measurement: Measurement, run, recorded: str | None = None) -> Measurement:
    """``measurement`` with the 95% interval and sample size its ``run`` recorded beside it
    (``RECORDED_low``, ``RECORDED_high``, ``RECORDED_n``; a speedup's ``_pairs``), when its check is a sample's
    figure (:attr:`~mlflow_di.gate.CheckDeclaration.sample`). A figure recorded without them (by an older
    mlflow-di) is ``unsized``: it can decide nothing, and says what to run again. An infinite mean of queries
    (no deviation found) is exact."""
    criterion = CHECKS[measurement.metric] if measurement.metric in CHECKS else None
    if criterion is None or not criterion.sample or not measurement.found or math.isinf(measurement.value):
        return measurement
    recorded = recorded or criterion.run_metric
    metrics = run.data.metrics
    low, high = metrics.get(f"{recorded}_low"), metrics.get(f"{recorded}_high")
    size = metrics.get(f"{recorded}_n", metrics.get(f"{recorded}_pairs"))
    if low is None or high is None:
        command = run.data.tags.get(f"{TAG_PREFIX}command", criterion.command)
        measurement.unsized = (f"{command} run {run.info.run_id} recorded {recorded} without its 95% interval (by an "
                               f"older mlflow-di), so it cannot decide {criterion.threshold_name}; run `mlflow-di "
                               f"{command}` again")
        return measurement
    measurement.interval = (float(low), float(high))
    measurement.n = None if size is None else int(size)
    measurement.interval_method = criterion.interval_method
    measurement.confidence = float(metrics.get("interval_confidence", measurement.confidence))
    return measurement


def _coverage(subject_uri: str, subject_tags: dict, client, model_id: str | None = None) -> list[Measurement]:
    """Every coverage check's value (IDC, and any check registered on a coverage metric) from the newest
    coverage run that logged it."""
    found = []
    rule = PINNED if _pinned.get() is not None else "the newest coverage run of the version"
    for criterion in (c for c in CHECKS.values() if c.command == "coverage"):
        runs = recorded_runs("coverage", subject_tags, criterion.run_metric, client, model_id)
        if not runs:
            found.append(Measurement(criterion.metric, None, missing=_no_coverage(criterion, subject_uri, subject_tags,
                                                                                  client, model_id)))
            continue
        run, data = runs[0], data_param(runs[0], "test_data")
        found.append(sized(Measurement(criterion.metric, run.data.metrics[criterion.run_metric], run_id=run.info.run_id,
                                       data=data, evidence=Evidence(run.info.run_id, "coverage", "test", data, rule=rule)),
                           run))
    return found


def _no_coverage(criterion, subject_uri: str, subject_tags: dict, client, model_id: str | None) -> str:
    """Why no coverage run gives ``criterion``: none recorded, or the newest coverage runs computed other criteria
    (a classic-only run has no IDC) or recorded IDC in an older form (without its reachable combinations)."""
    runs = recorded_runs("coverage", subject_tags, "nc", client, model_id) or \
        recorded_runs("coverage", subject_tags, "idc", client, model_id)
    if not runs:
        return missing_message(criterion, subject_uri)
    run = runs[0]
    if criterion.metric == "idc" and "idc" in run.data.metrics:
        return (f"coverage run {run.info.run_id} recorded IDC without its reachable combinations (an older "
                f"mlflow-di), which the gate judges; run `mlflow-di coverage --model-uri {subject_uri} ...` again")
    criteria = run.data.params.get("criteria", "other criteria")
    return (f"coverage run {run.info.run_id} of {subject_uri} computed {criteria} but not {criterion.metric} (the "
            f"newest coverage run has none); run `mlflow-di coverage --model-uri {subject_uri} --criteria "
            f"{criterion.metric},... ...` to compute it")


@dataclasses.dataclass
class _CompressedTarget:
    """A compressed model the gate reads results for: display key and the fuzz-run tags naming it."""

    key: str
    fuzz_tags: dict
    compress_run_id: str | None = None  # the run that registered it, for registry versions
    model_id: str | None = None  # its LoggedModel, whose page shows the fuzz results (read first)

    @classmethod
    def named(cls, key: str) -> "_CompressedTarget":
        """The target a recorded key names: ``models:/NAME/VERSION`` (a registry version) or a URI."""
        if key.startswith("models:/") and key.count("/") == 2:
            name, number = key.removeprefix("models:/").split("/")
            return cls(key, {f"{TAG_PREFIX}compressed_name": name, f"{TAG_PREFIX}compressed_version": number})
        return cls(key, {f"{TAG_PREFIX}compressed_uri": key})

    @classmethod
    def of(cls, uri: str, client) -> "_CompressedTarget":
        if registry_ref(uri) is None:
            return cls(uri, {f"{TAG_PREFIX}compressed_uri": uri})
        version = resolve_version(uri, client)
        return cls(version_uri(version), {f"{TAG_PREFIX}compressed_name": version.name,
                                          f"{TAG_PREFIX}compressed_version": str(version.version)},
                   version.run_id, version_model_id(version))


def _recorded_targets(subject_tags: dict, client, robustness_runs: list = ()) -> list[_CompressedTarget]:
    """Every compressed model that has a fuzz or robustness run against the subject or was compressed from it."""
    targets: dict[str, _CompressedTarget] = {}
    for run in search_recorded_runs("fuzz", subject_tags, "success_rate", client):
        tags = run.data.tags
        name, number = tags.get(f"{TAG_PREFIX}compressed_name"), tags.get(f"{TAG_PREFIX}compressed_version")
        key = f"models:/{name}/{number}" if name and number else tags.get(f"{TAG_PREFIX}compressed_uri")
        if key:
            targets.setdefault(key, _CompressedTarget.named(key))
    for run in robustness_runs:
        for key in _robustness_slugs(run):
            targets.setdefault(key, _CompressedTarget.named(key))
    for run in search_recorded_runs("compress", subject_tags, "accuracy_drop", client):
        registered = client.search_model_versions(f"run_id = {_quote(run.info.run_id)}")
        for version in registered:
            key = version_uri(version)
            target = targets.setdefault(key, _CompressedTarget.named(key))
            target.compress_run_id = run.info.run_id
    return [targets[key] for key in sorted(targets)]


#: Tag of a fuzz run whose search was held to --max-linf/--min-ssim (JSON of the bounds; written only for
#: strategies that search inside a realism budget): its success rate answers another question
#: (deviations within the budget), so the success and query checks read only unconstrained campaigns,
#: and the realism check only such ones.
FUZZ_CONSTRAINT_TAG = f"{TAG_PREFIX}fuzz_constraint"
#: Tag of a fuzz run: whether SSIM could be measured on its seeds (images of at least 11x11 pixels).
SSIM_MEASURABLE_TAG = f"{TAG_PREFIX}fuzz_ssim_measurable"


def _searched_budget(run):
    """The realism budget a fuzz ``run`` searched inside (a Constraint), None when it searched without one."""
    from mlflow_di.fuzz.realism import Constraint

    try:
        bounds = json.loads(run.data.tags.get(FUZZ_CONSTRAINT_TAG) or "null")
        return Constraint(**bounds) if isinstance(bounds, dict) and bounds else None
    except (TypeError, ValueError, UserError):
        return None


def _searched_inside(run, budget) -> bool:
    """Whether the fuzz ``run`` searched inside a realism budget at least as strict as ``budget``."""
    searched = _searched_budget(run)
    measurable = run.data.tags.get(SSIM_MEASURABLE_TAG, "true") != "false"
    return searched is not None and searched.at_least_as_strict_as(budget, ssim_measurable=measurable)


def _complete(run) -> bool:
    """Whether every seed of a fuzz run finished within its work budget (none stopped by the time safety net)."""
    return not int(run.data.metrics.get("timed_out_seeds") or 0)


def _chosen(runs: list):
    """The rule (:data:`mlflow_di.gate.RULE`): the newest complete run, else the newest incomplete one."""
    return next((run for run in runs if _complete(run)), runs[0] if runs else None)


def _fuzz_evidence(run, rule: str) -> Evidence:
    params, tags = run.data.params, run.data.tags
    searched = _searched_budget(run)
    return Evidence(run.info.run_id, "fuzz", "seeds", data=data_param(run, "seed_data"),
                    strategy=params.get("strategy", ""), budget=searched.describe() if searched is not None else "none",
                    complete=_complete(run), context=context_line(tags), semantics=params.get("semantics", ""),
                    rule=rule)


def _fuzz(subject_uri: str, subject_tags: dict, target: _CompressedTarget, client,
          realism_budget=None, runtime=None) -> list[Measurement]:
    """success_rate and mean_queries from the newest unconstrained campaign against ``target``, and
    realistic_success_rate from the newest campaign that searched inside a realism budget at least as strict
    as ``realism_budget`` (default :data:`~mlflow_di.fuzz.realism.DEFAULT_BUDGET`): a campaign that never
    looked inside the budget cannot show that no realistic deviation exists. Complete campaigns first; an
    incomplete one's success rates are lower bounds (they can fail a check, never pass it)."""
    from mlflow_di.fuzz.realism import DEFAULT_BUDGET

    budget = realism_budget or DEFAULT_BUDGET
    found = recorded_runs("fuzz", {**subject_tags, **target.fuzz_tags}, "success_rate", client, target.model_id,
                          max_results=100)
    elsewhere = ""
    if runtime is not None:  # only campaigns whose export ran on the runtime judged
        others = sorted({runtime_label(run.data.tags) or "no declared runtime" for run in found} - {runtime.label})
        found = [run for run in found if runtime_label(run.data.tags) == runtime.label]
        if others:
            elsewhere = (f" on {runtime.label} (campaigns against it ran on {', '.join(others)}; run "
                         f"`mlflow-di fuzz ... --runtime {runtime.label}`)")
    rule = PINNED if _pinned.get() is not None else RULE
    plain = _chosen([run for run in found if FUZZ_CONSTRAINT_TAG not in run.data.tags])
    looked = _chosen([run for run in found if _searched_inside(run, budget)])
    measured = [*_success_measurements(subject_uri, target, plain, bool(found), rule),
                _realism_measurement(subject_uri, target, looked, found, budget, rule),
                *_declared_fuzz_measurements(subject_uri, target, plain, rule)]
    for measurement in measured:
        if measurement.value is None and measurement.missing and elsewhere:
            measurement.missing += elsewhere
    return measured


#: the fuzz checks measured above; any other check declared on a fuzz metric is read by _declared_fuzz_measurements
_BUILT_IN_FUZZ = ("success_rate", "mean_queries", "realistic_success_rate")


def _declared_fuzz_measurements(subject_uri: str, target: _CompressedTarget, run, rule: str) -> list[Measurement]:
    """Every other check declared on a fuzz metric (:func:`~mlflow_di.gate.register_check`), read from the same
    unconstrained campaign as the success rate. An incomplete campaign's figure is not judged: which way its
    seeds cut short would move a metric the gate does not know."""
    found = []
    for check in (c for c in CHECKS.values() if c.command == "fuzz" and c.metric not in _BUILT_IN_FUZZ):
        if run is None:
            found.append(Measurement(check.metric, None, target.key, missing=missing_message(check, subject_uri,
                                                                                            target.key)))
            continue
        metrics, run_id = run.data.metrics, run.info.run_id
        evidence, data = _fuzz_evidence(run, rule), data_param(run, "seed_data")
        value = metrics.get(check.metric)
        missing = _incomplete_note(metrics, run_id) or ("" if value is not None else
                                                         f"fuzz run {run_id} recorded no {check.metric}")
        found.append(sized(Measurement(check.metric, None if missing else value, target.key, run_id, missing, data=data,
                                       evidence=evidence), run))
    return found


def _incomplete_note(metrics: dict, run_id: str) -> str:
    """Why an incomplete campaign's figures prove little: seeds stopped by the time safety net found nothing,
    which is not evidence that nothing exists."""
    stopped = int(metrics.get("timed_out_seeds") or 0)
    if not stopped:
        return ""
    return (f"fuzz run {run_id} is incomplete: {stopped} of {int(metrics.get('fuzzed', 0))} seeds stopped at the "
            "--timeout safety net before their query budget, so their 'no trigger' is not evidence (resume the "
            "campaign with --resume)")


def _success_measurements(subject_uri: str, target: _CompressedTarget, run, any_recorded: bool,
                          rule: str) -> list[Measurement]:
    if run is None:
        message = missing_message(CHECKS["success_rate"], subject_uri, target.key)
        if any_recorded:
            message += (" (only campaigns held to --max-linf/--min-ssim were recorded; these checks read "
                        "unconstrained ones)")
        return [Measurement(metric, None, target.key, missing=message) for metric in ("success_rate", "mean_queries")]
    metrics, run_id = run.data.metrics, run.info.run_id
    evidence, data = _fuzz_evidence(run, rule), data_param(run, "seed_data")
    incomplete = _incomplete_note(metrics, run_id)
    note = "; ".join(filter(None, (_noise_note(metrics, run_id), incomplete)))
    success = sized(Measurement("success_rate", metrics["success_rate"], target.key, run_id, note=note, data=data,
                                evidence=evidence, bound="lower" if incomplete else ""), run)
    if incomplete:  # seeds cut short might have needed any number of queries: no bound either way
        return [success, Measurement("mean_queries", None, target.key, run_id, incomplete, data=data,
                                     evidence=evidence)]
    mean_queries = metrics.get("mean_queries")
    if mean_queries is None or math.isnan(mean_queries):
        # no deviating input found: no mean per deviation, and the hardest outcome for an attacker
        found_none = metrics.get("triggers") == 0 or metrics.get("success_rate") == 0
        mean_queries = math.inf if found_none else None
    missing = "" if mean_queries is not None else f"fuzz run {run_id} recorded no mean_queries"
    return [success, sized(Measurement("mean_queries", mean_queries, target.key, run_id, missing, note=note, data=data,
                                       evidence=evidence), run)]


def _realism_measurement(subject_uri: str, target: _CompressedTarget, run, found: list, budget,
                         rule: str) -> Measurement:
    metric = "realistic_success_rate"
    if run is None:
        seed_data = next((data_param(r, "seed_data") for r in found if data_param(r, "seed_data")), "SPEC")
        measurable = all(r.data.tags.get(SSIM_MEASURABLE_TAG, "true") != "false" for r in found)
        message = (f"no fuzz campaign against {target.key} searched inside a realism budget at least as strict as "
                   f"{budget.describe()}; run `mlflow-di fuzz --original {subject_uri} --compressed {target.key} "
                   f"--seed-data {seed_data} --strategy {REALISM} {budget.options_text(measurable)}` first")
        context = _unjudged_realism(found)
        return Measurement(metric, None, target.key, missing=message + (f" ({context})" if context else ""))
    metrics, run_id = run.data.metrics, run.info.run_id
    incomplete = _incomplete_note(metrics, run_id)
    return sized(Measurement(metric, metrics[metric], target.key, run_id, note=incomplete,
                             data=data_param(run, "seed_data"), evidence=_fuzz_evidence(run, rule),
                             bound="lower" if incomplete else ""), run)


def _unjudged_realism(found: list) -> str:
    """The realistic success rate the newest campaign measured after the fact: context, never judged."""
    run = next((r for r in found if r.data.metrics.get("realistic_success_rate") is not None), None)
    if run is None:
        return ""
    strategy = run.data.params.get("strategy", "fuzz")
    return (f"context, not judged: {strategy} run {run.info.run_id[:8]} measured a realistic success rate of "
            f"{run.data.metrics['realistic_success_rate']:.4g} after the fact, but its search did not look inside "
            "that budget")


def _noise_note(metrics: dict, run_id: str) -> str:
    """A warning when most of a campaign's triggers are outside the realism budget: its success rate and
    queries then count noise-like inputs, and the verdict must say so."""
    from mlflow_di.fuzz.realism import Constraint, mostly_noise

    triggers, realistic = metrics.get("triggers"), metrics.get("realistic_triggers")
    if not triggers or realistic is None or not mostly_noise(realistic, triggers):
        return ""
    linf = metrics.get("realism_max_linf")  # metrics are floats; a bound the campaign did not have is absent
    budget = Constraint(max_linf=None if linf is None else int(linf), min_ssim=metrics.get("realism_min_ssim"))
    return (f"fuzz run {run_id}: only {int(realistic)} of {int(triggers)} triggers are within the realism budget "
            f"({budget.describe()}); success rate and queries count noise-like inputs")


def _method(target: _CompressedTarget, client) -> str | None:
    """The compression method that made ``target``: its version tag, else its producing run's tag; None if unknown."""
    if registry_ref(target.key) is not None:
        try:
            method = (resolve_version(target.key, client).tags or {}).get(f"{TAG_PREFIX}method")
        except UserError:
            method = None
        if method:
            return method
    run = _producing_run(target, client)
    return run.data.tags.get(f"{TAG_PREFIX}method") if run is not None else None


def _producing_run(target: _CompressedTarget, client):
    """The run that created the compressed registry version ``target`` (None when unknown)."""
    from mlflow.exceptions import MlflowException

    try:
        if target.compress_run_id is None and registry_ref(target.key) is not None:
            target.compress_run_id = resolve_version(target.key, client).run_id
        return client.get_run(target.compress_run_id) if target.compress_run_id else None
    except (MlflowException, UserError):
        return None


def compress_metrics() -> list[str]:
    """The checks read from the compress run that made an export (their records' ``command``)."""
    return [c.metric for c in CHECKS.values() if c.command == "compress"]
#: the compress metrics that depend on which answers are judged (compress logs ``reference.NAME`` beside them)
SEMANTIC_METRICS = ("accuracy_drop", "max_class_accuracy_drop", "disagreement_rate")
REFERENCE_SUFFIX = " (reference semantics)"


#: the prefix of the figures a bounded export's compress run measured again on its held-out data
HELD_OUT = "held_out."


def _compress_evidence(run, allow_calibration_evidence: bool) -> tuple[str, str]:
    """(the data a compress run measured accuracy and disagreements on, why the gate refuses them or "").

    Figures measured on calibration (or training) images say how the export fits the images it was
    tuned on, not how it behaves: the gate does not judge them unless told to. A run recorded before
    the provenance tags counts as calibration evidence when its eval_data is its calib_data."""
    tags, params = run.data.tags, run.data.params
    data = tags.get(EVIDENCE_DATA) or data_param(run, "eval_data")
    role = tags.get(EVIDENCE_ROLE)
    if role is None:
        role = "calibration" if data and data == params.get("calib_data") else "held-out"
    if role in ("held-out", "search") or allow_calibration_evidence or tags.get(f"{TAG_PREFIX}command") != "compress":
        return data, ""
    return data, (f"compress run {run.info.run_id} measured accuracy and disagreements on {data}, "
                  f"{'a training split' if role == 'training' else 'calibration images'}, not held-out data: not "
                  "judged; run compress again with --eval-data HELD-OUT, or pass --allow-calibration-evidence "
                  "(policy gate.allow_calibration_evidence)")


def _compress(subject_uri: str, subject, target: _CompressedTarget, client, semantics: str = "host",
              allow_calibration_evidence: bool = False, runtime=None) -> list[Measurement]:
    """accuracy_drop, max_class_accuracy_drop, disagreement_rate and speedup from the compress (or repair)
    run that produced the compressed version; ``semantics`` (host, reference or both) picks which answers
    the first three are read for (reference ones name the export with :data:`REFERENCE_SUFFIX`)."""
    missing = missing_message(CHECKS["accuracy_drop"], subject_uri, target.key)
    run = _producing_run(target, client)
    if run is None:
        return [Measurement(metric, None, target.key, missing=missing) for metric in compress_metrics()]
    tags = run.data.tags
    if (tags.get(f"{TAG_PREFIX}command") not in ("compress", "repair") or run.info.status != "FINISHED"
            or "accuracy_drop" not in run.data.metrics):
        return [Measurement(metric, None, target.key, missing=missing) for metric in compress_metrics()]
    source = (tags.get(f"{TAG_PREFIX}model_name"), tags.get(f"{TAG_PREFIX}model_version"))
    if source != (subject.name, str(subject.version)):
        origin = f"models:/{source[0]}/{source[1]}" if all(source) else "another model"
        return [Measurement(metric, None, target.key, missing=(
            f"{target.key} was compressed from {origin}, not from {version_uri(subject)}")) for metric in compress_metrics()]
    run_id, metrics = run.info.run_id, run.data.metrics
    command = tags.get(f"{TAG_PREFIX}command")
    note = _semantics_note(metrics, tags)
    data, refused = _compress_evidence(run, allow_calibration_evidence)
    held_out = tags.get(EVIDENCE_HELD_OUT)
    rule = PINNED if _pinned.get() is not None else "the run that registered the export"
    context = timed_on = context_line(tags)
    on = ""  # the prefix of the judged runtime's figures: "" for the run's own (its first runtime)
    if runtime is not None and runtime_label(tags) != runtime.label:
        on = f"runtime.{runtime.slug}."
        context = context_line(tags, f"{TAG_PREFIX}runtimes.{runtime.slug}.")
        if not context:
            judged_on = tags.get(f"{TAG_PREFIX}runtimes") or runtime_label(tags) or "no declared runtime"
            return [Measurement(metric, None, target.key, run_id, (
                f"{command} run {run_id} judged {target.key} on {judged_on}, not on {runtime.label}; run "
                f"`mlflow-di compress --runtime {runtime.label}` (or add it to the list) again")) for metric in
                compress_metrics()]

    def evidence(metric: str, recorded: str) -> Evidence:
        semantic = "reference" if recorded.startswith(("reference.", f"{HELD_OUT}reference.")) else "host"
        if metric not in SEMANTIC_METRICS:  # speedup: timed on the compress run's host, not on data
            return Evidence(run_id, command, context=timed_on, rule=rule)
        if recorded.startswith(HELD_OUT):
            return Evidence(run_id, command, "held-out", held_out, context=context, semantics=semantic, rule=rule)
        return Evidence(run_id, command, tags.get(EVIDENCE_ROLE, "held-out"), data, context=context,
                        semantics=semantic, rule=rule)

    def read(metric: str, recorded: str, key: str) -> Measurement:
        if held_out and metric in SEMANTIC_METRICS:  # a bounded search chose on the evaluation data: judge held-out
            recorded = HELD_OUT + recorded
        if refused and metric in SEMANTIC_METRICS:
            return Measurement(metric, None, key, run_id, refused, data=data)
        if recorded in metrics:
            judged = evidence(metric, recorded)
            return sized(Measurement(metric, metrics[recorded], key, run_id,
                                     note=note if metric == "disagreement_rate" and not held_out else "",
                                     data=judged.data, evidence=judged), run, recorded)
        why = {"speedup": "or with --no-benefit"}.get(metric, "or without --eval-data")
        if recorded.startswith("reference."):
            why = "or for a method that is not int8: reference semantics apply to int8 exports"
        return Measurement(metric, None, key, run_id, f"{command} run {run_id} recorded no {recorded} (recorded by an "
                           f"older mlflow-di, {why}); run `mlflow-di compress` again")

    found = []
    for metric in compress_metrics():
        if metric not in SEMANTIC_METRICS or semantics in ("host", "both"):
            found.append(read(metric, on + metric if metric in SEMANTIC_METRICS else metric, target.key))
        if metric in SEMANTIC_METRICS and semantics in ("reference", "both"):
            int8 = tags.get(f"{TAG_PREFIX}method", "").startswith("int8")
            recorded = f"reference.{metric}" if int8 else metric  # without int8 kernels both semantics are one
            found.append(read(metric, recorded, target.key + REFERENCE_SUFFIX))
    return found


def runtime_label(tags: dict, prefix: str = f"{TAG_PREFIX}runtime.") -> str:
    """The runtime a run's compressed model ran on, as ``--runtime`` names it (``openvino:f32``); "" when the run
    recorded none (a TFLite export). Runs before runtimes were declared ran on ONNX Runtime."""
    name = tags.get(f"{prefix}name", "onnxruntime")
    if f"{prefix}{name}" not in tags:
        return ""
    from mlflow_di.models.runtimes import RuntimeChoice

    return RuntimeChoice(name, tags.get(f"{prefix}precision_asked", "default")).label


def context_line(tags: dict, prefix: str = f"{TAG_PREFIX}runtime.") -> str:
    """A run's execution context (``mlflow_di.runtime.*`` tags, or another runtime's under ``prefix``) in one
    phrase, "" when it recorded none. Runs before runtimes were declared recorded ONNX Runtime's version alone."""
    runtime = tags.get(f"{prefix}name", "onnxruntime")
    if f"{prefix}{runtime}" not in tags:
        return ""
    precision = tags.get(f"{prefix}precision")
    asked = tags.get(f"{prefix}precision_asked", "default")
    said = "" if precision is None else (f", {precision}" + (f" ({asked} asked)" if asked not in ("default", precision)
                                                              else " pinned" if asked == precision else ""))
    return (f"{runtime} {tags[f'{prefix}{runtime}']} {tags.get(f'{prefix}provider', '')} "
            f"({tags.get(f'{prefix}graph_optimization', 'all')} optimizations{said}) on {tags.get(f'{prefix}cpu', '?')}, "
            f"int8 features {tags.get(f'{prefix}int8_features', 'none')}"
            + ("; its u8s8 kernels saturate" if tags.get(f"{prefix}u8s8_saturates") == "true" else ""))


def runtime_notes(run_ids, client=None) -> list[str]:
    """One line per distinct execution context of the given runs: where the figures on compressed models
    were computed."""
    client = client or _client()
    seen: dict[str, list[str]] = {}
    for run_id in dict.fromkeys(r for r in run_ids if r):
        line = context_line(client.get_run(run_id).data.tags)
        if line:
            seen.setdefault(line, []).append(run_id[:8])
    return [f"figures on compressed models computed with {line} (runs {', '.join(ids)})" for line, ids in seen.items()]


def _semantics_note(metrics: dict, tags: dict) -> str:
    """What the gate says beside a disagreement rate whose host and reference answers differ beyond noise."""
    if metrics.get("semantics_p_value", 1.0) >= 0.05 or "reference.disagreements" not in metrics:
        return ""
    cpu = tags.get(f"{TAG_PREFIX}runtime.cpu", "the compress run's CPU")
    vnni = "no VNNI" if tags.get(f"{TAG_PREFIX}runtime.u8s8_saturates") == "true" else "its int8 kernels"
    return (f"host kernels vs reference semantics differ on {cpu} ({vnni}): {int(metrics.get('disagreements', 0))} vs "
            f"{int(metrics['reference.disagreements'])} disagreements; a CPU whose int8 kernels do not saturate "
            f"would give ~{int(metrics['reference.disagreements'])} (gate --semantics both judges both)")


#: The run metric the gate's robustness criterion reads (``.SLUG`` per compressed model).
ROBUSTNESS_METRIC = CHECKS["robustness_agreement_min"].metric


def _robustness_slugs(run) -> dict:
    """{compressed model's key: its metric slug} recorded on a robustness run ({} when unreadable)."""
    try:
        slugs = json.loads(run.data.tags.get(f"{TAG_PREFIX}robustness_compressed") or "{}")
    except ValueError:
        return {}
    return slugs if isinstance(slugs, dict) else {}


def _robustness(subject_uri: str, target: _CompressedTarget, runs: list) -> Measurement:
    """The worst cell's agreement from the newest robustness run that measured ``target``."""
    for run in runs:  # newest first
        slug = _robustness_slugs(run).get(target.key)
        value = run.data.metrics.get(f"{ROBUSTNESS_METRIC}.{slug}") if slug else None
        if value is not None:
            data = data_param(run, "data")
            rule = PINNED if _pinned.get() is not None else "the newest robustness run that measured the export"
            return sized(Measurement(ROBUSTNESS_METRIC, value, target.key, run.info.run_id, data=data, evidence=Evidence(
                run.info.run_id, "robustness", "corrupted", data, context=context_line(run.data.tags), rule=rule)),
                run, f"{ROBUSTNESS_METRIC}.{slug}")
    return Measurement(ROBUSTNESS_METRIC, None, target.key,
                       missing=missing_message(CHECKS[ROBUSTNESS_METRIC], subject_uri, target.key))


def latest_run(option: str, command: str, metric: str, tags: dict, about: str) -> str:
    """What ``OPTION latest`` names: the id of the newest FINISHED ``mlflow-di COMMAND`` run that
    logged ``metric`` and carries ``tags`` (the registry version ``about`` names), said on the
    terminal so the run taken is on record. A one-line UserError when ``about`` is no registry
    version (newest of every model's runs would be a guess) or when no such run was recorded."""
    return recorded_run_ids(option, "latest", command, metric, tags, about, max_results=1)[0]


def recorded_run_ids(option: str, word: str, command: str, metric: str, tags: dict, about: str,
                     max_results: int = 1000) -> list[str]:
    """The ids of the FINISHED ``mlflow-di COMMAND`` runs (newest first, at most ``max_results``)
    that logged ``metric`` and carry ``tags``: what ``OPTION WORD`` (latest, all) names, said on the
    terminal so the runs taken are on record. One-line UserErrors as :func:`latest_run` says."""
    import click

    if not tags:
        raise UserError(f"{option} {word} needs a registered model version (models:/NAME/VERSION), not '{about}'; "
                        f"give the run id instead")
    runs = search_recorded_runs(command, tags, metric, max_results=max_results)[:max_results]
    if not runs:
        raise UserError(f"{option} {word}: no finished `mlflow-di {command}` run recorded for {about}; "
                        f"run `mlflow-di {command}` first or give a run id")
    ids = [run.info.run_id for run in runs]
    click.echo(f"{option} {word}: {command} run{'s' if len(ids) > 1 else ''} {', '.join(ids)}")
    return ids
