"""A bounded int8 export: the fewest layers left in float for which an int8-static export meets its bounds.

OpenVINO NNCF's ``quantize_with_accuracy_control(max_drop=...)`` reverts the worst layers to
float until an accuracy drop is met. Accuracy can stay flat while answers flip, so here a bound
can also be on the top-1 *disagreement* with the original (:class:`Bounds`). The search, measured
on a search split of labelled images (:func:`search_float_layers`):

1. every layer quantized: if that meets every bound, nothing stays in float;
2. the layers are ranked (the caller passes the layer-wise diagnosis's order, worst first); keeping
   all but the last-ranked layer in float must meet the bounds, else no export can and
   :class:`UnreachableBounds` says which bound fails and by how much;
3. bisection on how many of the ranked layers stay in float finds the shortest meeting prefix.
   It assumes that keeping more layers in float does not hurt; every candidate is measured, so
   where that is false the result is larger than needed, never wrong;
4. backward elimination: each kept layer, least suspicious first, goes back to int8 if the
   export still meets every bound without it.

The chosen export is then measured once on a held-out split it was not chosen on
(:func:`verify`), because a rate near its bound on a few thousand images is mostly noise: the
held-out figure comes with its one-sided 95% Clopper-Pearson upper bound.

Pure search over a ``measure(kept_float) -> Scores`` function; :func:`bounded_int8_static` wires
it to :func:`~mlflow_di.compression.methods.compress` and ONNX Runtime.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip

CONFIDENCE = 0.95


@dataclasses.dataclass
class Scores(JsonRoundTrip):
    """How an export's top-1 answers compare with the original's and the labels on one split."""

    images: int
    disagreements: int
    original_correct: int
    compressed_correct: int
    fuzzed: int = 0  # seeds a realistic (boundary) search ran on, when a bound asks for it
    realistic: int = 0  # of those, seeds on which it found a trigger inside the realism budget

    @property
    def realistic_success_rate(self) -> float:
        return self.realistic / self.fuzzed if self.fuzzed else 0.0

    @property
    def disagreement_rate(self) -> float:
        return self.disagreements / self.images if self.images else 0.0

    @property
    def accuracy_drop(self) -> float:
        """Original minus export accuracy (a fraction; negative when the export is better)."""
        return (self.original_correct - self.compressed_correct) / self.images if self.images else 0.0

    def disagreement_upper_bound(self, confidence: float = CONFIDENCE) -> float:
        """One-sided Clopper-Pearson upper bound of the disagreement rate at ``confidence``."""
        return clopper_pearson_upper(self.disagreements, self.images, confidence)

    def describe(self, upper_bound: bool = False) -> str:
        """One line; ``upper_bound`` adds the disagreement rate's 95% upper bound."""
        upper = f"; 95% upper bound {self.disagreement_upper_bound():.2%}" if upper_bound else ""
        text = (f"top-1 differs on {self.disagreements} of {self.images} images ({self.disagreement_rate:.2%}{upper}), "
                f"accuracy drop {self.accuracy_drop * 100:+.2f} points")
        if self.fuzzed:
            text += f", realistic triggers on {self.realistic} of {self.fuzzed} fuzzed seeds"
        return text


def scores(original_labels, compressed_labels, labels) -> Scores:
    """:class:`Scores` from the two models' top-1 labels and the true labels of one split."""
    original, compressed, labels = (np.asarray(a) for a in (original_labels, compressed_labels, labels))
    return Scores(len(labels), int(np.sum(original != compressed)), int(np.sum(original == labels)),
                  int(np.sum(compressed == labels)))


def clopper_pearson_upper(successes: int, trials: int, confidence: float = CONFIDENCE) -> float:
    """The exact one-sided upper confidence bound of a binomial rate (1.0 with no trials)."""
    from scipy.stats import beta

    if trials == 0 or successes >= trials:
        return 1.0
    return float(beta.ppf(confidence, successes + 1, trials - successes))


