"""The quality gate's decision: thresholds + measured values -> one verdict per check.

Pure logic, no MLflow: :mod:`mlflow_di.mlflow_edge.gate_evidence` finds the measurements in the tracking
store and :mod:`mlflow_di.commands.gate` prints, tags and promotes. Each check is one record
(:class:`CheckDeclaration` in :data:`CHECKS`, :class:`Relation` in :data:`RELATIONS`): the metric, the
command whose runs record it, the threshold's name, range and help. The command's options, a
policy's ``gate.thresholds`` and the reports are built from the records; :func:`register_check`
adds one (``gate --threshold NAME=VALUE`` sets it).

The built-in checks, each read from the newest recorded run of one ``mlflow-di`` command:

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

Three outcomes per check. Every built-in figure was measured on a sample (images, seeds,
analysis inputs, timed pairs) and is judged by its 95% interval, which the command that measured it
records beside it (``METRIC_low``, ``METRIC_high``, ``METRIC_n``; :attr:`CheckDeclaration.interval_method`
says how each is made, :mod:`mlflow_di.intervals` makes them): PASS when the whole interval is on the
right side of the threshold, FAIL when it is wholly on the wrong side, INCONCLUSIVE when the threshold is
inside it (the check's message says about how much more evidence at the same value would decide).
The verdict is FAIL if any check fails, else ERROR if any had nothing to judge, else INCONCLUSIVE if
any is inconclusive, else PASS; ``gate --inconclusive`` counts inconclusive checks as failed, passed
or errors instead. Exit codes: :data:`EXIT_CODES`.

A threshold whose measurement is missing makes the verdict ERROR, with a message saying which command
records it.
A fuzz campaign that found no deviating input has no mean number of queries per deviation; it
counts as infinitely many (the best outcome), so ``min_mean_queries`` passes.

Why not ``mlflow.validate_evaluation_results``: it raises one exception joining every failure
and returns nothing on success, so it cannot give the per-check table; it reports a missing
metric with its own text instead of the command to run; and it would tie this pure module to
MLflow. On an exact figure (no interval) a check here is the same comparison as
``MetricThreshold(threshold=..., greater_is_better=...)`` (``>=`` when greater is better, else ``<=``),
and :meth:`Check.metric_threshold_args` gives those arguments for callers that want MLflow's class;
MLflow judges point estimates only, so an interval holding the threshold has no MLflow equivalent.
"""
from __future__ import annotations

import dataclasses
import math

from mlflow_di.errors import UserError
from mlflow_di.intervals import (CLOPPER_PEARSON, CONFIDENCE, COVERAGE_BOOTSTRAP, FAIL, INCONCLUSIVE, MEAN_BOOTSTRAP,
                                 NEWCOMBE_PAIRED, PASS, Interval, clopper_pearson, judge, mover)
from mlflow_di.intervals import rate_sample_to_decide, sample_to_decide
from mlflow_di.registry import Registry
from mlflow_di.results_json import JsonRoundTrip

#: A check with nothing to judge (the version was not analysed for it).
MISSING = "MISSING"
#: How an INCONCLUSIVE check counts (``gate --inconclusive``): the verdict says INCONCLUSIVE (the default), or
#: the check counts as failed, passed, or as an error.
INCONCLUSIVE_AS = ("inconclusive", "fail", "pass", "error")
#: The gate's exit code for each verdict.
EXIT_CODES = {PASS: 0, FAIL: 1, "ERROR": 2, INCONCLUSIVE: 3}


#: What a threshold may be: a fraction in [0, 1], a number above 0, or a number of at least 0.
RANGES = {"fraction": "a fraction between 0 and 1", "positive": "above 0", "nonnegative": "at least 0"}


def _in_range(kind: str, value: float) -> bool:
    return {"fraction": 0 <= value <= 1, "positive": value > 0, "nonnegative": value >= 0}[kind]


