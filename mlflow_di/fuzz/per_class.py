"""A campaign by class: which classes' seeds deviate easily, and which labels the triggers move between.

- :func:`class_rows`: per true label of the seeds, how many were fuzzed, how many gave a trigger,
  the success rate and the mean queries per trigger (``None`` where nothing was found);
- :func:`trigger_matrix`: the original-label x compressed-label matrix of the triggers
  (:func:`mlflow_di.deviation.deviation_matrix`); every cell is off the diagonal by definition.
"""
from __future__ import annotations

import statistics

import numpy as np

from mlflow_di.deviation import deviation_matrix


def class_rows(records) -> list[dict]:
    """One row per true label present among the seeds, in label order."""
    rows = []
    for label in sorted({r.label for r in records}):
        mine = [r for r in records if r.label == label]
        fuzzed = [r for r in mine if not r.already_deviating]
        found = [r for r in fuzzed if r.success]
        rows.append({"class": label, "seeds": len(mine), "already_deviating": len(mine) - len(fuzzed),
                     "fuzzed": len(fuzzed), "triggers": len(found),
                     "success_rate": len(found) / len(fuzzed) if fuzzed else None,
                     "mean_queries": statistics.fmean(r.queries for r in found) if found else None})
    return rows


def trigger_matrix(records, num_classes: int | None = None) -> np.ndarray:
    """Counts of (original label, compressed label) on the triggering inputs."""
    found = [r for r in records if r.success]
    original = np.array([r.trigger_labels[0] for r in found], np.int64)
    compressed = np.array([r.trigger_labels[1] for r in found], np.int64)
    if num_classes is None:
        labels = [r.label for r in records] + [v for r in found for v in r.trigger_labels]
        num_classes = max(labels, default=-1) + 1
    return deviation_matrix(original, compressed, num_classes=num_classes)
