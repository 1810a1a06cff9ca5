"""The quality gate's decision: thresholds + measured values -> one verdict per check.

Pure logic, no MLflow: :mod:`mlflow_di.registry` finds the measurements in the tracking store
and :mod:`mlflow_di.commands.gate` prints, tags and promotes.

Nine criteria, each read from the newest recorded run of one ``mlflow-di`` command:

=============================  ==========  ===============  ==========================================
criterion                      command     threshold        per compressed model?
=============================  ==========  ===============  ==========================================
``idc``                        coverage    >= min_idc       no (a property of the model's tests)
``success_rate``               fuzz        <= max_...       yes (how often fuzzing finds a deviation)
``mean_queries``               fuzz        >= min_...       yes (how hard a deviation is to find)
``accuracy_drop``              compress    <= max_...       yes (what compression cost)
``max_class_accuracy_drop``    compress    <= max_...       yes (what it cost the class hit hardest)
``robustness_agreement_min``   robustness  >= min_...       yes (top-1 agreement with the original in
                                                            the worst corruption/severity cell)
``disagreement_rate``          compress    <= max_...       yes (how often the export's top-1 differs)
``realistic_success_rate``     fuzz        <= max_...       yes (triggers within the realism budget)
``speedup``                    compress    >= min_speedup   yes (source latency / export latency at
                                                            batch 64 on the compress run's host)
=============================  ==========  ===============  ==========================================

The compress criteria (accuracy drops, disagreement rate) are read under the semantics the gate
is asked for (``--semantics``): ``host`` (ONNX Runtime's kernels on the CPU compress ran on),
``reference`` (the QDQ graph as written, the same on every CPU) or ``both`` (each judged).

Relative checks compare the candidate with a baseline version (``gate --baseline
models:/NAME@champion``) whose measurements are read the same way, in the spirit of
``MetricThreshold(min_absolute_change=..., min_relative_change=...)``:

==========================  ========  ===============================================  =========
relation                    kind      passes when                                      threshold
==========================  ========  ===============================================  =========
``idc_drop``                drop      baseline idc - candidate idc <= max_idc_drop     0..1
``success_rate_rise``       rise      candidate rate - baseline rate <= max_..._rise   0..1
``mean_queries_ratio``      ratio     candidate / baseline mean queries >= min_...     > 0
==========================  ========  ===============================================  =========

A candidate export is paired with the baseline's export of the same compression method (the
version tag ``mlflow_di.method``), or with the baseline itself when the baseline is an export. A
baseline value that is missing fails the check and names the command to run on the baseline; a
baseline that does not exist yet (``Baseline.uri`` None, ``--baseline-optional``) passes the
relative checks as "no baseline".

A threshold whose measurement is missing fails, with a message saying which command records it.
A fuzz campaign that found no deviating input has no mean number of queries per deviation; it
counts as infinitely many (the best outcome), so ``min_mean_queries`` passes.

Why not ``mlflow.validate_evaluation_results``: it raises one exception joining every failure
and returns nothing on success, so it cannot give the per-check table; it reports a missing
metric with its own text instead of the command to run; and it would tie this pure module to
MLflow. A check here is the same comparison as ``MetricThreshold(threshold=...,
greater_is_better=...)`` (``>=`` when greater is better, else ``<=``), and
:meth:`Check.metric_threshold_args` gives those arguments for callers that want MLflow's class.
"""
from __future__ import annotations

import dataclasses
import math

from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip


@dataclasses.dataclass(frozen=True)
class Criterion:
    """One gated quantity: the run metric it is read from and which way is better."""

    metric: str
    command: str
    threshold_name: str
    greater_is_better: bool
    per_compressed: bool

    @property
    def comparison(self) -> str:
        return ">=" if self.greater_is_better else "<="


CRITERIA = (
    Criterion("idc", "coverage", "min_idc", greater_is_better=True, per_compressed=False),
    Criterion("success_rate", "fuzz", "max_success_rate", greater_is_better=False, per_compressed=True),
    Criterion("mean_queries", "fuzz", "min_mean_queries", greater_is_better=True, per_compressed=True),
    Criterion("accuracy_drop", "compress", "max_accuracy_drop", greater_is_better=False, per_compressed=True),
    Criterion("max_class_accuracy_drop", "compress", "max_class_accuracy_drop", greater_is_better=False,
              per_compressed=True),
    Criterion("robustness_agreement_min", "robustness", "min_robustness_agreement", greater_is_better=True,
              per_compressed=True),
    Criterion("disagreement_rate", "compress", "max_disagreement_rate", greater_is_better=False, per_compressed=True),
    #: the share of fuzzed seeds that gave a trigger within the realism budget (fuzz's realism_* bounds)
    Criterion("realistic_success_rate", "fuzz", "max_realistic_success_rate", greater_is_better=False,
              per_compressed=True),
    #: the export's latency against its fp32 source's on the compress run's host (above 1: faster)
    Criterion("speedup", "compress", "min_speedup", greater_is_better=True, per_compressed=True),
)
CRITERION = {c.metric: c for c in CRITERIA}