@dataclasses.dataclass(frozen=True)
class CheckDeclaration:
    """One gate check's record: the run metric it reads and which command's runs record it, whether
    it is read per compressed model, which way is better, its threshold (``--THRESHOLD-NAME`` on the
    command line, ``gate.thresholds.THRESHOLD_NAME`` in a policy) with the range it may take, and the
    help that explains it. The gate, the command's options, the policy reader and the reports read
    these records (:func:`register_check` adds one)."""

    metric: str
    command: str
    threshold_name: str
    greater_is_better: bool
    per_compressed: bool
    range: str = "fraction"
    help: str = ""
    #: what a refused value is told besides the range, e.g. " (e.g. 1: no slower than the source)"
    hint: str = ""
    #: what the figure was measured on, when it is a sample's ("images", "seeds", "analysis inputs"): such a
    #: figure is judged by its 95% interval (``METRIC_low``/``METRIC_high``/``METRIC_n`` beside it in the run),
    #: and a run that recorded none cannot decide it. "" for an exact figure, judged by its value.
    sample: str = ""
    #: how the command that records a sample's figure makes its interval (the docs' table lists them)
    interval_method: str = ""
    #: the run metric holding the figure, when it is not ``metric`` (IDC's check reads ``idc_reachable``)
    recorded: str = ""

    @property
    def comparison(self) -> str:
        return ">=" if self.greater_is_better else "<="

    @property
    def option(self) -> str:
        """The command line's option for its threshold, e.g. ``--min-idc``."""
        return "--" + self.threshold_name.replace("_", "-")

    @property
    def run_metric(self) -> str:
        """The metric a recorded run holds the figure in."""
        return self.recorded or self.metric


#: Every gate check, by its metric, in the order the gate and its reports list them (a live registry:
#: :func:`register_check` adds one).
CHECKS = Registry("gate check", CheckDeclaration, key="metric", builtins=[
    CheckDeclaration("idc", "coverage", "min_idc", greater_is_better=True, per_compressed=False,
              sample="analysis inputs", recorded="idc_reachable", interval_method=COVERAGE_BOOTSTRAP,
              help="Fail if IDC (0..1) of the newest coverage run is lower: the share of the important-neuron "
                   "combinations the analysis (training) data reach that the test data cover, judged by its 95% "
                   "interval from refitting the clusters on resamples of the analysis data."),
    CheckDeclaration("success_rate", "fuzz", "max_success_rate", greater_is_better=False, per_compressed=True,
              sample="seeds", interval_method=CLOPPER_PEARSON,
              help="Fail if the fuzzing success rate (0..1) against a compressed model is higher."),
    CheckDeclaration("mean_queries", "fuzz", "min_mean_queries", greater_is_better=True, per_compressed=True,
              range="nonnegative", sample="seeds", interval_method=MEAN_BOOTSTRAP,
              help="Fail if fuzzing needed fewer queries per deviating input on average."),
    CheckDeclaration("accuracy_drop", "compress", "max_accuracy_drop", greater_is_better=False, per_compressed=True,
              sample="images", interval_method=NEWCOMBE_PAIRED,
              help="Fail if compression lost more accuracy (source - compressed, 0..1)."),
    CheckDeclaration("max_class_accuracy_drop", "compress", "max_class_accuracy_drop", greater_is_better=False,
              per_compressed=True, sample="images", interval_method=f"{NEWCOMBE_PAIRED}, Bonferroni over the classes",
              help="Fail if compression lost more accuracy on any one class (largest per-class drop, 0..1)."),
    CheckDeclaration("robustness_agreement_min", "robustness", "min_robustness_agreement", greater_is_better=True,
              per_compressed=True, sample="images", interval_method=f"{CLOPPER_PEARSON}, Bonferroni over the cells",
              help="Fail if a compressed model agrees with the original (top-1) on fewer images (0..1) than this "
                   "in the worst corruption and severity of the newest robustness run."),
    CheckDeclaration("disagreement_rate", "compress", "max_disagreement_rate", greater_is_better=False, per_compressed=True,
              sample="images", interval_method=CLOPPER_PEARSON,
              help="Fail if a compressed model's top-1 label differs from the original's on more of the evaluation "
                   "data (0..1) than this, as its compress run measured (accuracy can stay flat while answers flip)."),
    #: the share of fuzzed seeds that gave a trigger within the realism budget (fuzz's realism_* bounds)
    CheckDeclaration("realistic_success_rate", "fuzz", "max_realistic_success_rate", greater_is_better=False,
              per_compressed=True, sample="seeds", interval_method=CLOPPER_PEARSON,
              help="Fail if more of the fuzzed seeds (0..1) gave a trigger within the realism budget (SSIM >= 0.9 "
                   "to the seed where measurable, paper's and whole-image, L-inf <= 32 levels, or the campaign's own "
                   "--min-ssim/--max-linf): "
                   "deviations a person would call the same image."),
    #: the export's latency against its fp32 source's on the compress run's host (above 1: faster)
    CheckDeclaration("speedup", "compress", "min_speedup", greater_is_better=True, per_compressed=True, range="positive",
              hint=" (e.g. 1: no slower than the source)", sample="timed pairs",
              interval_method="distribution-free interval of the median ratio",
              help="Fail if an export runs measurably slower than this multiple of its fp32 source's speed (source "
                   "latency / export latency at batch 64, timed in pairs by its compress run: fails when the whole 95% "
                   "interval is below, passes when it is wholly at or above); 1: no slower than the source."),
])


