"""A bounded int8 export: the fewest layers left in float for which an int8-static export meets its bounds.

OpenVINO NNCF's ``quantize_with_accuracy_control(max_drop=...)`` ranks layers by their measured
effect and reverts the worst to float until an accuracy drop is met. Accuracy can stay flat while
answers flip, so here a bound can also be on the top-1 *disagreement* with the original
(:class:`Bounds`). The search (:func:`search_float_layers`) measures every candidate export on a
search split of labelled images and never declares a bound unreachable without having measured it:

1. every layer quantized, with each recipe in turn (the caller's first, then the recipes that
   cannot saturate, :func:`~mlflow_di.compression.recipes.alternatives`): the first that meets every
   bound is the answer, with nothing in float. Otherwise the recipe that came closest is kept
   (with those that came exactly as close, for step 2);
2. the layers are ranked by their measured effect: one export per layer with that layer alone in
   float (per recipe kept). If one of them meets the bounds, the best such export is the answer;
3. the upper end: every layer but the least helpful in float; if that misses, every other
   "only this layer quantized" export is measured before :class:`UnreachableBounds` names what
   was tried;
4. bisection on how many of the ranked layers stay in float finds the shortest meeting prefix
   (assuming more layers in float do not hurt: where that is false the result is larger than
   needed, never wrong, since every candidate is measured);
5. backward elimination: each kept layer, least helpful first, goes back to int8 if the export
   still meets every bound without it.

The chosen export is then measured once on a held-out split it was not chosen on
(:func:`verify`), because a rate near its bound on a few thousand images is mostly noise: a bound
counts as met there only when the figure's whole 95% interval is within it (Clopper-Pearson for the
rates, Newcombe's paired interval for the accuracy drop: :mod:`mlflow_di.intervals`), as the gate
judges it. Held-out data too small to prove a bound even with no disagreement at all is refused
before any export is made (:meth:`Bounds.unprovable`).

Pure search over a ``measure(kept_float, recipe) -> Scores`` function; :func:`bounded_int8_static`
wires it to :func:`~mlflow_di.compression.methods.compress` and ONNX Runtime.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.gate import CHECKS, Thresholds
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
    #: the paired table's discordant images: the original right and the export wrong, and the reverse (None: not
    #: counted, a record written before they were)
    right_to_wrong: int | None = None
    wrong_to_right: int | None = None

    JSON_OPTIONAL = {"right_to_wrong": None, "wrong_to_right": None}

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

    def interval(self, metric: str):
        """The two-sided 95% interval of ``metric`` (one of :data:`BOUNDED_CHECKS`) as the gate judges it
        (:mod:`mlflow_di.intervals`); None for an accuracy drop whose discordant images were not counted."""
        from mlflow_di.intervals import clopper_pearson, paired_difference

        if metric == "disagreement_rate":
            return clopper_pearson(self.disagreements, self.images)
        if metric == "realistic_success_rate":
            return clopper_pearson(self.realistic, self.fuzzed)
        if self.right_to_wrong is None or self.wrong_to_right is None:
            return None
        both = self.original_correct - self.right_to_wrong
        neither = self.images - both - self.right_to_wrong - self.wrong_to_right
        return paired_difference(both, self.right_to_wrong, self.wrong_to_right, neither)

    def describe(self, upper_bound: bool = False) -> str:
        """One line; ``upper_bound`` adds the disagreement rate's 95% upper bound."""
        upper = f"; 95% upper bound {self.disagreement_upper_bound():.2%}" if upper_bound else ""
        drop = round(self.accuracy_drop * 100, 2)
        accuracy = ("accuracy unchanged" if drop == 0 else
                    f"accuracy {abs(drop):.2f} points {'lower' if drop > 0 else 'higher'} than the model's")
        text = (f"top-1 differs on {self.disagreements} of {self.images} images ({self.disagreement_rate:.2%}{upper}), "
                f"{accuracy}")
        if self.fuzzed:
            text += f", realistic triggers on {self.realistic} of {self.fuzzed} fuzzed seeds"
        return text