@dataclasses.dataclass(frozen=True)
class Bounds(JsonRoundTrip):
    """What an export must meet; None leaves a bound out. Both are fractions (0.01 = 1 point / 1%)."""

    max_accuracy_drop: float | None = None
    max_disagreement_rate: float | None = None
    #: of seeds fuzzed with the boundary strategy, those with a trigger inside the realism budget
    max_realistic_success_rate: float | None = None

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if value is not None and not (math.isfinite(value) and 0 <= value <= 1):
                raise UserError(f"--{name.replace('_', '-')} must be a fraction between 0 and 1, got {value}")

    @property
    def active(self) -> bool:
        return any(value is not None for value in dataclasses.asdict(self).values())

    def failures(self, measured: Scores) -> list[str]:
        """One phrase per bound ``measured`` misses (empty when it meets them all)."""
        missed = []
        if self.max_accuracy_drop is not None and measured.accuracy_drop > self.max_accuracy_drop:
            missed.append(f"accuracy drop {measured.accuracy_drop:.2%} > --max-accuracy-drop {self.max_accuracy_drop:g}")
        if self.max_disagreement_rate is not None and measured.disagreement_rate > self.max_disagreement_rate:
            missed.append(f"disagreement rate {measured.disagreement_rate:.2%} ({measured.disagreements} of "
                          f"{measured.images}) > --max-disagreement-rate {self.max_disagreement_rate:g}")
        if self.max_realistic_success_rate is not None and \
                measured.realistic_success_rate > self.max_realistic_success_rate:
            missed.append(f"realistic success rate {measured.realistic_success_rate:.2%} ({measured.realistic} of "
                          f"{measured.fuzzed} seeds) > --max-realistic-success-rate {self.max_realistic_success_rate:g}")
        return missed

    def met_by(self, measured: Scores) -> bool:
        return not self.failures(measured)

    def describe(self) -> str:
        parts = []
        if self.max_accuracy_drop is not None:
            parts.append(f"accuracy drop <= {self.max_accuracy_drop:g}")
        if self.max_disagreement_rate is not None:
            parts.append(f"disagreement rate <= {self.max_disagreement_rate:g}")
        if self.max_realistic_success_rate is not None:
            parts.append(f"realistic success rate <= {self.max_realistic_success_rate:g}")
        return " and ".join(parts) or "no bound"


@dataclasses.dataclass
class Trial(JsonRoundTrip):
    """One candidate export measured on the search split: which layers stayed in float, and why it was tried."""

    kept_float: list[str]
    step: str  # "all int8", "all but one", "bisection" or "elimination"
    search: Scores
    meets: bool


@dataclasses.dataclass
class BoundedSearch(JsonRoundTrip):
    """The search's record: the bounds, the ranking it walked, every export it measured and its choice."""

    bounds: Bounds
    ranking: list[str]
    trials: list[Trial]
    kept_float: list[str]
    held_out: Scores | None = None

    JSON_DUMPS = {"indent": 2}

    @property
    def exports(self) -> int:
        """Exports made and measured (the search's cost, in units of one plain int8 export)."""
        return len(self.trials)

    @property
    def chosen(self) -> Trial:
        return next(t for t in self.trials if sorted(t.kept_float) == sorted(self.kept_float))

    @property
    def held_out_failures(self) -> list[str]:
        return self.bounds.failures(self.held_out) if self.held_out is not None else []

    def rows(self) -> list[dict]:
        """One table row per measured export, in the order they were made."""
        return [{"kept in float": ", ".join(t.kept_float) or "(none)", "step": t.step,
                 "disagreements": t.search.disagreements, "disagreement rate": f"{t.search.disagreement_rate:.3%}",
                 "accuracy drop": f"{t.search.accuracy_drop * 100:+.2f} pts",
                 **({"realistic triggers": f"{t.search.realistic}/{t.search.fuzzed}"} if t.search.fuzzed else {}),
                 "meets": "yes" if t.meets else "no",
                 "chosen": "<-" if sorted(t.kept_float) == sorted(self.kept_float) else ""} for t in self.trials]


class UnreachableBounds(UserError):
    """No export with at least one quantized layer meets the bounds; ``search`` holds what was measured."""

    def __init__(self, message: str, search: BoundedSearch):
        super().__init__(message)
        self.search = search