def register_check(criterion: CheckDeclaration) -> CheckDeclaration:
    """Add a gate check: ``Thresholds``, ``gate --threshold NAME=VALUE``, a policy's ``gate.thresholds``
    and the reports know it from now on; the recorded runs of its ``command`` give its values
    (:mod:`mlflow_di.mlflow_edge.gate_evidence`)."""
    if criterion.range not in RANGES:
        raise UserError(f"a check's range is one of {', '.join(RANGES)}, got {criterion.range!r}")
    return CHECKS.register(criterion)


def unregister_check(metric: str) -> None:
    """Forget a registered check (tests add toy ones)."""
    CHECKS.unregister(metric)


@dataclasses.dataclass(frozen=True)
class Relation:
    """One relative check: how the candidate's ``metric`` may differ from the baseline's."""

    metric: str
    kind: str  # "drop", "rise" or "ratio"
    threshold_name: str
    range: str = "fraction"
    help: str = ""
    #: what a refused value is told besides the range, e.g. " (e.g. 0.8)"
    hint: str = ""

    @property
    def name(self) -> str:
        """e.g. ``idc_drop``: the JUnit class name, the tag and the gate run's metric."""
        return f"{self.metric}_{self.kind}"

    @property
    def greater_is_better(self) -> bool:
        return self.kind == "ratio"

    @property
    def option(self) -> str:
        return "--" + self.threshold_name.replace("_", "-")

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


#: Every relative check, by its name (``idc_drop``), in the order the gate lists them (a live registry).
RELATIONS = Registry("relative gate check", Relation, builtins=(
    Relation("idc", "drop", "max_idc_drop", help="Fail if IDC is lower than the baseline's by more than this (0..1)."),
    Relation("success_rate", "rise", "max_success_rate_rise",
             help="Fail if the fuzzing success rate against an export is higher than against the baseline's "
                  "export of the same method by more than this (0..1)."),
    Relation("mean_queries", "ratio", "min_mean_queries_ratio", range="positive", hint=" (e.g. 0.8)",
             help="Fail if mean queries per deviating input divided by the baseline's (same method) is lower, "
                  "e.g. 0.8."),
))

#: Thresholds every verdict's JSON carries, set or not (those added later are written only when set,
#: so older verdicts keep their bytes).
_ALWAYS_WRITTEN = ("min_idc", "max_success_rate", "min_mean_queries", "max_accuracy_drop")


def threshold_records() -> dict:
    """{threshold name: its CheckDeclaration or Relation}, every check's and relation's."""
    return {**{c.threshold_name: c for c in CHECKS.values()}, **{r.threshold_name: r for r in RELATIONS.values()}}