@dataclasses.dataclass(frozen=True)
class Relation:
    """One relative check: how the candidate's ``metric`` may differ from the baseline's."""

    metric: str
    kind: str  # "drop", "rise" or "ratio"
    threshold_name: str

    @property
    def name(self) -> str:
        """e.g. ``idc_drop``: the JUnit class name, the tag and the gate run's metric."""
        return f"{self.metric}_{self.kind}"

    @property
    def greater_is_better(self) -> bool:
        return self.kind == "ratio"

    def change(self, candidate: float, baseline: float) -> float:
        """The compared quantity: baseline - candidate (drop), candidate - baseline (rise), candidate / baseline (ratio)."""
        if self.kind == "drop":
            return baseline - candidate
        if self.kind == "rise":
            return candidate - baseline
        if math.isinf(candidate) and math.isinf(baseline):
            return 1.0  # neither campaign found a deviation: as hard as each other
        if baseline == 0:
            return math.inf if candidate > 0 else 1.0
        return candidate / baseline


RELATIONS = (
    Relation("idc", "drop", "max_idc_drop"),
    Relation("success_rate", "rise", "max_success_rate_rise"),
    Relation("mean_queries", "ratio", "min_mean_queries_ratio"),
)
RELATION = {r.name: r for r in RELATIONS}


