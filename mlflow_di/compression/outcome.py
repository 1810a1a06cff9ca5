"""One compression method's export as ``mlflow-di compress`` makes it: what a selective method
(int8-static) does beyond compressing everything (:class:`Selection`), the bounded search's held-out
images (:class:`HeldOut`), and what one method produced (:class:`Outcome`: the export, its layer-wise
diagnosis, blame, sensitivity, the bounded search, the fully quantized export it was compared with),
made by :func:`export_outcome`.

Frozen values: the command builds one Selection for every method, and each later step that learns
more about an export (its execution context, the figures measured on it) returns a new Outcome with
``dataclasses.replace``. Models and images in, values out; no MLflow.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING

from mlflow_di.models.runtimes import RuntimeChoice

if TYPE_CHECKING:
    import numpy as np

    from mlflow_di.compression.blame import Blame
    from mlflow_di.compression.bounded import BoundedSearch, Bounds, LabelledSplit
    from mlflow_di.compression.methods import CompressionResult
    from mlflow_di.compression.quant_debug import LayerDiagnosis
    from mlflow_di.compression.recipes import Recipe
    from mlflow_di.compression.sensitivity import Sensitivity
    from mlflow_di.data import ImageSet
    from mlflow_di.models.benefit import Comparison
    from mlflow_di.models.execution import ExecutionContext
    from mlflow_di.models.torch_model import TorchModel


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The bounded search's held-out images (prepared), the source's probabilities on them, and the
    :class:`~mlflow_di.compression.bounded.LabelledSplit` the search verifies its choice on."""

    images: ImageSet
    probabilities: np.ndarray
    split: LabelledSplit

    @classmethod
    def measure(cls, source: TorchModel, images: ImageSet, device) -> HeldOut:
        """``images`` (prepared) with the source's answers on them, measured on ``device``."""
        probabilities = source_probabilities(source, images, device)
        return cls(images, probabilities, labelled_split(images, probabilities))

    def require_provable(self, bounds: Bounds, fuzz_seeds: int) -> None:
        """A UserError when these images could not prove a bound even for an export that never differs from its
        source (the 95% interval of a perfect result reaches beyond the bound): said before any export is made."""
        import numpy as np

        from mlflow_di.errors import UserError

        images = len(self.split.labels)
        right = int(np.sum(np.asarray(self.split.original) == np.asarray(self.split.labels)))
        refused = bounds.unprovable(images, right, min(fuzz_seeds, images))
        if refused:
            raise UserError(f"the held-out data {self.images.name} is too small: " + "; ".join(refused)
                            + " (give a larger --holdout-data, or loosen the bound)")


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a selective method does beyond compressing everything, the same for every method of a command:
    layers kept in float (named, or the worst ``auto_keep_float`` by the diagnosis), the layer-wise
    diagnosis and its data, the bounded search and its data, the sensitivity split, the int8 recipe, and
    whether each export's benefit is measured."""

    keep_float: tuple[str, ...] = ()
    auto_keep_float: int = 0
    diagnosis_images: int = 256
    trigger_images: np.ndarray | None = None  # the --triggers campaign's triggers (uint8 NHWC), diagnosed and blamed
    triggers_folder: str | None = None  # that campaign's folder
    graph: str | None = None  # an ONNX original's file: quantization starts from it, not from its view
    bounds: Bounds | None = None  # search for the fewest float layers meeting them
    sensitivity: bool = False  # the per-layer sensitivity split (compression.sensitivity)
    fuzz_seeds: int = 50  # seeds per split fuzzed against each candidate for a realistic-success bound
    splits: tuple[LabelledSplit, LabelledSplit | None] | tuple[()] = ()  # (evaluation, held-out): search, sensitivity
    recipe: Recipe | None = None  # int8-static's recipe (None: the default)
    semantics: str = "host"  # which answers a bound judges: host, reference or both
    benefit: bool = True  # measure latency, size and memory of each export and its source
    held_out: HeldOut | None = None  # a bounded search's held-out data: the figures the gate judges
    runtimes: tuple[RuntimeChoice, ...] = ()  # what each export is scored on (empty: the default runtime alone)

    def scored_also_on(self, made_for: str | None) -> Selection:
        """This selection with the runtime a method's exports are made for after the runtimes asked for (as is
        when there is none, it is asked already, or it is not installed)."""
        if made_for is None:
            return self
        choice = RuntimeChoice.parse(made_for)
        asked = self.runtimes or (self.primary_runtime,)
        if choice.label in {c.label for c in asked} or choice.runtime.missing():
            return self
        return dataclasses.replace(self, runtimes=(*asked, choice))

    @property
    def primary_runtime(self) -> RuntimeChoice:
        """The runtime whose answers are the export's own figures (the first asked for)."""
        return self.runtimes[0] if self.runtimes else RuntimeChoice()

    @property
    def selective(self) -> bool:
        """Whether layers are kept in float by name or by the diagnosis (not by a bounded search)."""
        return bool(self.keep_float or self.auto_keep_float)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one method produced: the export to register (``result``), and for a selective method its
    diagnosis and the fully quantized export it was compared with (``before``, when layers were kept in
    float), then what was measured on it."""

    result: CompressionResult
    diagnoses: tuple[LayerDiagnosis, ...] = ()
    before: CompressionResult | None = None
    kept_float: tuple[str, ...] = ()
    auto: bool = False  # the layers kept in float are the diagnosis's worst (--auto-keep-float)
    notes: tuple[str, ...] = ()
    search: BoundedSearch | None = None  # the bounded search that chose the export
    sensitivity: Sensitivity | None = None
    blame: Blame | None = None  # blame per trigger of the --triggers campaign
    context: ExecutionContext | None = None  # where the export's figures were measured
    semantics_line: str = ""  # host vs reference semantics on the evaluation data, when they differ beyond noise
    portability: str = ""  # when the export's recipe answers differently on x86 CPUs without VNNI
    benefit: Comparison | None = None  # the export's latency, size and memory next to its source's

    def measured_with(self, context: ExecutionContext, benefit: Comparison | None = None) -> Outcome:
        """This outcome with the context its figures are measured in, what that context says of its int8
        recipe (whether it answers differently on x86 CPUs without VNNI), and its benefit."""
        from mlflow_di.compression.recipes import RECIPES, portability_note

        chosen = RECIPES.get(self.result.params.get("recipe"))  # an int8 recipe: does it saturate on this CPU?
        return dataclasses.replace(self, context=context, benefit=benefit,
                                   portability=portability_note(chosen, context.u8s8_saturates) if chosen else "")


def source_probabilities(source: TorchModel, images: ImageSet | None, device) -> np.ndarray | None:
    """The source model's probabilities on ``images`` (None without images), computed on ``device``."""
    from mlflow_di.models.device import resolve_device

    if images is None:
        return None
    try:  # the source goes back to the CPU afterwards: the next method exports and prunes it there
        return source.to(resolve_device(device)).classifier().predict_proba(images.images)
    finally:
        source.to("cpu")