@dataclasses.dataclass(init=False)
class Thresholds(JsonRoundTrip):
    """The limits a model version must meet, by threshold name (``min_idc=0.5``); None = not checked.
    Names and ranges come from the check records (:data:`CHECKS`, :data:`RELATIONS`)."""

    values: dict

    def __init__(self, **thresholds):
        records = threshold_records()
        unknown = sorted(set(thresholds) - set(records))
        if unknown:
            raise UserError(f"unknown threshold {unknown[0]}; known: {', '.join(records)}")
        self.values = {name: value for name, value in thresholds.items() if value is not None}
        for name, value in self.values.items():
            option = records[name].option
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(f"{option} must be a finite number, got {value}")
            kind, hint = records[name].range, records[name].hint
            if not _in_range(kind, value):
                raise UserError(f"{option} is {RANGES[kind]}{hint}, got {value}" if kind == "fraction"
                                else f"{option} must be {RANGES[kind]}{hint}, got {value}")

    def __getattr__(self, name: str):
        if name != "values" and name in threshold_records():
            return self.__dict__.get("values", {}).get(name)
        raise AttributeError(f"'Thresholds' object has no attribute '{name}'")

    def __eq__(self, other) -> bool:
        return isinstance(other, Thresholds) and self.values == other.values

    def to_dict(self) -> dict:
        return {**{name: self.values.get(name) for name in _ALWAYS_WRITTEN},
                **{name: value for name, value in self.values.items() if name not in _ALWAYS_WRITTEN}}

    @classmethod
    def from_dict(cls, values: dict) -> "Thresholds":
        return cls(**values)

    def require_any(self) -> "Thresholds":
        """Raise a UserError when no threshold is set (a gate that checks nothing must not pass)."""
        if not self.given() and not self.relative():
            raise UserError("no threshold given; pass at least one of "
                            + ", ".join(c.option for c in CHECKS.values())
                            + " (or, with --baseline, " + ", ".join(r.option for r in RELATIONS.values()) + ")")
        return self

    def given(self) -> list[tuple[CheckDeclaration, float]]:
        """The criteria with a threshold, in the order of :data:`CHECKS`."""
        return [(c, self.values[c.threshold_name]) for c in CHECKS.values() if c.threshold_name in self.values]

    def require_baseline(self, given: bool) -> "Thresholds":
        """Raise a UserError unless relative thresholds and a baseline come together."""
        names = [r.option for r, _ in self.relative()]
        if names and not given:
            raise UserError(f"{', '.join(names)} compare(s) with a baseline; pass --baseline models:/NAME@champion "
                            f"(or a version)")
        if given and not names:
            *others, last = (r.option for r in RELATIONS.values())
            raise UserError(f"--baseline needs a relative threshold: {', '.join(others)} or {last}")
        return self

    def relative(self) -> list[tuple[Relation, float]]:
        """The relations with a threshold, in the order of :data:`RELATIONS`."""
        return [(r, self.values[r.threshold_name]) for r in RELATIONS.values() if r.threshold_name in self.values]


#: How the gate picks among several runs that recorded a check's value (``gate --runs`` pins them instead).
RULE = "the newest complete run that can prove the check (else the newest incomplete one, which can only fail it)"
#: A pinned run's rule.
PINNED = "pinned (--runs)"