def scores(original_labels, compressed_labels, labels) -> Scores:
    """:class:`Scores` from the two models' top-1 labels and the true labels of one split."""
    original, compressed, labels = (np.asarray(a) for a in (original_labels, compressed_labels, labels))
    right_o, right_c = original == labels, compressed == labels
    return Scores(len(labels), int(np.sum(original != compressed)), int(np.sum(right_o)), int(np.sum(right_c)),
                  right_to_wrong=int(np.sum(right_o & ~right_c)), wrong_to_right=int(np.sum(~right_o & right_c)))


def clopper_pearson_upper(successes: int, trials: int, confidence: float = CONFIDENCE) -> float:
    """The exact one-sided upper confidence bound of a binomial rate (1.0 with no trials)."""
    from scipy.stats import beta

    if trials == 0 or successes >= trials:
        return 1.0
    return float(beta.ppf(confidence, successes + 1, trials - successes))


#: The gate checks an export can be bounded by: each bound is that check's threshold (its record in
#: :data:`mlflow_di.gate.CHECKS` gives the option, the direction and the range), so the export the bounded
#: search registers is judged by the gate the way the search judged it.
BOUNDED_CHECKS = ("accuracy_drop", "disagreement_rate", "realistic_success_rate")


@dataclasses.dataclass(frozen=True)
class Bounds(JsonRoundTrip):
    """What an export must meet; None leaves a bound out. Each field is the threshold of one of
    :data:`BOUNDED_CHECKS` (fractions: 0.01 = 1 point / 1%), checked against that check's record."""

    max_accuracy_drop: float | None = None
    max_disagreement_rate: float | None = None
    #: of seeds fuzzed with the realism strategy, those with a trigger inside the realism budget
    max_realistic_success_rate: float | None = None

    def __post_init__(self):
        Thresholds(**dataclasses.asdict(self))  # the gate's ranges, the gate's one-line refusals

    def _given(self):
        """(check record, bound) of every bound given, in :data:`BOUNDED_CHECKS`' order."""
        for metric in BOUNDED_CHECKS:
            check = CHECKS[metric]
            bound = getattr(self, check.threshold_name)
            if bound is not None:
                yield check, bound

    @property
    def active(self) -> bool:
        return any(True for _ in self._given())

    def failures(self, measured: Scores) -> list[str]:
        """One phrase per bound ``measured`` misses (empty when it meets them all)."""
        missed = []
        for check, bound in self._given():
            value = getattr(measured, check.metric)
            if value < bound if check.greater_is_better else value > bound:
                worse = "<" if check.greater_is_better else ">"
                missed.append(f"{check.metric.replace('_', ' ')} {value:.2%}{_counts(check.metric, measured)} {worse} "
                              f"{check.option} {bound:g}")
        return missed

    def met_by(self, measured: Scores) -> bool:
        return not self.failures(measured)

    def unproven(self, measured: Scores) -> list[str]:
        """One phrase per bound ``measured`` meets but whose 95% interval reaches beyond it: the data cannot
        show the export meets it (held-out figures count as met only when proven, as the gate judges them)."""
        missed = []
        for check, bound in self._given():
            value, interval = getattr(measured, check.metric), measured.interval(check.metric)
            beyond = value < bound if check.greater_is_better else value > bound
            if interval is None or beyond or interval.high <= bound:
                continue
            missed.append(f"{check.metric.replace('_', ' ')} {value:.2%}{_counts(check.metric, measured)} is within "
                          f"{check.option} {bound:g} but its 95% interval reaches {interval.high:.2%} "
                          f"({interval.method}): not proven")
        return missed

    def unprovable(self, images: int, source_correct: int, fuzz_seeds: int) -> list[str]:
        """One phrase per bound that held-out data of ``images`` images (the source right on ``source_correct``)
        and ``fuzz_seeds`` fuzzed seeds could not prove even if the export never differed: the 95% interval of
        a perfect result still reaches beyond the bound. Says how many images (seeds) would be enough."""
        from mlflow_di.intervals import clopper_pearson, paired_difference

        def perfect(metric: str, size: int):
            if metric == "disagreement_rate":
                return clopper_pearson(0, size)
            if metric == "realistic_success_rate":
                return clopper_pearson(0, size)
            right = round(source_correct * size / images) if images else 0
            return paired_difference(right, 0, 0, size - right)

        refused = []
        for check, bound in self._given():
            size = fuzz_seeds if check.metric == "realistic_success_rate" else images
            best = perfect(check.metric, size).high
            if best <= bound:
                continue
            unit = "fuzzed seeds" if check.metric == "realistic_success_rate" else "held-out images"
            needed = _smallest(lambda n, metric=check.metric: perfect(metric, n).high <= bound, size)
            enough = (f"about {needed:,} {unit} would be needed" if needed is not None else
                      "no amount of data proves a bound of 0 (an interval never closes on it): allow a small rate")
            refused.append(f"{check.option} {bound:g} cannot be proven on {size} {unit}: even with no "
                           f"{'realistic trigger' if unit == 'fuzzed seeds' else 'difference'} its 95% interval "
                           f"reaches {best:.3g}; {enough}")
        return refused

    def describe(self) -> str:
        return " and ".join(f"{check.metric.replace('_', ' ')} {check.comparison} {bound:g}"
                            for check, bound in self._given()) or "no bound"