def labelled_split(images: ImageSet, probabilities: np.ndarray) -> LabelledSplit:
    """A :class:`~mlflow_di.compression.bounded.LabelledSplit` of prepared images and the source's probabilities."""
    from mlflow_di.compression.bounded import LabelledSplit

    return LabelledSplit(images.name, images.images, images.labels, probabilities.argmax(axis=1))


def export_outcome(source: TorchModel, method: str, calib: ImageSet | None, evaluation: ImageSet | None, amount: float,
                   scratch: pathlib.Path, selection: Selection) -> Outcome:
    """Compress ``source`` with ``method``; for a selective method also diagnose layer by layer, blame the
    triggers, split the sensitivity per layer and, when asked, export again with layers in float: the
    bounded search's choice, the named layers, or the diagnosis's worst. Raises
    :class:`~mlflow_di.compression.bounded.UnreachableBounds` when no export meets the bounds."""
    from mlflow_di.compression.methods import compress, method_declaration

    calib_images = calib.images if calib is not None else None
    result = compress(source.module, source.preprocessing, method, scratch / "all", calib_inputs=calib_images,
                      amount=amount, graph=selection.graph, recipe=selection.recipe)
    outcome = Outcome(result)
    if not method_declaration(method).selective or not selection.diagnosis_images:
        return outcome
    outcome = _diagnosed(source, evaluation, selection, outcome)
    if selection.sensitivity:
        from mlflow_di.compression.prune import prunable_layers
        from mlflow_di.compression.sensitivity import sensitivity

        outcome = dataclasses.replace(outcome, sensitivity=sensitivity(
            source.module, source.preprocessing, calib_images, selection.splits[0],
            [name for name, _ in prunable_layers(source.module)], scratch / "sensitivity", graph=selection.graph,
            all_int8=result))
    if selection.bounds is not None:
        return _bounded(source, calib_images, scratch, selection, outcome)
    if selection.selective:
        kept = list(selection.keep_float) or outcome.diagnoses[0].worst_layers(selection.auto_keep_float)
        kept_float = compress(source.module, source.preprocessing, method, scratch / "kept-float",
                              calib_inputs=calib_images, keep_float=kept, graph=selection.graph, recipe=selection.recipe)
        outcome = dataclasses.replace(outcome, result=kept_float, before=result, kept_float=tuple(kept),
                                      auto=not selection.keep_float)
    return outcome