@dataclasses.dataclass
class Evidence(JsonRoundTrip):
    """What a measured value rests on: the run it was read from and what that run can prove.

    ``split``: the role of the data the figure was measured on: ``held-out`` (images the export was
    neither calibrated nor chosen on), ``search`` (a bounded search chose the export on them),
    ``calibration`` or ``training`` (not judged unless asked), ``test`` (coverage's test data),
    ``seeds`` (a fuzz campaign's seeds) or ``corrupted`` (robustness). ``strategy`` and ``budget``:
    a fuzz campaign's strategy and the realism budget its search kept to (``none``). ``complete``:
    whether every seed finished within its work budget (a campaign the time safety net cut is not;
    None where it does not apply). ``context``: where figures on a compressed model were computed
    (ONNX Runtime, provider, CPU and its int8 features); ``semantics``: host or reference answers.
    ``rule``: how this run was chosen among the runs that recorded the value.
    """

    run_id: str = ""
    command: str = ""
    split: str = ""
    data: str = ""
    strategy: str = ""
    budget: str = ""
    complete: bool | None = None
    context: str = ""
    semantics: str = ""
    rule: str = ""

    JSON_OPTIONAL = {"strategy": "", "budget": "", "complete": None, "context": "", "semantics": ""}

    def describe(self) -> str:
        """One line, e.g. ``fuzz run 1a2b3c4d (boundary inside L-inf <= 32, complete) on seeds digits[1300:]``."""
        if not self.run_id:
            return ""
        what = ", ".join(filter(None, (f"{self.strategy} inside {self.budget}" if self.strategy and self.budget != "none"
                                        else self.strategy and f"{self.strategy}, no realism budget",
                                        {True: "complete", False: "INCOMPLETE"}.get(self.complete))))
        text = f"{self.command} run {self.run_id[:8]}" + (f" ({what})" if what else "")
        if self.data:
            text += f" on {self.split + ' ' if self.split else ''}{self.data}"
        if self.context:
            text += f"; {self.context}" + (f", {self.semantics} semantics" if self.semantics else "")
        return text


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
    #: what the value rests on (the run, its split, strategy, budget, completeness and execution context)
    evidence: Evidence | None = None
    #: ``lower``: the true value is at least this (an incomplete campaign's rate): it proves a ``>=`` check
    #: passing or a ``<=`` check failing, nothing else; "" for an exact figure
    bound: str = ""
    #: a sample's figure: its 95% interval, which a check judges (PASS or FAIL only when the whole interval is
    #: on one side of the threshold); None for an exact figure
    interval: tuple[float, float] | None = None
    #: the sample size behind ``interval`` (images, seeds, analysis inputs or timed pairs), how it was made and
    #: its two-sided confidence (above 0.95 for evidence a pipeline may grow in rounds)
    n: int | None = None
    interval_method: str = ""
    confidence: float = CONFIDENCE
    #: a sample's figure recorded without its interval (an older mlflow-di): what to run again; it decides nothing
    unsized: str = ""

    JSON_OPTIONAL = {"method": None, "note": "", "data": "", "evidence": None, "bound": "", "interval": None,
                     "n": None, "interval_method": "", "confidence": CONFIDENCE, "unsized": ""}

    @property
    def found(self) -> bool:
        return self.value is not None

    def spread(self) -> Interval | None:
        """The value's interval as an :class:`~mlflow_di.intervals.Interval` (None for an exact figure); an
        incomplete campaign's rate (a lower bound) reaches up to 1 above its own interval's low end."""
        if self.interval is None and self.bound != "lower":
            return None
        low, high = self.interval if self.interval is not None else (self.value, self.value)
        if self.bound == "lower":
            high = max(high, 1.0, self.value)
        return Interval(low, high, self.n or 0, self.interval_method or "recorded", self.confidence)


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
    #: what the measured value rests on (the measurement's ``evidence``)
    evidence: Evidence | None = None
    #: the 95% interval of what the threshold applies to (the measured value, or a relative check's change),
    #: when it is a sample's figure, with the sample size and the method
    interval: tuple[float, float] | None = None
    n: int | None = None
    interval_method: str = ""
    confidence: float = CONFIDENCE
    #: PASS, FAIL, INCONCLUSIVE (the threshold is inside the interval) or MISSING (nothing to judge); ``passed``
    #: says whether it counts as passed (an INCONCLUSIVE check only when the gate counts those as passing)
    outcome: str = ""

    JSON_OPTIONAL = {**{name: None for name in ("relation", "baseline", "change", "baseline_model", "baseline_run_id")},
                     "data": "", "evidence": None, "interval": None, "n": None, "interval_method": "",
                     "confidence": CONFIDENCE, "outcome": ""}

    def __post_init__(self):
        if not self.outcome:  # a check read back from a verdict written before the three outcomes
            self.outcome = PASS if self.passed else (FAIL if self.compared is not None else MISSING)

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

    def spread_text(self) -> str:
        """The interval as the reports print it, e.g. ``95% CI 0.0033-0.023, n=497`` ("" without one)."""
        if self.interval is None:
            return ""
        low, high = self.interval
        size = f", n={self.n}" if self.n else ""
        return f"{confidence_text(self.confidence)} CI {low:.4g}-{high:.4g}{size}"