def _smallest(enough: Callable[[int], bool], start: int) -> int | None:
    """The smallest n >= ``start`` for which ``enough(n)`` holds (it holds for every larger n): doubling, then
    bisection; None when no n up to 10^9 does."""
    low, high = start, max(2 * start, 1)
    while not enough(high):
        if high >= 10**9:
            return None
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high


def _counts(metric: str, measured: Scores) -> str:
    """What a rate in a bound's phrase counts: `` (3 of 250)`` images, `` (3 of 20 seeds)`` fuzzed."""
    if metric == "disagreement_rate":
        return f" ({measured.disagreements} of {measured.images})"
    if metric == "realistic_success_rate":
        return f" ({measured.realistic} of {measured.fuzzed} seeds)"
    return ""


@dataclasses.dataclass
class Trial(JsonRoundTrip):
    """One candidate export measured on the search split: which layers stayed in float, the recipe, and
    why it was tried ("all int8", "one in float", "all but one", "bisection" or "elimination")."""

    kept_float: list[str]
    step: str
    search: Scores
    meets: bool
    recipe: str | None = None

    JSON_OPTIONAL = {"recipe": None}


@dataclasses.dataclass
class BoundedSearch(JsonRoundTrip):
    """The search's record: the bounds, the ranking it walked, every export it measured and its choice."""

    bounds: Bounds
    ranking: list[str]
    trials: list[Trial]
    kept_float: list[str]
    held_out: Scores | None = None
    recipe: str | None = None  # the chosen export's recipe

    JSON_DUMPS = {"indent": 2}
    JSON_OPTIONAL = {"recipe": None}

    @property
    def exports(self) -> int:
        """Exports made and measured (the search's cost, in units of one plain int8 export)."""
        return len(self.trials)

    @property
    def chosen(self) -> Trial:
        return next(t for t in self.trials if self._is_chosen(t))

    def _is_chosen(self, trial: Trial) -> bool:
        return sorted(trial.kept_float) == sorted(self.kept_float) and trial.recipe == self.recipe

    @property
    def held_out_failures(self) -> list[str]:
        """The bounds the chosen export misses on the held-out data, or meets there without proof (its 95%
        interval reaches beyond the bound)."""
        if self.held_out is None:
            return []
        return self.bounds.failures(self.held_out) + self.bounds.unproven(self.held_out)

    @property
    def recipes_tried(self) -> list[str]:
        return list(dict.fromkeys(t.recipe for t in self.trials if t.recipe is not None))

    def rows(self) -> list[dict]:
        """One table row per measured export, in the order they were made."""
        return [{"kept in float": ", ".join(t.kept_float) or "(none)", "step": t.step,
                 **({"recipe": t.recipe} if t.recipe is not None else {}),
                 "disagreements": t.search.disagreements, "disagreement rate": f"{t.search.disagreement_rate:.3%}",
                 "accuracy drop": f"{t.search.accuracy_drop * 100:+.2f} pts",
                 **({"realistic triggers": f"{t.search.realistic}/{t.search.fuzzed}"} if t.search.fuzzed else {}),
                 "meets": "yes" if t.meets else "no",
                 "chosen": "<-" if self._is_chosen(t) else ""} for t in self.trials]


