"""How an export answers next to its source: accuracy, top-1 agreement, output deviation and the
per-class deviation on evaluation data (:func:`compare_outputs`); the same export under reference
semantics next to the host's, with a test of whether they differ beyond noise
(:func:`semantics_comparison`); the gzipped size, where pruning pays off (:func:`gzip_size`).
Arrays and files in, figures out: ``mlflow-di compress`` logs and prints them.
"""
from __future__ import annotations

import gzip
import pathlib


def compare_outputs(source_probabilities, compressed, evaluation) -> tuple[dict, dict | None]:
    """Accuracy of source and export on ``evaluation``, how their outputs deviate (top-1
    disagreement rate, flips either way, KL divergence, margins: :func:`~mlflow_di.deviation.output_deviation`),
    and the per-class deviation (``{"matrix": ..., "classes": [ClassAccuracy]}``, None without evaluation data)."""
    if evaluation is None:
        return {}, None
    return compare_probabilities(source_probabilities, compressed.predict_proba(evaluation.images), evaluation)


def compare_probabilities(source_probabilities, compressed_probabilities, evaluation) -> tuple[dict, dict]:
    """:func:`compare_outputs` for the export's probabilities on ``evaluation``, computed already."""
    import numpy as np

    from mlflow_di.deviation import (deviation_intervals, deviation_matrix, largest_class_drop, output_deviation,
                                     per_class_accuracy)

    original, exported = source_probabilities.argmax(axis=1), compressed_probabilities.argmax(axis=1)
    source_accuracy = float(np.mean(original == evaluation.labels))
    compressed_accuracy = float(np.mean(exported == evaluation.labels))
    metrics = {"source_accuracy": source_accuracy, "compressed_accuracy": compressed_accuracy,
               "accuracy_drop": source_accuracy - compressed_accuracy,
               "disagreements": int(np.sum(original != exported)), "eval_images": len(evaluation),
               **output_deviation(source_probabilities, compressed_probabilities, evaluation.labels)}
    classes = per_class_accuracy(evaluation.labels, original, exported)
    num_classes = len(classes)
    worst = largest_class_drop(classes)
    if worst is not None:
        metrics["max_class_accuracy_drop"] = worst.accuracy_drop
        metrics.update({f"class_accuracy_drop.{c.label}": c.accuracy_drop for c in classes if c.images})
    metrics.update(deviation_intervals(evaluation.labels, original, exported))
    return metrics, {"matrix": deviation_matrix(original, exported, num_classes), "classes": classes, "worst": worst,
                     "labels": exported}


def semantics_comparison(original, path, evaluation, deviation, device, context) -> tuple[dict, str]:
    """The export's figures under reference semantics (the QDQ graph as written) next to the host's, and the
    images on which only one of them disagrees with the source; with one line saying why when the two differ
    beyond noise (an exact two-sided binomial test on those images, p < 0.05), else "". ``original``: the
    source's probabilities; ``deviation``: :func:`compare_outputs`' per-class deviation of the host's run;
    ``context``: the host's :class:`~mlflow_di.models.execution.ExecutionContext` (None: unknown)."""
    import numpy as np
    from scipy.stats import binomtest

    from mlflow_di.models.classifier import OnnxClassifier

    reference = OnnxClassifier(path, name="reference semantics", device=device, semantics="reference")
    figures, reference_deviation = compare_outputs(original, reference, evaluation)
    labels = original.argmax(axis=1)
    host_wrong, reference_wrong = deviation["labels"] != labels, reference_deviation["labels"] != labels
    host_only, reference_only = int(np.sum(host_wrong & ~reference_wrong)), int(np.sum(reference_wrong & ~host_wrong))
    judged = ("accuracy_drop", "disagreement_rate", "max_class_accuracy_drop")
    metrics = {f"reference.{key}": figures[key] for key in ("compressed_accuracy", "disagreements", *judged,
                                                            *(f"{f}_{end}" for f in judged for end in ("low", "high", "n")))
               if key in figures}
    metrics.update(host_only_disagreements=host_only, reference_only_disagreements=reference_only)
    differing = host_only + reference_only
    p_value = binomtest(host_only, differing, 0.5).pvalue if differing else 1.0
    metrics["semantics_p_value"] = float(p_value)
    line = ""
    if p_value < 0.05:
        cpu = "no VNNI" if context is not None and context.u8s8_saturates else "its int8 kernels"
        why = ("ONNX Runtime's u8s8 kernels saturate" if context is not None and context.u8s8_saturates else
               "ONNX Runtime's fused kernels differ from the QDQ graph")
        line = (
            f"on this CPU ({cpu}) {why}: {int(np.sum(host_wrong))} vs {figures['disagreements']} disagreements "
            f"(host vs reference semantics; {host_only} images differ only on this host, p={p_value:.2g}); a CPU "
            f"whose int8 kernels do not saturate would give ~{figures['disagreements']}")
    return metrics, line


def gzip_size(path) -> int:
    """Bytes of the file gzipped: where pruning's zeros pay off (ONNX stores tensors dense)."""
    return len(gzip.compress(pathlib.Path(path).read_bytes(), compresslevel=6))
