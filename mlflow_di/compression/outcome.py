"""What one compression method produced as ``mlflow-di compress`` makes it (:class:`Outcome`: the export,
its layer-wise diagnosis, blame, sensitivity, the bounded search, the fully quantized export it was compared
with), made by :func:`export_outcome` from what the command asks of it (a
:class:`~mlflow_di.compression.selection.Selection`).

Frozen values: each later step that learns more about an export (its execution context, the figures
measured on it) returns a new Outcome with ``dataclasses.replace``. Models and images in, values out; no MLflow.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow_di.compression.blame import Blame
    from mlflow_di.compression.bounded import BoundedSearch
    from mlflow_di.compression.methods import CompressionResult
    from mlflow_di.compression.quant_debug import LayerDiagnosis
    from mlflow_di.compression.sensitivity import Sensitivity
    from mlflow_di.compression.selection import Selection
    from mlflow_di.data import ImageSet
    from mlflow_di.models.benefit import Comparison
    from mlflow_di.models.execution import ExecutionContext
    from mlflow_di.models.torch_model import TorchModel


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


def export_outcome(source: TorchModel, method: str, calib: ImageSet | None, evaluation: ImageSet | None, amount: float,
                   scratch: pathlib.Path, selection: Selection) -> Outcome:
    """Compress ``source`` with ``method``; for a selective method also diagnose layer by layer, blame the
    triggers, split the sensitivity per layer and, when asked, export again with layers in float: the
    bounded search's choice, the named layers, or the diagnosis's worst. Raises
    :class:`~mlflow_di.compression.bounded.UnreachableBounds` when no export meets the bounds."""
    from mlflow_di.compression.declarations import method_declaration
    from mlflow_di.compression.methods import compress

    calib_images = calib.images if calib is not None else None
    settings = selection.settings_of(method)
    result = compress(source.module, source.preprocessing, method, scratch / "all", calib_inputs=calib_images,
                      amount=amount, graph=selection.graph, settings=settings)
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
        return _bounded(source, calib_images, scratch, selection, outcome, recipe=settings)
    if selection.selective:
        kept = list(selection.keep_float) or outcome.diagnoses[0].worst_layers(selection.auto_keep_float)
        kept_float = compress(source.module, source.preprocessing, method, scratch / "kept-float",
                              calib_inputs=calib_images, keep_float=kept, graph=selection.graph, settings=settings)
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
             outcome: Outcome, recipe) -> Outcome:
    """The bounded search from ``recipe`` (the fully quantized export's), ties in its measured ranking broken by
    the evaluation data's diagnosis (worst layer first): the chosen export becomes the result, the fully
    quantized one ``before``."""
    from mlflow_di.compression.bounded import BoundedTarget, RealisticProbe, bounded_int8_static, rank_layers
    from mlflow_di.compression.prune import prunable_layers

    ranking = rank_layers(outcome.diagnoses[0], [name for name, _ in prunable_layers(source.module)])
    search_split, held_out = selection.splits
    fully_quantized = outcome.result
    realistic = RealisticProbe(source, seeds=selection.fuzz_seeds) \
        if selection.bounds.max_realistic_success_rate is not None else None
    target = BoundedTarget(selection.bounds, search_split, held_out, tuple(ranking), selection.semantics, realistic)
    chosen, search = bounded_int8_static(source.module, source.preprocessing, calib_images, target, scratch / "bounded",
                                         graph=selection.graph, first=fully_quantized, recipe=recipe)
    outcome = dataclasses.replace(outcome, result=chosen, search=search)
    if search.kept_float or search.recipe != recipe.name:
        outcome = dataclasses.replace(outcome, before=fully_quantized, kept_float=tuple(search.kept_float))
    return outcome