class UnreachableBounds(UserError):
    """No export with at least one quantized layer meets the bounds; ``search`` holds what was measured."""

    def __init__(self, message: str, search: BoundedSearch):
        super().__init__(message)
        self.search = search


def _shortfall(bounds: Bounds, measured: Scores) -> tuple:
    """How far ``measured`` is from meeting ``bounds`` (smaller is closer): the summed relative excess over
    each missed bound, then the disagreements and accuracy drop as tie-breaks."""
    excess = 0.0
    for limit, value in ((bounds.max_accuracy_drop, measured.accuracy_drop),
                         (bounds.max_disagreement_rate, measured.disagreement_rate),
                         (bounds.max_realistic_success_rate, measured.realistic_success_rate)):
        if limit is not None and value > limit:
            excess += (value - limit) / max(limit, 1 / max(measured.images, 1))
    return excess, measured.disagreements, measured.accuracy_drop


def _ranked(bounds: Bounds, layers: list[str], singles: dict, recipe) -> list[str]:
    """``layers``, most helpful first: by how close each one alone in float (with ``recipe``) comes to the bounds."""
    return sorted(layers, key=lambda layer: _shortfall(bounds, singles[layer, recipe].search))


def search_float_layers(layers: list[str], measure: Callable, bounds: Bounds, recipes=(None,),
                        on_trial: Callable[[Trial], None] | None = None) -> BoundedSearch:
    """The fewest of ``layers`` to keep in float (and the recipe) so that ``measure`` meets ``bounds``.

    ``measure(kept_float, recipe)`` exports with those layers in float using ``recipe`` (one of
    ``recipes``, tried in order; None: the caller's only recipe) and scores the export on the search
    split; each (recipe, set) is measured once. ``layers``' order breaks ties in the measured
    ranking. ``on_trial`` is told of every measurement (progress). Raises :class:`UnreachableBounds`
    when no export with at least one layer quantized was found to meet them, naming what was measured.
    """
    if not bounds.active:
        raise UserError("a bounded export needs a bound: pass --max-accuracy-drop, --max-disagreement-rate or "
                        "--max-realistic-success-rate")
    search = _Search(list(dict.fromkeys(layers)), measure, bounds, list(dict.fromkeys(recipes)) or [None], on_trial)
    for recipe in search.recipes:
        if search.trial((), recipe, "all int8").meets:
            return search.record((), recipe)
    tied = search.closest_recipes()
    recipe = tied[0]
    if len(search.layers) < 2:
        raise UnreachableBounds(f"the fully quantized export{search.recipe_text()} misses {bounds.describe()} "
                                f"({'; '.join(bounds.failures(search.closest(search.trials).search))}) and the model "
                                f"has {len(search.layers)} quantizable layer, so none can stay in float",
                                search.record((), recipe))
    singles = {(layer, each): search.trial((layer,), each, "one in float") for each in tied for layer in search.layers}
    meeting = [t for t in singles.values() if t.meets]
    if meeting:
        chosen = search.closest(meeting)
        return search.record(chosen.kept_float, chosen.recipe, _ranked(bounds, search.layers, singles, chosen.recipe))
    ranking = _ranked(bounds, search.layers, singles, recipe)
    upper = search.all_but_one(ranking, recipe)
    ranking = [name for name in ranking if name != upper] + [upper]
    return search.bisect_then_eliminate(ranking, recipe)