@dataclasses.dataclass
class Thresholds(JsonRoundTrip):
    """The limits a model version must meet; None = not checked."""

    min_idc: float | None = None
    max_success_rate: float | None = None
    min_mean_queries: float | None = None
    max_accuracy_drop: float | None = None
    max_class_accuracy_drop: float | None = None
    min_robustness_agreement: float | None = None
    max_idc_drop: float | None = None
    max_success_rate_rise: float | None = None
    min_mean_queries_ratio: float | None = None
    max_disagreement_rate: float | None = None
    max_realistic_success_rate: float | None = None
    min_speedup: float | None = None

    #: thresholds added after verdicts were written: written only when set (older verdicts keep their bytes)
    JSON_OPTIONAL = {"max_class_accuracy_drop": None, "min_robustness_agreement": None, "max_idc_drop": None,
                     "max_success_rate_rise": None, "min_mean_queries_ratio": None, "max_disagreement_rate": None,
                     "max_realistic_success_rate": None, "min_speedup": None}

    def __post_init__(self):
        for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)):
            if value is not None and not math.isfinite(value):
                raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        for name in ("min_idc", "max_success_rate", "min_robustness_agreement", "max_idc_drop", "max_success_rate_rise",
                     "max_disagreement_rate", "max_realistic_success_rate", "max_accuracy_drop",
                     "max_class_accuracy_drop"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise UserError(f"--{name.replace('_', '-')} is a fraction between 0 and 1, got {value}")
        if self.min_speedup is not None and self.min_speedup <= 0:
            raise UserError(f"--min-speedup must be above 0 (e.g. 1: no slower than the source), got {self.min_speedup}")
        if self.min_mean_queries_ratio is not None and self.min_mean_queries_ratio <= 0:
            raise UserError(f"--min-mean-queries-ratio must be above 0 (e.g. 0.8), got {self.min_mean_queries_ratio}")

    def require_any(self) -> "Thresholds":
        """Raise a UserError when no threshold is set (a gate that checks nothing must not pass)."""
        if not self.given() and not self.relative():
            raise UserError("no threshold given; pass at least one of --min-idc, --max-success-rate, "
                            "--min-mean-queries, --max-accuracy-drop, --max-class-accuracy-drop, "
                            "--min-robustness-agreement, --max-disagreement-rate, --max-realistic-success-rate, "
                            "--min-speedup (or, "
                            "with --baseline, --max-idc-drop, "
                            "--max-success-rate-rise, --min-mean-queries-ratio)")
        return self

    def given(self) -> list[tuple[Criterion, float]]:
        """The criteria with a threshold, in the order of :data:`CRITERIA`."""
        return [(c, getattr(self, c.threshold_name)) for c in CRITERIA if getattr(self, c.threshold_name) is not None]

    def require_baseline(self, given: bool) -> "Thresholds":
        """Raise a UserError unless relative thresholds and a baseline come together."""
        names = [f"--{r.threshold_name.replace('_', '-')}" for r, _ in self.relative()]
        if names and not given:
            raise UserError(f"{', '.join(names)} compare(s) with a baseline; pass --baseline models:/NAME@champion "
                            f"(or a version)")
        if given and not names:
            raise UserError("--baseline needs a relative threshold: --max-idc-drop, --max-success-rate-rise or "
                            "--min-mean-queries-ratio")
        return self

    def relative(self) -> list[tuple[Relation, float]]:
        """The relations with a threshold, in the order of :data:`RELATIONS`."""
        return [(r, getattr(self, r.threshold_name)) for r in RELATIONS if getattr(self, r.threshold_name) is not None]


@dataclasses.dataclass
class Measurement(JsonRoundTrip):
    """One recorded value (``value`` None: not recorded, ``missing`` says what to run).

    ``compressed`` names the compressed model for per-compressed criteria (None otherwise);
    ``run_id`` is the run the value was read from; ``method`` the compression method that made
    ``compressed`` (how a baseline's export is paired with it), None when unknown.
    """

    metric: str
    value: float | None
    compressed: str | None = None
    run_id: str | None = None
    missing: str = ""
    method: str | None = None
    #: what a reader must know about a measured value (e.g. that its triggers are noise-like)
    note: str = ""
    #: the data the value was measured on (its spec, e.g. ``digits[1300:]``): evidence carries its provenance
    data: str = ""

    JSON_OPTIONAL = {"method": None, "note": "", "data": ""}

    @property
    def found(self) -> bool:
        return self.value is not None


@dataclasses.dataclass
class Check(JsonRoundTrip):
    """One threshold applied to one measurement.

    A relative check (``relation`` set: drop, rise or ratio) also holds the ``baseline`` value it was
    compared with, the model it came from (``baseline_model``, ``baseline_run_id``) and the
    ``change`` the threshold applies to; ``measured`` stays the candidate's value.
    """

    metric: str
    compressed: str | None
    measured: float | None
    threshold: float
    greater_is_better: bool
    passed: bool
    run_id: str | None = None
    message: str = ""
    relation: str | None = None
    baseline: float | None = None
    change: float | None = None
    baseline_model: str | None = None
    baseline_run_id: str | None = None
    #: the data the measured value came from (the measurement's ``data``)
    data: str = ""

    JSON_OPTIONAL = {**{name: None for name in ("relation", "baseline", "change", "baseline_model", "baseline_run_id")},
                     "data": ""}

    @property
    def comparison(self) -> str:
        return ">=" if self.greater_is_better else "<="

    @property
    def criterion(self) -> str:
        """``idc``, ``success_rate``, ... or, for a relative check, ``idc_drop``, ``success_rate_rise``, ..."""
        return self.metric if self.relation is None else f"{self.metric}_{self.relation}"

    @property
    def compared(self) -> float | None:
        """The value the threshold applies to: the change for a relative check, else the measured value."""
        return self.measured if self.relation is None else self.change

    @property
    def label(self) -> str:
        """e.g. ``success_rate [models:/lenet5-int8/1]`` or ``success_rate rise [models:/lenet5-int8/1]``."""
        name = self.metric if self.relation is None else f"{self.metric} {self.relation}"
        return name if self.compressed is None else f"{name} [{self.compressed}]"

    def metric_threshold_args(self) -> dict:
        """Keyword arguments of the equivalent ``mlflow.models.MetricThreshold`` (on :attr:`compared`)."""
        return {"threshold": self.threshold, "greater_is_better": self.greater_is_better}


@dataclasses.dataclass
class Baseline:
    """What relative checks compare with: the baseline version's URI (None: it does not exist yet,
    ``absent`` says why) and its measurements; ``is_export``: the baseline is itself an export."""

    uri: str | None
    measurements: list[Measurement] = dataclasses.field(default_factory=list)
    is_export: bool = False
    absent: str = ""


@dataclasses.dataclass
class Verdict(JsonRoundTrip):
    """Every check and every measured value of one gate decision (its JSON also holds ``passed``)."""

    model_uri: str
    thresholds: Thresholds
    checks: list[Check]
    measurements: list[Measurement]
    baseline_uri: str | None = None
    baseline_measurements: list[Measurement] = dataclasses.field(default_factory=list)

    JSON_DUMPS = {"indent": 2}
    JSON_OPTIONAL = {"baseline_uri": None, "baseline_measurements": []}

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def unmeasured(self) -> list[Check]:
        """Checks with no value to judge (the version was not analysed for them)."""
        return [c for c in self.checks if c.compared is None]

    @property
    def outcome(self) -> str:
        """``PASS`` (every check passed), ``FAIL`` (a measured value is beyond its threshold) or
        ``ERROR`` (no measured value failed, but some check had nothing to judge: the version could
        not be analysed, which says nothing about its quality and must not read as a failure)."""
        if self.passed:
            return "PASS"
        return "FAIL" if any(c.compared is not None for c in self.failures) else "ERROR"

    @property
    def cause(self) -> str:
        """Why the outcome is ERROR, in one line (the first unmeasured check's message); else ''."""
        if self.outcome != "ERROR":
            return ""
        check = self.unmeasured[0] if self.unmeasured else None
        return (check.message or f"{check.label} was not measured") if check else "no check was given"

    def worst(self, metric: str) -> float | None:
        """The least favourable recorded value of ``metric`` (over compressed models), None if none."""
        values = [m.value for m in self.measurements if m.metric == metric and m.found]
        if not values:
            return None
        return min(values) if CRITERION[metric].greater_is_better else max(values)

    def worst_change(self, relation: str) -> Check | None:
        """The relative check of ``relation`` (e.g. ``idc_drop``) with the least favourable change, None if none."""
        compared = [c for c in self.checks if c.criterion == relation and c.change is not None]
        if not compared:
            return None
        pick = min if RELATION[relation].greater_is_better else max
        return pick(compared, key=lambda c: c.change)

    def summary(self) -> str:
        """One line, e.g. ``fail: 3/4 checks passed; failed: success_rate [models:/c/1]``."""
        passed = len(self.checks) - len(self.failures)
        text = f"{self.outcome.lower()}: {passed}/{len(self.checks)} checks passed"
        beyond = [c.label for c in self.failures if c.compared is not None]
        if beyond:
            text += "; failed: " + ", ".join(beyond)
        if self.unmeasured:
            text += "; not measured: " + ", ".join(c.label for c in self.unmeasured)
        exports = self.per_export()
        if exports:
            text += "; per export: " + ", ".join(
                f"{export} {passed}/{total}" + (f" (not judged: {', '.join(missing)})" if missing else "")
                for export, (passed, total, missing) in exports.items())
        return text

    def per_export(self) -> dict[str, tuple[int, int, list[str]]]:
        """{export: (its checks passed, its checks, the criteria it has no value for)}: every export the
        gate was asked about is judged on each per-export criterion, or listed as not judged."""
        exports: dict[str, list] = {}
        for check in self.checks:
            if check.compressed:
                counts = exports.setdefault(check.compressed, [0, 0, []])
                counts[0] += check.passed
                counts[1] += 1
                if check.compared is None:
                    counts[2].append(check.criterion)
        return {export: (passed, total, missing) for export, (passed, total, missing) in exports.items()}

    def to_dict(self) -> dict:
        values = super().to_dict()
        return {"model_uri": values.pop("model_uri"), "passed": self.passed, **values}

    @classmethod
    def from_dict(cls, values: dict) -> "Verdict":
        values = dict(values)
        values.pop("passed", None)  # derived from the checks
        values.pop("outcome", None)  # derived too; the gate command writes it beside the verdict
        return super().from_dict(values)


def decide(model_uri: str, thresholds: Thresholds, measurements: list[Measurement],
           baseline: Baseline | None = None) -> Verdict:
    """Apply every given threshold to every measurement of its criterion, and every relative
    threshold to every measurement compared with its baseline counterpart.

    A criterion without any measurement (e.g. no compressed model was ever fuzzed) gets one
    failed check saying which command to run.
    """
    thresholds.require_any().require_baseline(baseline is not None)
    checks = []
    for criterion, threshold in thresholds.given():
        checks.extend(_check(criterion, threshold, m) for m in _relevant(criterion, measurements, model_uri))
    for relation, threshold in thresholds.relative():
        checks.extend(_relative_check(relation, threshold, m, baseline)
                      for m in _relevant(CRITERION[relation.metric], measurements, model_uri))
    if baseline is None:
        return Verdict(model_uri, thresholds, checks, list(measurements))
    return Verdict(model_uri, thresholds, checks, list(measurements), baseline.uri, list(baseline.measurements))


def _relevant(criterion: Criterion, measurements: list[Measurement], model_uri: str) -> list[Measurement]:
    """The measurements of ``criterion``, or one missing measurement saying what to run."""
    relevant = [m for m in measurements if m.metric == criterion.metric]
    return relevant or [Measurement(criterion.metric, None, missing=missing_message(criterion, model_uri))]


def _check(criterion: Criterion, threshold: float, measurement: Measurement) -> Check:
    if measurement.found:
        value = measurement.value
        passed = value >= threshold if criterion.greater_is_better else value <= threshold
        message = measurement.note
    else:
        passed, message = False, measurement.missing or missing_message(criterion, "the model")
    return Check(criterion.metric, measurement.compressed, measurement.value, float(threshold),
                 criterion.greater_is_better, bool(passed), measurement.run_id, message, data=measurement.data)


def _relative_check(relation: Relation, threshold: float, measurement: Measurement, baseline: Baseline) -> Check:
    check = Check(relation.metric, measurement.compressed, measurement.value, float(threshold),
                  relation.greater_is_better, False, measurement.run_id, relation=relation.kind, data=measurement.data)
    if baseline.uri is None:  # none yet (--baseline-optional): nothing to fall behind
        check.passed, check.message = True, baseline.absent or "no baseline"
        return check
    counterpart, problem = pair(measurement, baseline)
    if counterpart is not None:
        check.baseline, check.baseline_model, check.baseline_run_id = (counterpart.value, counterpart.compressed
                                                                       or baseline.uri, counterpart.run_id)
    if not measurement.found:
        check.message = measurement.missing or missing_message(CRITERION[relation.metric], "the model")
    elif problem:
        check.message = problem
    else:
        check.change = relation.change(measurement.value, counterpart.value)
        check.passed = bool(check.change >= threshold if relation.greater_is_better else check.change <= threshold)
    return check


def pair(measurement: Measurement, baseline: Baseline) -> tuple[Measurement | None, str]:
    """The baseline's measurement to compare ``measurement`` with, and what is wrong when there is none
    with a value: the same metric, of the export made by the same method (any export when the
    baseline is itself one); of several, the newest registered version."""
    criterion = CRITERION[measurement.metric]
    same = [m for m in baseline.measurements if m.metric == measurement.metric]
    if measurement.compressed is not None and not baseline.is_export:
        if measurement.method is None:
            return None, (f"{measurement.compressed} has no recorded compression method (version tag "
                          f"mlflow_di.method), so no export of {baseline.uri} can be paired with it")
        same = [m for m in same if m.method == measurement.method]
        if not same:
            return None, (f"{baseline.uri} has no {measurement.method} export with recorded results; run `mlflow-di "
                          f"compress --model-uri {baseline.uri} --method {measurement.method} ...`, then "
                          f"`mlflow-di {criterion.command}` on that export, first")
    same.sort(key=lambda m: (m.found, _version_number(m.compressed)))
    if not same:
        return None, missing_message(criterion, baseline.uri)
    best = same[-1]
    return best, "" if best.found else f"baseline: {best.missing or missing_message(criterion, baseline.uri)}"


def _version_number(uri: str | None) -> int:
    tail = (uri or "").rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def missing_message(criterion: Criterion, model_uri: str, compressed: str | None = None) -> str:
    """What to run to record ``criterion`` for ``model_uri`` (and ``compressed``)."""
    if criterion.command == "coverage":
        return (f"no coverage run recorded for {model_uri}; "
                f"run `mlflow-di coverage --model-uri {model_uri} ...` first")
    if criterion.command in ("fuzz", "robustness"):
        target = compressed or "COMPRESSED_URI"
        against = f" against {compressed}" if compressed else ""
        arguments = (f"--original {model_uri} --compressed {target} ..." if criterion.command == "fuzz"
                     else f"--model-uri {model_uri} --compressed {target} --data SPEC")
        return (f"no {criterion.command} run recorded for {model_uri}{against}; "
                f"run `mlflow-di {criterion.command} {arguments}` first")
    against = f" producing {compressed}" if compressed else ""
    return (f"no compress run recorded for {model_uri}{against}; "
            f"run `mlflow-di compress --model-uri {model_uri} ...` first")
