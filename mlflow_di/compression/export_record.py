"""What is recorded of one export of ``mlflow-di compress``: its parameters (:func:`export_params`)
and every figure measured on it (:func:`export_metrics`: deviation from the source, reference
semantics, size, what it buys, the all-int8 export it was compared with, the bounded search and the
held-out figures the gate judges), with the fp32 source measured once for every export's benefit
(:class:`SourceBenefit`), and the source every method's run shares (:class:`CompressionSource`). Models
and values in, dictionaries out: the command logs them.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from mlflow_di.compression.bounded import BoundedSearch
    from mlflow_di.compression.declarations import MethodDeclaration
    from mlflow_di.compression.outcome import Outcome
    from mlflow_di.compression.selection import HeldOut, Selection
    from mlflow_di.data import ImageSet
    from mlflow_di.models.benefit import Comparison
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.models.reference import ModelRef
    from mlflow_di.models.torch_model import TorchModel

#: the figures measured again on a bounded export's held-out data (``held_out.NAME``, ``held_out.reference.NAME``):
#: the search chose the export on the evaluation data, so the gate judges these
HELD_OUT_FIGURES = ("source_accuracy", "compressed_accuracy", "accuracy_drop", "disagreements", "disagreement_rate",
                    "max_class_accuracy_drop", "eval_images")
#: ... with the 95% intervals of the judged ones (host and reference semantics alike)
_HELD_OUT_INTERVALS = tuple(f"{figure}_{end}" for figure in ("accuracy_drop", "disagreement_rate", "max_class_accuracy_drop")
                            for end in ("low", "high", "n"))


class SourceBenefit:
    """The fp32 source's side of every export's benefit: its ONNX export (in ``folder``) is made and
    measured by the first export that asks, once for every method of the command (tried again by the
    next export when it could not be measured)."""

    def __init__(self, source: TorchModel, folder: pathlib.Path, graph: str | None = None):
        self._source, self._path, self._graph = source, folder / "source-fp32.onnx", graph
        self._measured = None  # (the fp32 file, its models.benefit.Benefit)

    def compare(self, export_path) -> Comparison:
        """The export's :class:`~mlflow_di.models.benefit.Comparison` with the source; a UserError
        when either cannot be measured."""
        from mlflow_di.compression.methods import float_export
        from mlflow_di.models import benefit

        if self._measured is None:
            fp32 = float_export(self._source.module, self._source.preprocessing, self._path, graph=self._graph)
            self._measured = (fp32.path, benefit.measure(fp32.path))
        fp32_path, measured = self._measured
        return benefit.compare(fp32_path, export_path, source=measured)


@dataclasses.dataclass(frozen=True)
class CompressionSource:
    """The model every method of one command compresses, and what each method's run shares about it: its
    reference and registry tags, the lineage every export records, its probabilities on the evaluation data
    (None without), its side of the benefit, and the device the exports are scored on."""

    model: TorchModel
    ref: ModelRef
    tags: dict
    lineage: dict
    probabilities: np.ndarray | None
    benefit: SourceBenefit
    device: str = "cpu"


def export_params(declared: MethodDeclaration, amount: float, calib: ImageSet | None, outcome: Outcome,
                  selection: Selection) -> dict:
    """One export's parameters: pruning's amount; a selective method's calibration, float layers,
    diagnosis, bounds and semantics."""
    params = {"amount": amount} if declared.prunes else {}
    if declared.needs_calibration:
        params["calib_data"] = calib.name
    if not declared.selective:
        return params
    params.update(keep_float=",".join(outcome.kept_float),
                  auto_keep_float=selection.auto_keep_float, diagnosis_images=selection.diagnosis_images)
    if selection.triggers_folder:
        params["triggers"] = selection.triggers_folder
    if selection.bounds is not None:
        params.update({key: value for key, value in selection.bounds.to_dict().items() if value is not None},
                      holdout_data=selection.splits[1].name)
        if selection.bounds.max_realistic_success_rate is not None:
            params["fuzz_seeds"] = selection.fuzz_seeds
    params["semantics"] = selection.semantics
    return params


def export_metrics(method: str, name: str, original: np.ndarray | None, compressed: OnnxClassifier,
                   evaluation: ImageSet | None, outcome: Outcome, selection: Selection,
                   device) -> tuple[dict, dict | None, Outcome]:
    """(every metric of one export: deviation from the source, reference semantics for integer methods, size,
    ``outcome.benefit``, sparsity, the all-int8 export it was compared with, the bounded search and its
    held-out figures; the per-class deviation tables; ``outcome`` with the host vs reference semantics line).
    ``original``: the source's probabilities on ``evaluation``; ``compressed``: the export as a classifier."""
    from mlflow_di.compression.evaluation import compare_outputs, gzip_size, semantics_comparison
    from mlflow_di.compression.declarations import method_declaration
    from mlflow_di.models.classifier import OnnxClassifier

    result = outcome.result
    metrics, deviation = compare_outputs(original, compressed, evaluation)
    if method_declaration(method).integer and deviation is not None:
        reference, semantics_line = semantics_comparison(original, result.path, evaluation, deviation, device,
                                                         outcome.context)
        metrics.update(reference)
        outcome = dataclasses.replace(outcome, semantics_line=semantics_line)
    metrics.update(source_size_bytes=result.source_size_bytes, compressed_size_bytes=result.size_bytes,
                   compressed_gzip_bytes=gzip_size(result.path))
    if outcome.benefit is not None:
        metrics.update(outcome.benefit.metrics())
    if result.sparsity is not None:
        metrics["sparsity"] = result.sparsity
    if outcome.before is not None:
        before = OnnxClassifier(outcome.before.path, name=f"{name} ({method}, all layers)", device=device)
        before_metrics, _ = compare_outputs(original, before, evaluation)
        before_metrics["compressed_size_bytes"] = outcome.before.size_bytes
        metrics.update({f"before_keep_float.{key}": value for key, value in before_metrics.items()
                        if key not in ("source_accuracy", "eval_images") and not key.startswith("class_accuracy_drop.")})
        metrics["kept_float_layers"] = len(outcome.kept_float)
    if outcome.search is not None:
        metrics.update(_search_metrics(outcome.search))
        if selection.held_out is not None:
            metrics.update(_held_out_metrics(selection.held_out, compressed, method, result.path, device))
    return metrics, deviation, outcome