class _Search:
    """The state of one :func:`search_float_layers`: every (recipe, layers kept in float) measured once, in order."""

    def __init__(self, layers: list[str], measure: Callable, bounds: Bounds, recipes: list, on_trial):
        self.layers, self.measure, self.bounds, self.recipes, self.on_trial = layers, measure, bounds, recipes, on_trial
        self.trials: list[Trial] = []
        self.measured: dict[tuple, Trial] = {}

    def trial(self, kept, recipe, step: str) -> Trial:
        key = (recipe, frozenset(kept))
        if key not in self.measured:
            result = self.measure(tuple(kept), recipe)
            self.measured[key] = Trial(list(kept), step, result, self.bounds.met_by(result), recipe)
            self.trials.append(self.measured[key])
            if self.on_trial is not None:
                self.on_trial(self.measured[key])
        return self.measured[key]

    def record(self, kept, recipe, ranking=None) -> BoundedSearch:
        return BoundedSearch(self.bounds, list(self.layers if ranking is None else ranking), self.trials, list(kept),
                             recipe=recipe)

    def closest(self, candidates: list[Trial]) -> Trial:
        return min(candidates, key=lambda t: _shortfall(self.bounds, t.search))

    def recipe_text(self) -> str:
        named = [r for r in self.recipes if r is not None]
        return f" with recipe {', '.join(named)}" if len(named) == 1 else \
            f" with each recipe ({', '.join(named)})" if named else ""

    def closest_recipes(self) -> list:
        """The recipes whose all-int8 export is equally far over the bounds as the closest one, nearest first."""
        best = _shortfall(self.bounds, self.closest(self.trials).search)[0]
        tied = [t.recipe for t in self.trials if _shortfall(self.bounds, t.search)[0] == best]  # searched alike
        tied.sort(key=lambda name: _shortfall(self.bounds, self.measured[name, frozenset()].search))
        return tied

    def all_but_one(self, ranking: list[str], recipe) -> str:
        """The least helpful layer whose export with every other layer in float meets the bounds (it can be
        int8); :class:`UnreachableBounds` when none does."""
        for last in reversed(ranking):  # the least helpful layer first: the one most likely to be harmless in int8
            if self.trial([name for name in ranking if name != last], recipe, "all but one").meets:
                return last
        best = self.closest([t for t in self.trials if len(t.kept_float) == len(self.layers) - 1])
        quantized = next(name for name in self.layers if name not in best.kept_float)
        raise UnreachableBounds(
            f"no int8 export meets {self.bounds.describe()}: measured every layer quantized{self.recipe_text()}, then"
            f"{f' with recipe {recipe}' if recipe else ''} each layer alone in float and each layer alone quantized; "
            f"the closest (only {quantized} quantized"
            f"{f', recipe {best.recipe}' if best.recipe else ''}) has {'; '.join(self.bounds.failures(best.search))} on "
            "the search data; loosen the bound "
            "or use another method", self.record(best.kept_float, recipe, ranking))

    def bisect_then_eliminate(self, ranking: list[str], recipe) -> BoundedSearch:
        """The shortest prefix of ``ranking`` kept in float that meets the bounds (bisection between one layer,
        which misses, and all but the last, which meets), then each of its layers dropped where the bounds hold."""
        low, high = 1, len(ranking) - 1  # prefix lengths: low misses (one layer in float is not enough), high meets
        while high - low > 1:
            middle = (low + high) // 2
            if self.trial(ranking[:middle], recipe, "bisection").meets:
                high = middle
            else:
                low = middle
        kept = list(ranking[:high])
        for layer in reversed(kept[:]):  # least helpful first
            candidate = [name for name in kept if name != layer]
            if self.trial(candidate, recipe, "elimination").meets:
                kept = candidate
        return self.record(kept, recipe, ranking)


