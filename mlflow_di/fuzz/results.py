"""What a fuzzing campaign produces: per-seed records, a summary, the triggering inputs.

All are dataclasses that round-trip through JSON (``to_json``/``from_json``, from
:mod:`mlflow_di.results_json`); the images
(triggers and their seeds, uint8) travel as arrays beside the JSON (see
:mod:`mlflow_di.fuzz.store`).

Metrics follow the DFlare paper: success rate over the seeds the two models agree on, and
mean/median queries and seconds per triggering input over the successful seeds. Seeds on
which the models already disagree are counted apart and never fuzzed.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import statistics

import numpy as np

from mlflow_di.results_json import JsonRoundTrip


class Stop(str, enum.Enum):
    """Why a seed's search stopped. A ``str`` whose value is what the JSON files and tables hold,
    so ``record.stop == "trigger"`` and ``f"{record.stop}"`` give the plain word."""

    TRIGGER = "trigger"
    TIMEOUT = "timeout"
    MAX_QUERIES = "max_queries"
    ALREADY_DEVIATING = "already_deviating"
    #: no mutant within the campaign's constraint (--max-linf, --min-ssim) could be found
    CONSTRAINED = "constrained"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: Why a seed's search stopped, as the words the files hold.
STOPS = tuple(stop.value for stop in Stop)


@dataclasses.dataclass
class SeedRecord(JsonRoundTrip):
    """One seed's outcome.

    ``seed_labels``/``seed_probabilities``: (original, compressed) top-1 label and probability
    on the seed itself; ``trigger_labels``/``trigger_probabilities``: the same on the triggering
    input (None when none was found). ``operators``: the mutations that turn the seed into the
    trigger, in order (DFlare: every accepted operator, including ones that happened to leave
    the image unchanged, then the triggering one; DiffChaser: the first-parent lineage from the
    seed, 'pixel_noise' for each mutation and 'crossover' for each recombination).
    ``operator_counts``: per operator, [times selected, times accepted] (DiffChaser: mutated
    chromosomes, and 0 accepted, as it accepts no single mutations).
    ``seconds`` is the seed's share of the campaign's time (see :mod:`mlflow_di.fuzz.campaign`).
    ``trigger_distances``: how far the trigger is from its seed (L0, L2, L-inf, SSIM; see
    :mod:`mlflow_di.fuzz.realism`); ``constraint_rejections``: mutants rejected unqueried for leaving
    the campaign's constraint.
    """

    index: int
    label: int
    success: bool
    stop: Stop
    queries: int
    seconds: float
    seed_labels: tuple[int, int]
    seed_probabilities: tuple[float, float]
    trigger_labels: tuple[int, int] | None = None
    trigger_probabilities: tuple[float, float] | None = None
    operators: list[str] = dataclasses.field(default_factory=list)
    operator_counts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    trigger_distances: dict[str, float] | None = None
    constraint_rejections: int = 0
    #: DeepXplore (any number of models): every model's top-1 label on the trigger, or on the seed when
    #: none was found, in the order the models were given (original first); ``trigger_labels`` then
    #: hold the original's label and that of the first model that deviates from it
    model_labels: list[int] | None = None
    #: DeepXplore: the number of the model (0 = original) whose confidence in the seed's label the
    #: search lowered while keeping the others' (the paper's randomly picked model j)
    target_model: int | None = None
    #: white-box strategies (boundary): the original's forward plus backward passes for this seed,
    #: reported apart from ``queries`` (images sent to the compressed model)
    original_passes: int | None = None

    def __post_init__(self):
        self.stop = Stop(self.stop)

    #: fields added later, written only when set, so records of campaigns without them keep their bytes
    JSON_OPTIONAL = {"trigger_distances": None, "constraint_rejections": 0, "model_labels": None,
                     "target_model": None, "original_passes": None}

    @property
    def already_deviating(self) -> bool:
        return self.stop is Stop.ALREADY_DEVIATING


@dataclasses.dataclass
class OperatorSummary(JsonRoundTrip):
    """One operator over a campaign: times selected, accepted (became the new best), and
    ``triggered``: times it produced the triggering input."""

    selected: int = 0
    accepted: int = 0
    triggered: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.selected if self.selected else 0.0


@dataclasses.dataclass
class CampaignSummary(JsonRoundTrip):
    """Campaign-level metrics; per-trigger means are over successful seeds (None without any)."""

    strategy: str
    seeds: int
    already_deviating: int
    fuzzed: int
    triggers: int
    success_rate: float
    mean_queries: float | None
    median_queries: float | None
    mean_seconds: float | None
    total_queries: int
    total_seconds: float
    queries_per_second: float
    operators: dict[str, OperatorSummary]

    JSON_DUMPS = {"indent": 2}

    @classmethod
    def from_records(cls, strategy: str, records: list[SeedRecord]) -> "CampaignSummary":
        fuzzed = [r for r in records if not r.already_deviating]
        found = [r for r in fuzzed if r.success]
        total_queries = sum(r.queries for r in fuzzed)
        total_seconds = sum(r.seconds for r in fuzzed)
        return cls(
            strategy=strategy,
            seeds=len(records),
            already_deviating=len(records) - len(fuzzed),
            fuzzed=len(fuzzed),
            triggers=len(found),
            success_rate=len(found) / len(fuzzed) if fuzzed else 0.0,
            mean_queries=statistics.fmean(r.queries for r in found) if found else None,
            median_queries=float(statistics.median(r.queries for r in found)) if found else None,
            mean_seconds=statistics.fmean(r.seconds for r in found) if found else None,
            total_queries=total_queries,
            total_seconds=total_seconds,
            queries_per_second=total_queries / total_seconds if total_seconds > 0 else 0.0,
            operators=_operator_summaries(fuzzed),
        )


def sample_intervals(records: list[SeedRecord], realistic: int | None = None, confidence: float = 0.95
                     ) -> dict[str, float]:
    """The intervals (at ``confidence``, two-sided) of what a campaign's gate checks judge, as
    ``NAME_low``/``NAME_high``/``NAME_n``: the success rate and (given ``realistic``, the triggers within the
    realism budget) the realistic success rate over the fuzzed seeds (Clopper-Pearson), and the mean queries per
    deviation over the seeds that gave one (a seeded percentile bootstrap of the mean; none below two such seeds)."""
    from mlflow_di.intervals import bootstrap_mean, clopper_pearson

    fuzzed = [r for r in records if not r.already_deviating]
    found = [r.queries for r in fuzzed if r.success]
    figures = {"success_rate": clopper_pearson(len(found), len(fuzzed), confidence)}
    if realistic is not None:
        figures["realistic_success_rate"] = clopper_pearson(realistic, len(fuzzed), confidence)
    queries = bootstrap_mean(found, confidence)
    if queries is not None:
        figures["mean_queries"] = queries
    return {f"{name}_{end}": value for name, interval in figures.items()
            for end, value in (("low", interval.low), ("high", interval.high), ("n", interval.n))}


def _operator_summaries(records: list[SeedRecord]) -> dict[str, OperatorSummary]:
    summaries: dict[str, OperatorSummary] = {}
    for record in records:
        for name, (selected, accepted) in record.operator_counts.items():
            summary = summaries.setdefault(name, OperatorSummary())
            summary.selected += selected
            summary.accepted += accepted
        if record.success and record.operators:
            summaries.setdefault(record.operators[-1], OperatorSummary()).triggered += 1
    return summaries


@dataclasses.dataclass
class CampaignConfig(JsonRoundTrip):
    """Everything that determines a campaign's results, recorded so that ``resume`` can check it."""

    strategy: str
    strategy_options: dict
    timeout: float
    max_queries: int | None
    seed: int
    data: str
    seed_count: int
    seeds_sha256: str
    image_shape: tuple[int, int, int]
    original: str
    compressed: str

    #: Fields that may differ between an interrupted run and its resumption: names, and the time safety
    #: net (a seed's record depends on its work budget alone; one the net stopped is searched again).
    INFORMATIONAL = ("original", "compressed", "data", "timeout")
    JSON_DUMPS = {"indent": 2}

    def differences(self, other: "CampaignConfig") -> list[str]:
        """Names of the result-determining fields whose values differ."""
        mine, theirs = json.loads(self.to_json()), json.loads(other.to_json())
        return [key for key in mine if key not in self.INFORMATIONAL and mine[key] != theirs.get(key)]