def search_float_layers(ranking: list[str], measure: Callable[[tuple], Scores], bounds: Bounds,
                        on_trial: Callable[[Trial], None] | None = None) -> BoundedSearch:
    """The fewest of ``ranking``'s layers (worst first) to keep in float so that ``measure`` meets ``bounds``.

    ``measure(kept_float)`` exports with those layers in float and scores the export on the search
    split; each set is measured once. ``on_trial`` is told of every measurement (progress).
    Raises :class:`UnreachableBounds` when even all layers but one in float miss a bound.
    """
    if not bounds.active:
        raise UserError("a bounded export needs a bound: pass --max-accuracy-drop, --max-disagreement-rate or "
                        "--max-realistic-success-rate")
    ranking = list(dict.fromkeys(ranking))
    trials: list[Trial] = []
    measured: dict[frozenset, Trial] = {}

    def meets(kept, step: str) -> bool:
        key = frozenset(kept)
        if key not in measured:
            result = measure(tuple(kept))
            measured[key] = Trial(list(kept), step, result, bounds.met_by(result))
            trials.append(measured[key])
            if on_trial is not None:
                on_trial(measured[key])
        return measured[key].meets

    def record(kept) -> BoundedSearch:
        return BoundedSearch(bounds, ranking, trials, list(kept))

    if meets((), "all int8"):
        return record(())
    if len(ranking) < 2:
        raise UnreachableBounds(f"the fully quantized export misses {bounds.describe()} "
                                f"({'; '.join(bounds.failures(trials[0].search))}) and the model has "
                                f"{len(ranking)} quantizable layer, so none can stay in float", record(()))
    if not meets(ranking[:-1], "all but one"):
        last = trials[-1]
        raise UnreachableBounds(
            f"no int8 export meets {bounds.describe()}: even with {len(ranking) - 1} of {len(ranking)} layers in "
            f"float (only {ranking[-1]} quantized) {'; '.join(bounds.failures(last.search))} on the search data; "
            "loosen the bound or use another method", record(ranking[:-1]))
    low, high = 0, len(ranking) - 1  # prefix lengths: low misses, high meets
    while high - low > 1:
        middle = (low + high) // 2
        if meets(ranking[:middle], "bisection"):
            high = middle
        else:
            low = middle
    kept = list(ranking[:high])
    for layer in reversed(kept[:]):  # least suspicious first
        candidate = [name for name in kept if name != layer]
        if meets(candidate, "elimination"):
            kept = candidate
    return record(kept)


def rank_layers(diagnosis, layers: list[str]) -> list[str]:
    """The search's ranking: the layers by the diagnosis's score (a
    :class:`~mlflow_di.compression.quant_debug.LayerDiagnosis`, worst first), then ``layers`` it never reached."""
    scored = list(diagnosis.layer_scores())
    return scored + [name for name in layers if name not in scored]


def verify(search: BoundedSearch, measure_held_out: Callable[[tuple], Scores]) -> BoundedSearch:
    """Measure the chosen export on the held-out split; the figures land in ``search.held_out``."""
    search.held_out = measure_held_out(tuple(search.kept_float))
    return search


@dataclasses.dataclass
class LabelledSplit:
    """One split of labelled images: ``images`` as a classifier's ``predict`` takes them (raw uint8, an
    array or lazy), their true ``labels`` and the original model's top-1 labels (``original``)."""

    name: str
    images: object
    labels: np.ndarray
    original: np.ndarray

    def score(self, export_path, preprocessing=None, device=None) -> Scores:
        """The :class:`Scores` of the ONNX model at ``export_path`` (run by ONNX Runtime) on this split."""
        from mlflow_di.models.classifier import OnnxClassifier

        predicted = OnnxClassifier(export_path, preprocessing=preprocessing, device=device).predict(self.images)
        return scores(self.original, predicted, self.labels)


