"""The quality gate's decision: thresholds + measured values -> one verdict per check.

Pure logic, no MLflow: :mod:`mlflow_di.registry` finds the measurements in the tracking store
and :mod:`mlflow_di.commands.gate` prints, tags and promotes.

Six criteria, each read from the newest recorded run of one ``mlflow-di`` command:

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
=============================  ==========  ===============  ==========================================

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
)
CRITERION = {c.metric: c for c in CRITERIA}


@dataclasses.dataclass
class Thresholds(JsonRoundTrip):
    """The limits a model version must meet; None = not checked."""

    min_idc: float | None = None
    max_success_rate: float | None = None
    min_mean_queries: float | None = None
    max_accuracy_drop: float | None = None
    max_class_accuracy_drop: float | None = None
    min_robustness_agreement: float | None = None

    #: thresholds added after verdicts were written: written only when set (older verdicts keep their bytes)
    JSON_OPTIONAL = {"max_class_accuracy_drop": None, "min_robustness_agreement": None}

    def __post_init__(self):
        for name, value in ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self)):
            if value is not None and not math.isfinite(value):
                raise UserError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        for name in ("min_idc", "max_success_rate", "min_robustness_agreement"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise UserError(f"--{name.replace('_', '-')} is a fraction between 0 and 1, got {value}")

    def require_any(self) -> "Thresholds":
        """Raise a UserError when no threshold is set (a gate that checks nothing must not pass)."""
        if not self.given():
            raise UserError("no threshold given; pass at least one of --min-idc, --max-success-rate, "
                            "--min-mean-queries, --max-accuracy-drop, --max-class-accuracy-drop, "
                            "--min-robustness-agreement")
        return self

    def given(self) -> list[tuple[Criterion, float]]:
        """The criteria with a threshold, in the order of :data:`CRITERIA`."""
        return [(c, getattr(self, c.threshold_name)) for c in CRITERIA if getattr(self, c.threshold_name) is not None]


@dataclasses.dataclass
class Measurement(JsonRoundTrip):
    """One recorded value (``value`` None: not recorded, ``missing`` says what to run).

    ``compressed`` names the compressed model for per-compressed criteria (None otherwise);
    ``run_id`` is the run the value was read from.
    """

    metric: str
    value: float | None
    compressed: str | None = None
    run_id: str | None = None
    missing: str = ""

    @property
    def found(self) -> bool:
        return self.value is not None


@dataclasses.dataclass
class Check(JsonRoundTrip):
    """One threshold applied to one measurement."""

    metric: str
    compressed: str | None
    measured: float | None
    threshold: float
    greater_is_better: bool
    passed: bool
    run_id: str | None = None
    message: str = ""

    @property
    def comparison(self) -> str:
        return ">=" if self.greater_is_better else "<="

    @property
    def label(self) -> str:
        """e.g. ``success_rate [models:/lenet5-int8/1]``."""
        return self.metric if self.compressed is None else f"{self.metric} [{self.compressed}]"

    def metric_threshold_args(self) -> dict:
        """Keyword arguments of the equivalent ``mlflow.models.MetricThreshold``."""
        return {"threshold": self.threshold, "greater_is_better": self.greater_is_better}


@dataclasses.dataclass
class Verdict(JsonRoundTrip):
    """Every check and every measured value of one gate decision (its JSON also holds ``passed``)."""

    model_uri: str
    thresholds: Thresholds
    checks: list[Check]
    measurements: list[Measurement]

    JSON_DUMPS = {"indent": 2}

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def worst(self, metric: str) -> float | None:
        """The least favourable recorded value of ``metric`` (over compressed models), None if none."""
        values = [m.value for m in self.measurements if m.metric == metric and m.found]
        if not values:
            return None
        return min(values) if CRITERION[metric].greater_is_better else max(values)

    def summary(self) -> str:
        """One line, e.g. ``fail: 3/4 checks passed; failed: success_rate [models:/c/1]``."""
        passed = len(self.checks) - len(self.failures)
        text = f"{'pass' if self.passed else 'fail'}: {passed}/{len(self.checks)} checks passed"
        if self.failures:
            text += "; failed: " + ", ".join(c.label for c in self.failures)
        return text

    def to_dict(self) -> dict:
        values = super().to_dict()
        return {"model_uri": values.pop("model_uri"), "passed": self.passed, **values}

    @classmethod
    def from_dict(cls, values: dict) -> "Verdict":
        values = dict(values)
        values.pop("passed", None)  # derived from the checks
        return super().from_dict(values)


def decide(model_uri: str, thresholds: Thresholds, measurements: list[Measurement]) -> Verdict:
    """Apply every given threshold to every measurement of its criterion.

    A criterion without any measurement (e.g. no compressed model was ever fuzzed) gets one
    failed check saying which command to run.
    """
    thresholds.require_any()
    checks = []
    for criterion, threshold in thresholds.given():
        relevant = [m for m in measurements if m.metric == criterion.metric]
        if not relevant:
            relevant = [Measurement(criterion.metric, None, missing=missing_message(criterion, model_uri))]
        checks.extend(_check(criterion, threshold, m) for m in relevant)
    return Verdict(model_uri, thresholds, checks, list(measurements))


def _check(criterion: Criterion, threshold: float, measurement: Measurement) -> Check:
    if measurement.found:
        value = measurement.value
        passed = value >= threshold if criterion.greater_is_better else value <= threshold
        message = ""
    else:
        passed, message = False, measurement.missing or missing_message(criterion, "the model")
    return Check(criterion.metric, measurement.compressed, measurement.value, float(threshold),
                 criterion.greater_is_better, bool(passed), measurement.run_id, message)


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