def confidence_text(confidence: float) -> str:
    """``95%``, ``98.3%``: an interval's confidence as its label says it."""
    return f"{confidence * 100:.3g}%"


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
    #: how an INCONCLUSIVE check counts (one of :data:`INCONCLUSIVE_AS`; ``gate --inconclusive``)
    inconclusive_as: str = "inconclusive"

    JSON_DUMPS = {"indent": 2}
    JSON_OPTIONAL = {"baseline_uri": None, "baseline_measurements": [], "inconclusive_as": "inconclusive"}

    @property
    def passed(self) -> bool:
        return self.outcome == PASS

    @property
    def failures(self) -> list[Check]:
        """Every check that does not count as passed (failed, inconclusive unless counted as passing, missing)."""
        return [c for c in self.checks if not c.passed]

    @property
    def unmeasured(self) -> list[Check]:
        """Checks with no value to judge (the version was not analysed for them)."""
        return [c for c in self.checks if c.outcome == MISSING]

    @property
    def inconclusive(self) -> list[Check]:
        """Checks whose interval holds their threshold: the evidence cannot decide them."""
        return [c for c in self.checks if c.outcome == INCONCLUSIVE]

    @property
    def outcome(self) -> str:
        """``FAIL`` (a measured value's whole interval is beyond its threshold), else ``ERROR`` (some check had
        nothing to judge: the version could not be analysed, which says nothing about its quality and must not
        read as a failure), else ``INCONCLUSIVE`` (some interval holds its threshold: more evidence would
        decide), else ``PASS``. ``inconclusive_as`` counts INCONCLUSIVE checks as failed, as errors or as
        passed instead."""
        if not self.checks:
            return "ERROR"
        undecided = bool(self.inconclusive)
        if any(c.outcome == FAIL for c in self.checks) or (undecided and self.inconclusive_as == "fail"):
            return FAIL
        if self.unmeasured or (undecided and self.inconclusive_as == "error"):
            return "ERROR"
        if undecided and self.inconclusive_as == "inconclusive":
            return INCONCLUSIVE
        return PASS

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL, 2 ERROR, 3 INCONCLUSIVE (:data:`EXIT_CODES`)."""
        return EXIT_CODES[self.outcome]

    @property
    def cause(self) -> str:
        """Why the outcome is ERROR, in one line (the first unmeasured check's message); else ''."""
        if self.outcome != "ERROR":
            return ""
        check = self.unmeasured[0] if self.unmeasured else (self.inconclusive[0] if self.inconclusive else None)
        if check is not None and check.outcome == INCONCLUSIVE:
            return f"{check.label} is inconclusive (counted as an error by --inconclusive error): {check.message}"
        return (check.message or f"{check.label} was not measured") if check else "no check was given"

    def worst(self, metric: str) -> float | None:
        """The least favourable recorded value of ``metric`` (over compressed models), None if none."""
        values = [m.value for m in self.measurements if m.metric == metric and m.found]
        if not values:
            return None
        return min(values) if CHECKS[metric].greater_is_better else max(values)

    def worst_change(self, relation: str) -> Check | None:
        """The relative check of ``relation`` (e.g. ``idc_drop``) with the least favourable change, None if none."""
        compared = [c for c in self.checks if c.criterion == relation and c.change is not None]
        if not compared:
            return None
        pick = min if RELATIONS[relation].greater_is_better else max
        return pick(compared, key=lambda c: c.change)

    def summary(self) -> str:
        """One line, e.g. ``fail: 3/4 checks passed; failed: success_rate [models:/c/1]``."""
        passed = sum(c.outcome == PASS for c in self.checks)
        text = f"{self.outcome.lower()}: {passed}/{len(self.checks)} checks passed"
        beyond = [c.label for c in self.checks if c.outcome == FAIL]
        if beyond:
            text += "; failed: " + ", ".join(beyond)
        if self.inconclusive:
            counted = {"fail": " (counted as failed)", "pass": " (counted as passed)",
                       "error": " (counted as errors)"}.get(self.inconclusive_as, "")
            text += f"; inconclusive{counted}: " + ", ".join(c.label for c in self.inconclusive)
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
                counts[0] += check.outcome == PASS
                counts[1] += 1
                if check.outcome == MISSING:
                    counts[2].append(check.criterion)
        return {export: (passed, total, missing) for export, (passed, total, missing) in exports.items()}

    @property
    def contexts(self) -> list[str]:
        """Each distinct execution context behind the checks' figures (where compressed models were run)."""
        return list(dict.fromkeys(c.evidence.context for c in self.checks if c.evidence and c.evidence.context))

    def to_dict(self) -> dict:
        values = super().to_dict()
        contexts = {"contexts": self.contexts} if self.contexts else {}  # verdicts without one keep their keys
        return {"model_uri": values.pop("model_uri"), "passed": self.passed, **contexts, **values}

    @classmethod
    def from_dict(cls, values: dict) -> "Verdict":
        values = dict(values)
        values.pop("passed", None)  # derived from the checks
        values.pop("contexts", None)  # derived too
        values.pop("outcome", None)  # derived too; the gate command writes it beside the verdict
        return super().from_dict(values)


def decide(model_uri: str, thresholds: Thresholds, measurements: list[Measurement],
           baseline: Baseline | None = None, inconclusive_as: str = "inconclusive") -> Verdict:
    """Apply every given threshold to every measurement of its criterion, and every relative
    threshold to every measurement compared with its baseline counterpart.

    Each check is PASS or FAIL only when the measurement's whole interval is on one side of its
    threshold, INCONCLUSIVE otherwise (an exact figure, without an interval, is judged by its value).
    A criterion without any measurement (e.g. no compressed model was ever fuzzed) gets one
    MISSING check saying which command to run. ``inconclusive_as``: how INCONCLUSIVE checks count
    (:data:`INCONCLUSIVE_AS`).
    """
    if inconclusive_as not in INCONCLUSIVE_AS:
        raise UserError(f"--inconclusive is one of {', '.join(INCONCLUSIVE_AS)}, got {inconclusive_as!r}")
    thresholds.require_any().require_baseline(baseline is not None)
    checks = []
    for criterion, threshold in thresholds.given():
        checks.extend(_check(criterion, threshold, m) for m in _relevant(criterion, measurements, model_uri))
    for relation, threshold in thresholds.relative():
        checks.extend(_relative_check(relation, threshold, m, baseline)
                      for m in _relevant(CHECKS[relation.metric], measurements, model_uri))
    for check in checks:
        check.passed = check.outcome == PASS or (check.outcome == INCONCLUSIVE and inconclusive_as == "pass")
    if baseline is None:
        return Verdict(model_uri, thresholds, checks, list(measurements), inconclusive_as=inconclusive_as)
    return Verdict(model_uri, thresholds, checks, list(measurements), baseline.uri, list(baseline.measurements),
                   inconclusive_as=inconclusive_as)


def _relevant(criterion: CheckDeclaration, measurements: list[Measurement], model_uri: str) -> list[Measurement]:
    """The measurements of ``criterion``, or one missing measurement saying what to run."""
    relevant = [m for m in measurements if m.metric == criterion.metric]
    return relevant or [Measurement(criterion.metric, None, missing=missing_message(criterion, model_uri))]


def _check(criterion: CheckDeclaration, threshold: float, measurement: Measurement) -> Check:
    value, spread = measurement.value, None
    if not measurement.found:
        outcome, message = MISSING, measurement.missing or missing_message(criterion, "the model")
    elif measurement.unsized:
        outcome, message = INCONCLUSIVE, measurement.unsized
    else:
        spread = measurement.spread()
        outcome = judge(spread, value, threshold, criterion.greater_is_better)
        message = "; ".join(filter(None, (_undecided(criterion, threshold, measurement, spread)
                                          if outcome == INCONCLUSIVE else "", measurement.note)))
    return Check(criterion.metric, measurement.compressed, value, threshold=float(threshold),
                 greater_is_better=criterion.greater_is_better, passed=outcome == PASS, run_id=measurement.run_id,
                 message=message, data=measurement.data, evidence=measurement.evidence,
                 interval=None if spread is None else (spread.low, spread.high), n=measurement.n,
                 interval_method=measurement.interval_method, confidence=measurement.confidence, outcome=outcome)


def _undecided(criterion: CheckDeclaration, threshold: float, measurement: Measurement, spread: Interval) -> str:
    """Why a check is INCONCLUSIVE and about how much evidence at the same value would decide it."""
    value = measurement.value
    if measurement.bound == "lower":
        return (f"{value:.4g} is only a lower bound ({confidence_text(spread.confidence)} CI from {spread.low:.4g}), "
                f"which cannot show {criterion.metric} {criterion.comparison} {threshold:g}")
    text = (f"{criterion.metric} {value:.4g} is inconclusive against {threshold:g}: its "
            f"{confidence_text(spread.confidence)} interval "
            f"{spread.low:.4g}-{spread.high:.4g} ({measurement.interval_method or 'recorded'}"
            + (f", n={measurement.n} {criterion.sample}" if measurement.n else "") + ") holds the threshold")
    return text + _to_decide(criterion, threshold, measurement, spread)


def _to_decide(criterion: CheckDeclaration, threshold: float, measurement: Measurement, spread: Interval) -> str:
    """``; about N more images at this rate would decide`` (or why none would), "" when it cannot be said."""
    n, value = measurement.n, measurement.value
    if not n or not criterion.sample:
        return ""
    if measurement.interval_method == CLOPPER_PEARSON:
        size = rate_sample_to_decide(round(value * n), n, threshold, criterion.greater_is_better,
                                     lambda k, m: clopper_pearson(k, m, spread.confidence))
    else:
        size = sample_to_decide(spread, value, threshold, criterion.greater_is_better)
    if size is None:
        return "; no amount of evidence at this value would decide: it equals the threshold"
    return f"; about {size - n:,} more {criterion.sample} at this value would decide"


def _relative_check(relation: Relation, threshold: float, measurement: Measurement, baseline: Baseline) -> Check:
    check = Check(relation.metric, measurement.compressed, measurement.value, threshold=float(threshold),
                  greater_is_better=relation.greater_is_better, passed=False, run_id=measurement.run_id,
                  relation=relation.kind, data=measurement.data, evidence=measurement.evidence, outcome=MISSING)
    if baseline.uri is None:  # none yet (--baseline-optional): nothing to fall behind
        check.outcome, check.message = PASS, baseline.absent or "no baseline"
        return check
    counterpart, problem = pair(measurement, baseline)
    if counterpart is not None:
        check.baseline, check.baseline_model, check.baseline_run_id = (counterpart.value, counterpart.compressed
                                                                       or baseline.uri, counterpart.run_id)
    if not measurement.found:
        check.message = measurement.missing or missing_message(CHECKS[relation.metric], "the model")
    elif measurement.bound:
        check.measured, check.message = None, f"only a {measurement.bound} bound, not compared: {measurement.note}"
    elif problem:
        check.message = problem
    elif measurement.unsized or counterpart.unsized:
        check.outcome, check.message = INCONCLUSIVE, measurement.unsized or f"baseline: {counterpart.unsized}"
    else:
        check.change = relation.change(measurement.value, counterpart.value)
        spread = _change_spread(relation, measurement, counterpart)
        check.outcome = judge(spread, check.change, threshold, relation.greater_is_better)
        if spread is not None:
            check.interval, check.n, check.interval_method = (spread.low, spread.high), spread.n, spread.method
            check.confidence = spread.confidence
            if check.outcome == INCONCLUSIVE:
                check.message = (f"{relation.name} {check.change:.4g} is inconclusive against {threshold:g}: its "
                                 f"{confidence_text(spread.confidence)} interval {spread.low:.4g}-{spread.high:.4g} "
                                 f"({spread.method}) holds the threshold")
    return check


def _change_spread(relation: Relation, candidate: Measurement, baseline: Measurement) -> Interval | None:
    """The interval of a relative check's change, from the candidate's and the baseline's own intervals (MOVER:
    they were measured independently); None when either is an exact figure or the change is not finite."""
    ours, theirs = candidate.spread(), baseline.spread()
    if ours is None or theirs is None or not math.isfinite(relation.change(candidate.value, baseline.value)):
        return None
    if relation.kind == "drop":
        return mover(baseline.value, theirs, candidate.value, ours)
    if relation.kind == "rise":
        return mover(candidate.value, ours, baseline.value, theirs)
    if min(candidate.value, baseline.value, ours.low, theirs.low) <= 0:
        return None  # a ratio's interval needs positive figures
    return mover(candidate.value, ours, baseline.value, theirs, kind="ratio")


def pair(measurement: Measurement, baseline: Baseline) -> tuple[Measurement | None, str]:
    """The baseline's measurement to compare ``measurement`` with, and what is wrong when there is none
    with a value: the same metric, of the export made by the same method (any export when the
    baseline is itself one); of several, the newest registered version."""
    criterion = CHECKS[measurement.metric]
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


def missing_message(criterion: CheckDeclaration, model_uri: str, compressed: str | None = None) -> str:
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