def rank_layers(diagnosis, layers: list[str]) -> list[str]:
    """The layers in the diagnosis's order (a :class:`~mlflow_di.compression.quant_debug.LayerDiagnosis`,
    worst score first), then ``layers`` it never reached: how the search breaks ties in its measured ranking."""
    scored = list(diagnosis.layer_scores())
    return scored + [name for name in layers if name not in scored]


def verify(search: BoundedSearch, measure_held_out: Callable) -> BoundedSearch:
    """Measure the chosen export (``measure_held_out(kept_float, recipe)``) on the held-out split; the
    figures land in ``search.held_out``."""
    search.held_out = measure_held_out(tuple(search.kept_float), search.recipe)
    return search


@dataclasses.dataclass
class LabelledSplit:
    """One split of labelled images: ``images`` as a classifier's ``predict`` takes them (raw uint8, an
    array or lazy), their true ``labels`` and the original model's top-1 labels (``original``)."""

    name: str
    images: object
    labels: np.ndarray
    original: np.ndarray

    def score(self, export_path, preprocessing=None, device=None, semantics: str = "host") -> Scores:
        """The :class:`Scores` of the ONNX model at ``export_path`` (run by ONNX Runtime) on this split.

        ``semantics``: ``host`` (this CPU's kernels), ``reference`` (the QDQ graph as written) or
        ``both``: the worse of the two, image by image (an image counts as a disagreement, or as
        wrong, when it is one under either)."""
        from mlflow_di.models.classifier import OnnxClassifier

        if semantics == "both":
            host, reference = (OnnxClassifier(export_path, preprocessing=preprocessing, device=device,
                                              semantics=which).predict(self.images) for which in ("host", "reference"))
            original, labels = np.asarray(self.original), np.asarray(self.labels)
            differs = (host != original) | (reference != original)
            right, right_o = (host == labels) & (reference == labels), original == labels
            return Scores(len(labels), int(differs.sum()), int(np.sum(right_o)), int(right.sum()),
                          right_to_wrong=int(np.sum(right_o & ~right)), wrong_to_right=int(np.sum(~right_o & right)))
        predicted = OnnxClassifier(export_path, preprocessing=preprocessing, device=device,
                                   semantics=semantics).predict(self.images)
        return scores(self.original, predicted, self.labels)