@dataclasses.dataclass(frozen=True)
class OtherRuntimes:
    """An export's figures on the runtimes asked for after the first (``compress --runtime A,B``): metrics
    ``runtime.SLUG.NAME`` (and ``held_out.runtime.SLUG.NAME`` beside a bounded export's held-out figures),
    each runtime's :class:`~mlflow_di.models.execution.ExecutionContext` as ``mlflow_di.runtimes.SLUG.*`` tags,
    and ``mlflow_di.runtimes``: every runtime the export was judged on, the first one's figures its own."""

    metrics: dict
    tags: dict
    contexts: dict  # RuntimeChoice -> ExecutionContext
    primary: str  # the first runtime's label


#: the figures measured again on every other runtime (the gate's compress checks and their intervals)
RUNTIME_FIGURES = ("compressed_accuracy", "accuracy_drop", "disagreements", "disagreement_rate",
                   "max_class_accuracy_drop", "eval_images", *_HELD_OUT_INTERVALS)


def other_runtimes(selection: Selection, compressed, original, evaluation, device) -> OtherRuntimes:
    """The export (``compressed``, as the first runtime runs it) scored on every other runtime of ``selection``
    against the source's probabilities ``original`` on ``evaluation`` and on the held-out data, with the images
    on which that runtime's top-1 differs from the first one's (``runtime.SLUG.top1_differs_from_first``)."""
    import numpy as np

    from mlflow_di.compression.evaluation import compare_outputs, compare_probabilities

    primary = selection.primary_runtime
    metrics, tags, contexts = {}, {"mlflow_di.runtimes": ",".join(c.label for c in selection.runtimes or (primary,))}, {}
    first = compressed.predict_proba(evaluation.images) if evaluation is not None and selection.runtimes[1:] else None
    for choice in selection.runtimes[1:]:
        other = choice.open(compressed.path, compressed.preprocessing, f"{compressed.name} on {choice.label}", device)
        prefix = f"runtime.{choice.slug}."
        if first is not None:  # each runtime classifies the evaluation images once
            answers = other.predict_proba(evaluation.images)
            figures, _ = compare_probabilities(original, answers, evaluation)
            metrics.update({prefix + key: figures[key] for key in RUNTIME_FIGURES if key in figures})
            metrics[prefix + "top1_differs_from_first"] = int(np.sum(answers.argmax(1) != first.argmax(1)))
            metrics[prefix + "max_probability_difference"] = float(np.max(np.abs(answers - first)))
        if selection.held_out is not None:
            figures, _ = compare_outputs(selection.held_out.probabilities, other, selection.held_out.images)
            metrics.update({f"held_out.{prefix}{key}": figures[key] for key in RUNTIME_FIGURES if key in figures})
        contexts[choice] = other.execution_context
        tags.update(other.execution_context.tags(f"mlflow_di.runtimes.{choice.slug}."))
    return OtherRuntimes(metrics, tags, contexts, primary.label)


def _held_out_metrics(held_out: HeldOut, compressed: OnnxClassifier, method: str, path, device) -> dict:
    """The export's deviation figures on the held-out data, host semantics and (integer methods) reference semantics."""
    from mlflow_di.compression.evaluation import compare_outputs
    from mlflow_di.compression.declarations import method_declaration
    from mlflow_di.models.classifier import OnnxClassifier

    figures, _ = compare_outputs(held_out.probabilities, compressed, held_out.images)
    metrics = {f"held_out.{key}": figures[key] for key in (*HELD_OUT_FIGURES, *_HELD_OUT_INTERVALS) if key in figures}
    if method_declaration(method).integer:
        reference = OnnxClassifier(path, name="reference semantics", device=device, semantics="reference")
        figures, _ = compare_outputs(held_out.probabilities, reference, held_out.images)
        metrics.update({f"held_out.reference.{key}": figures[key] for key in (*HELD_OUT_FIGURES[2:6], *_HELD_OUT_INTERVALS)
                        if key in figures})
    return metrics


def _search_metrics(search: BoundedSearch) -> dict:
    """The bounded search's cost and its choice's held-out figures."""
    held_out = search.held_out
    return {"bounded.exports": search.exports, "bounded.kept_float_layers": len(search.kept_float),
            "bounded.held_out_images": held_out.images, "bounded.held_out_disagreements": held_out.disagreements,
            "bounded.held_out_disagreement_rate": held_out.disagreement_rate,
            "bounded.held_out_disagreement_upper95": held_out.disagreement_upper_bound(),
            "bounded.held_out_accuracy_drop": held_out.accuracy_drop,
            "bounded.meets_held_out": int(not search.held_out_failures),
            **({"bounded.held_out_realistic_success_rate": held_out.realistic_success_rate,
                "bounded.held_out_fuzzed_seeds": held_out.fuzzed} if held_out.fuzzed else {})}