@dataclasses.dataclass
class RealisticProbe:
    """How a candidate's realistic deviation is measured for ``--max-realistic-success-rate``: the
    boundary strategy (:mod:`~mlflow_di.fuzz.boundary`) from the PyTorch ``original`` against the
    candidate export, inside ``budget``, at most ``max_queries`` to the export per seed, on the first
    ``seeds`` images of each split.

    The budget is L-inf <= 32 levels: the boundary walk inside it costs about 0.4 s a seed on the
    reference LeNets against 2 s inside SSIM >= 0.9 (benchmarks/RESULTS.md, bench_boundary), and the
    search fuzzes every candidate."""

    original: object  # a TorchModel
    seeds: int = 50
    max_queries: int = 200
    max_linf: int = 32

    def count(self, export_path, split: LabelledSplit, preprocessing, device=None) -> tuple[int, int]:
        """(seeds fuzzed, seeds with a realistic trigger) for one export on one split's first seeds."""
        from mlflow_di.data import ImageSet
        from mlflow_di.fuzz.boundary import BoundaryWalk, run_boundary
        from mlflow_di.fuzz.realism import Constraint, realism_summary
        from mlflow_di.models.classifier import OnnxClassifier

        budget = Constraint(max_linf=self.max_linf)
        count = min(self.seeds, len(split.images))
        seeds = ImageSet(np.asarray(split.images[0:count]), np.asarray(split.labels[:count]), f"{split.name}[:{count}]")
        result = run_boundary(self.original, OnnxClassifier(export_path, preprocessing=preprocessing, device=device),
                              seeds, BoundaryWalk(constraint=budget), max_queries=self.max_queries, progress=False)
        return count, realism_summary(result.records, count, budget)["realistic_triggers"]


def bounded_int8_static(module, preprocessing, calib_inputs, search: LabelledSplit, held_out: LabelledSplit,
                        bounds: Bounds, ranking: list[str], out_dir, graph=None, device=None, first=None,
                        progress: bool = True, realistic: RealisticProbe | None = None):
    """Search (on ``search``) and verify (on ``held_out``) the int8-static export with the fewest of
    ``ranking``'s layers in float that meets ``bounds``; returns ``(CompressionResult, BoundedSearch)``.

    Every candidate is a real ONNX Runtime export (:func:`~mlflow_di.compression.methods.compress`
    with ``keep_float``) run on the split; ``first``: the fully quantized export when the caller
    has made it already. With ``bounds.max_realistic_success_rate``, ``realistic`` says how each
    candidate is fuzzed. Raises :class:`UnreachableBounds` as :func:`search_float_layers` does.
    """
    import pathlib

    from mlflow_di.compression.methods import compress, float_export
    from mlflow_di.progress import progress_bar

    if bounds.max_realistic_success_rate is not None and realistic is None:
        raise UserError("--max-realistic-success-rate needs the original model to fuzz each candidate with")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    exports = {frozenset(): first} if first is not None else {}
    fp32 = []  # the float model, exported once for every candidate

    def export(kept: tuple):
        key = frozenset(kept)
        if key not in exports:
            if not fp32:
                fp32.append(float_export(module, preprocessing, out_dir / "fp32.onnx", graph=graph))
            exports[key] = compress(module, preprocessing, "int8-static", out_dir / f"candidate-{len(exports)}",
                                    calib_inputs=calib_inputs, keep_float=list(kept), exported=fp32[0])
        return exports[key]

    def measure_on(split: LabelledSplit):
        def measure(kept: tuple) -> Scores:
            path = export(kept).path
            measured = split.score(path, preprocessing, device)
            if bounds.max_realistic_success_rate is not None:
                measured.fuzzed, measured.realistic = realistic.count(path, split, preprocessing, device)
            return measured
        return measure

    with progress_bar(desc="bounded int8 search", unit="export", disable=not progress, leave=False) as bar:
        def on_trial(trial: Trial) -> None:
            bar.update(1)
            bar.set_postfix(kept=len(trial.kept_float), disagreements=trial.search.disagreements)

        record = search_float_layers(ranking, measure_on(search), bounds, on_trial)
    verify(record, measure_on(held_out))
    return export(tuple(record.kept_float)), record