@dataclasses.dataclass
class RealisticProbe:
    """How a candidate's realistic deviation is measured for ``--max-realistic-success-rate``: the
    declared realism strategy (:data:`~mlflow_di.fuzz.strategies.REALISM`, the boundary walk), run through
    :func:`mlflow_di.fuzz.run` from the PyTorch ``original`` against the candidate export, inside ``budget``,
    at most ``max_queries`` to the export per seed, on the first ``seeds`` images of each split.

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
        from mlflow_di.fuzz import strategies
        from mlflow_di.fuzz.contract import Campaign
        from mlflow_di.fuzz.realism import realism_summary
        from mlflow_di.fuzz.runners import run
        from mlflow_di.models.classifier import OnnxClassifier

        declared = strategies.declaration(strategies.REALISM)  # the realism search, through its declaration
        search = strategies.configure(declared, {"max_linf": self.max_linf})
        count = min(self.seeds, len(split.images))
        seeds = ImageSet(np.asarray(split.images[0:count]), np.asarray(split.labels[:count]), f"{split.name}[:{count}]")
        export = OnnxClassifier(export_path, preprocessing=preprocessing, device=device)
        [result] = run(Campaign(self.original, [export], search, seeds, max_queries=self.max_queries, progress=False),
                       declared)
        return count, realism_summary(result.records, count, search.constraint)["realistic_triggers"]


@dataclasses.dataclass(frozen=True)
class BoundedTarget:
    """What a bounded export must meet and where it is measured: ``bounds``, searched for on ``search`` and
    verified on ``held_out``, with ``ranking``'s layers (the order that breaks ties between equally helpful
    ones) the candidates for float. ``semantics``: whose answers the bounds judge (``host``, ``reference`` or
    ``both``, see :meth:`LabelledSplit.score`); ``realistic``: how each candidate is fuzzed for
    ``bounds.max_realistic_success_rate``."""

    bounds: Bounds
    search: LabelledSplit
    held_out: LabelledSplit
    ranking: tuple[str, ...]
    semantics: str = "host"
    realistic: RealisticProbe | None = None


def bounded_int8_static(module, preprocessing, calib_inputs, target: BoundedTarget, out_dir, graph=None, device=None,
                        first=None, progress: bool = True, recipe=None):
    """Search (on ``target.search``) and verify (on ``target.held_out``) the int8-static export with the fewest
    of ``target.ranking``'s layers in float that meets ``target.bounds``; returns ``(CompressionResult,
    BoundedSearch)``.

    Every candidate is a real ONNX Runtime export (:func:`~mlflow_di.compression.methods.compress`
    with ``keep_float``) run on the split with ``target.semantics``. ``recipe``: the
    :class:`~mlflow_di.compression.recipes.Recipe` tried first (None: the default); the recipes that cannot
    saturate come next (and, searching with host semantics on a CPU whose int8 kernels do not saturate, those
    that would elsewhere). ``first``: the fully quantized export with ``recipe`` when the caller has made it
    already. Raises :class:`UnreachableBounds` as :func:`search_float_layers` does.
    """
    import pathlib

    from mlflow_di.compression.methods import compress, float_export
    from mlflow_di.compression.recipes import alternatives, recipe as named_recipe
    from mlflow_di.models.execution import execution_context
    from mlflow_di.progress import progress_bar

    bounds, semantics, realistic = target.bounds, target.semantics, target.realistic
    if bounds.max_realistic_success_rate is not None and realistic is None:
        raise UserError("--max-realistic-success-rate needs the original model to fuzz each candidate with")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    first_recipe = recipe or named_recipe()
    saturates = execution_context().u8s8_saturates if semantics == "host" else True  # reference: portable only
    recipes = {candidate.name: candidate for candidate in [first_recipe, *alternatives(first_recipe, saturates)]}
    exports = {(first_recipe.name, frozenset()): first} if first is not None else {}
    fp32 = []  # the float model, exported once for every candidate

    def export(kept: tuple, recipe_name: str):
        key = (recipe_name, frozenset(kept))
        if key not in exports:
            if not fp32:
                fp32.append(float_export(module, preprocessing, out_dir / "fp32.onnx", graph=graph))
            exports[key] = compress(module, preprocessing, "int8-static", out_dir / f"candidate-{len(exports)}",
                                    calib_inputs=calib_inputs, keep_float=list(kept), exported=fp32[0],
                                    settings=recipes[recipe_name])
        return exports[key]

    def measure_on(split: LabelledSplit):
        def measure(kept: tuple, recipe_name: str) -> Scores:
            path = export(kept, recipe_name).path
            measured = split.score(path, preprocessing, device, semantics)
            if bounds.max_realistic_success_rate is not None:
                measured.fuzzed, measured.realistic = realistic.count(path, split, preprocessing, device)
            return measured
        return measure

    with progress_bar(desc="bounded int8 search", unit="export", disable=not progress, leave=False) as bar:
        def on_trial(trial: Trial) -> None:
            bar.update(1)
            bar.set_postfix(kept=len(trial.kept_float), disagreements=trial.search.disagreements)

        record = search_float_layers(list(target.ranking), measure_on(target.search), bounds, list(recipes), on_trial)
    verify(record, measure_on(target.held_out))
    return export(tuple(record.kept_float), record.recipe), record