@dataclasses.dataclass
class RunStats(JsonRoundTrip):
    """How this run spent its time (this process only; not carried over by resume).

    ``model_seconds``: inside the two models' ``predict_proba`` calls; ``search_seconds``: in the
    searches (mutation, fitness, selection); ``calls``: lockstep iterations (one batched call per
    model each); ``inputs``: images sent to each model (queries plus speculative inputs that
    were dropped unused). With several campaigns sharing the original (``fuzz --compressed A
    --compressed B``): ``original_inputs`` is this campaign's share of the images the original
    evaluated (each distinct image once, shared in proportion to inputs), and
    ``shared_original_inputs`` what the original evaluated for all campaigns together.
    """

    model_seconds: float = 0.0
    search_seconds: float = 0.0
    calls: int = 0
    inputs: int = 0
    original_inputs: float = 0.0
    shared_original_inputs: int = 0

    @property
    def mean_batch(self) -> float:
        return self.inputs / self.calls if self.calls else 0.0


@dataclasses.dataclass
class CampaignResult:
    """A campaign: config, per-seed records (by seed index), summary and the triggering inputs.

    ``triggers[i]`` was found from ``trigger_seeds[i]``, seed number ``trigger_indices[i]``
    (uint8, (T, H, W, C)). ``complete`` is False when the run was interrupted before every
    seed finished (resume it with ``resume=True``). ``run_stats``: where this run's time went
    (None when loaded from disk). ``to_json`` leaves the arrays out.
    """

    config: CampaignConfig
    summary: CampaignSummary
    records: list[SeedRecord]
    triggers: np.ndarray
    trigger_seeds: np.ndarray
    trigger_indices: np.ndarray
    complete: bool = True
    run_stats: RunStats | None = None
    #: DeepXplore: neuron coverage reached per model (``original``, ``compressed`` or ``compressed_K``)
    #: and ``all`` models together, over the seeds and the triggers (see :mod:`mlflow_di.fuzz.deepxplore`)
    neuron_coverage: dict[str, float] | None = None

    def to_dict(self) -> dict:
        """Everything but the arrays (which travel beside the JSON, see :mod:`mlflow_di.fuzz.store`)."""
        values = {"config": self.config.to_dict(), "summary": self.summary.to_dict(),
                  "records": [r.to_dict() for r in self.records], "complete": self.complete,
                  "run_stats": self.run_stats.to_dict() if self.run_stats else None}
        if self.neuron_coverage is not None:  # only DeepXplore campaigns: the others keep their bytes
            values["neuron_coverage"] = self.neuron_coverage
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str, triggers: np.ndarray | None = None, trigger_seeds: np.ndarray | None = None,
                  trigger_indices: np.ndarray | None = None) -> "CampaignResult":
        values = json.loads(text)
        config = CampaignConfig.from_dict(values["config"])
        empty = np.zeros((0, *config.image_shape), np.uint8)
        return cls(
            config=config,
            summary=CampaignSummary.from_dict(values["summary"]),
            records=[SeedRecord.from_dict(r) for r in values["records"]],
            triggers=empty if triggers is None else triggers,
            trigger_seeds=empty if trigger_seeds is None else trigger_seeds,
            trigger_indices=np.zeros(0, np.int64) if trigger_indices is None else trigger_indices,
            complete=values.get("complete", True),
            run_stats=RunStats.from_dict(values["run_stats"]) if values.get("run_stats") else None,
            neuron_coverage=values.get("neuron_coverage"),
        )


def comparable_records(result: "CampaignResult", digits: int = 5) -> list[dict]:
    """A campaign's records without the wall-clock ``seconds`` and with floats rounded to ``digits``
    places: what two runs of one campaign must agree on (the models' float32 outputs for an input
    differ in the last bits with the size of the batch it was evaluated in; the searches' decisions
    do not, see :mod:`mlflow_di.fuzz.dflare`)."""
    def rounded(value):
        if isinstance(value, float):
            return round(value, digits)
        if isinstance(value, (list, tuple)):
            return [rounded(v) for v in value]
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        return value
    return [rounded({k: v for k, v in r.to_dict().items() if k != "seconds"}) for r in result.records]