def _diagnosed(source: TorchModel, evaluation: ImageSet | None, selection: Selection, outcome: Outcome) -> Outcome:
    """The layer-wise diagnosis of the export on the evaluation data and on the campaign's triggers, and
    blame per trigger against the evaluation data's usual error (or a note that the campaign found none)."""
    from mlflow_di.compression.methods import calibration_inputs
    from mlflow_di.compression.quant_debug import diagnose

    result, preprocessing, limit = outcome.result, source.preprocessing, selection.diagnosis_images
    diagnoses, notes, blamed = [], [], None
    if evaluation is not None:
        diagnoses.append(diagnose(result.float_path, result.path, calibration_inputs(evaluation.images, preprocessing),
                                  "eval", limit))
    triggers = selection.trigger_images
    if triggers is not None and len(triggers):
        trigger_inputs = calibration_inputs(triggers, preprocessing)
        diagnoses.append(diagnose(result.float_path, result.path, trigger_inputs, "triggers", limit))
        if evaluation is not None:
            from mlflow_di.compression.blame import blame

            blamed = blame(result.float_path, result.path, calibration_inputs(evaluation.images, preprocessing),
                           trigger_inputs, max_images=limit)
    elif triggers is not None:
        notes.append("the fuzz campaign given with --triggers holds no triggers (no deviating input was found), so "
                     "there is no trigger diagnosis")
    return dataclasses.replace(outcome, diagnoses=tuple(diagnoses), notes=tuple(notes), blame=blamed)


def _bounded(source: TorchModel, calib_images, scratch: pathlib.Path, selection: Selection,
             outcome: Outcome) -> Outcome:
    """The bounded search (ties in its measured ranking broken by the evaluation data's diagnosis, worst
    layer first): the chosen export becomes the result, the fully quantized one ``before``."""
    from mlflow_di.compression.bounded import BoundedTarget, RealisticProbe, bounded_int8_static, rank_layers
    from mlflow_di.compression.prune import prunable_layers

    ranking = rank_layers(outcome.diagnoses[0], [name for name, _ in prunable_layers(source.module)])
    search_split, held_out = selection.splits
    fully_quantized = outcome.result
    realistic = RealisticProbe(source, seeds=selection.fuzz_seeds) \
        if selection.bounds.max_realistic_success_rate is not None else None
    target = BoundedTarget(selection.bounds, search_split, held_out, tuple(ranking), selection.semantics, realistic)
    chosen, search = bounded_int8_static(source.module, source.preprocessing, calib_images, target, scratch / "bounded",
                                         graph=selection.graph, first=fully_quantized, recipe=selection.recipe)
    outcome = dataclasses.replace(outcome, result=chosen, search=search)
    if search.kept_float or search.recipe != selection.recipe.name:
        outcome = dataclasses.replace(outcome, before=fully_quantized, kept_float=tuple(search.kept_float))
    return outcome
