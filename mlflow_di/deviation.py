"""Per-class deviation between a model and its compressed version: which classes move, and where to.

Pure NumPy on top-1 labels, shared by ``compress`` (on the evaluation data), ``fuzz`` (on the
triggers) and the gate:

- :func:`deviation_matrix`: counts of (original label, compressed label) pairs; the diagonal is
  agreement, an off-diagonal cell ``[i, j]`` counts inputs the original calls ``i`` and the
  compressed model calls ``j``;
- :func:`per_class_accuracy`: for each true class, both models' accuracy and the drop
  (original minus compressed), with the class's size, so that a drop on 3 images is read as such;
- :func:`output_deviation`: on probabilities, the top-1 disagreement rate, the flips either way,
  the KL divergence and each model's top-1/top-2 margin;
- :func:`deviation_intervals`: the 95% intervals of the figures the gate judges on labelled images.

A class with no inputs has accuracy ``nan`` (not 0): nothing was measured there.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.errors import UserError


def _labels(values, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise UserError(f"{what} must be a 1-D array of integer class labels, got shape {array.shape} of {array.dtype}")
    if len(array) and array.min() < 0:
        raise UserError(f"{what} has a negative class label ({array.min()})")
    return array.astype(np.int64, copy=False)


def class_count(*label_arrays, num_classes: int | None = None) -> int:
    """``num_classes`` when given (checked to cover every label), else 1 + the largest label seen."""
    largest = max((int(np.max(a)) for a in label_arrays if len(a)), default=-1)
    if num_classes is None:
        return largest + 1
    if largest >= num_classes:
        raise UserError(f"label {largest} is outside the {num_classes} classes")
    return int(num_classes)


def deviation_matrix(original_labels, compressed_labels, num_classes: int | None = None) -> np.ndarray:
    """``(C, C)`` int64 counts: row = the original's top-1 label, column = the compressed model's."""
    original = _labels(original_labels, "original labels")
    compressed = _labels(compressed_labels, "compressed labels")
    if len(original) != len(compressed):
        raise UserError(f"{len(original)} original labels but {len(compressed)} compressed labels")
    classes = class_count(original, compressed, num_classes=num_classes)
    return np.bincount(original * classes + compressed, minlength=classes * classes).reshape(classes, classes)


@dataclasses.dataclass(frozen=True)
class ClassAccuracy:
    """Both models' accuracy on the inputs of one true class."""

    label: int
    images: int
    original_accuracy: float
    compressed_accuracy: float

    @property
    def accuracy_drop(self) -> float:
        return self.original_accuracy - self.compressed_accuracy

    def to_row(self) -> dict:
        return {"class": self.label, "images": self.images, "original_accuracy": self.original_accuracy,
                "compressed_accuracy": self.compressed_accuracy, "accuracy_drop": self.accuracy_drop}


def per_class_accuracy(true_labels, original_labels, compressed_labels,
                       num_classes: int | None = None) -> list[ClassAccuracy]:
    """One :class:`ClassAccuracy` per class ``0..C-1`` (``nan`` accuracies for a class with no inputs)."""
    truth = _labels(true_labels, "true labels")
    original = _labels(original_labels, "original labels")
    compressed = _labels(compressed_labels, "compressed labels")
    if not len(truth) == len(original) == len(compressed):
        raise UserError(f"label arrays differ in length: {len(truth)} true, {len(original)} original, "
                        f"{len(compressed)} compressed")
    classes = class_count(truth, original, compressed, num_classes=num_classes)
    sizes = np.bincount(truth, minlength=classes)
    right_original = np.bincount(truth, weights=original == truth, minlength=classes)
    right_compressed = np.bincount(truth, weights=compressed == truth, minlength=classes)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc_original = right_original / sizes
        acc_compressed = right_compressed / sizes
    return [ClassAccuracy(label, int(sizes[label]), float(acc_original[label]), float(acc_compressed[label]))
            for label in range(classes)]


def largest_class_drop(classes: list[ClassAccuracy]) -> ClassAccuracy | None:
    """The class whose accuracy dropped the most (``None`` when no class has inputs)."""
    measured = [c for c in classes if c.images > 0]
    return max(measured, key=lambda c: (c.accuracy_drop, -c.label)) if measured else None


def matrix_rows(matrix: np.ndarray) -> list[dict]:
    """The matrix as table rows (``original`` label, then one column per compressed label)."""
    return [{"original": i, **{f"-> {j}": int(matrix[i, j]) for j in range(matrix.shape[1])}}
            for i in range(matrix.shape[0])]


def output_deviation(p_original, p_compressed, labels=None) -> dict:
    """How the compressed model's outputs deviate from the original's on the same inputs, beyond
    accuracy (which can stay flat while answers flip both ways):

    - ``disagreement_rate``: the fraction of inputs whose top-1 labels differ;
    - ``flips_right_to_wrong`` / ``flips_wrong_to_right`` (with ``labels``): the fraction of inputs
      the original gets right and the compressed model wrong, and the reverse (their difference is
      the accuracy drop);
    - ``kl_divergence`` / ``kl_divergence_max``: mean and largest KL(original || compressed) in nats,
      probabilities clipped at 1e-12 (a zero probability would make it infinite);
    - ``margin_original`` / ``margin_compressed``: each model's mean top-1 minus top-2 probability
      (how decided it is; a compressed model with a smaller margin is closer to flipping).
    """
    p, q = np.asarray(p_original, np.float64), np.asarray(p_compressed, np.float64)
    if p.ndim != 2 or p.shape != q.shape or not len(p):
        raise UserError(f"probabilities of both models must be (inputs, classes) arrays of one shape with inputs, "
                        f"got {p.shape} and {q.shape}")
    top_p, top_q = p.argmax(axis=1), q.argmax(axis=1)
    eps = 1e-12
    p_safe, q_safe = np.clip(p, eps, 1.0), np.clip(q, eps, 1.0)
    # >= 0 in exact arithmetic; float32 softmax outputs that sum to 1 +- 1e-7 can give -1e-9
    kl = np.maximum(np.sum(p_safe * (np.log(p_safe) - np.log(q_safe)), axis=1), 0.0)
    result = {"disagreement_rate": float(np.mean(top_p != top_q)), "kl_divergence": float(np.mean(kl)),
              "kl_divergence_max": float(np.max(kl)), "margin_original": _mean_margin(p),
              "margin_compressed": _mean_margin(q)}
    if labels is not None:
        truth = _labels(labels, "labels")
        if len(truth) != len(p):
            raise UserError(f"{len(truth)} labels for {len(p)} inputs")
        right_p, right_q = top_p == truth, top_q == truth
        result["flips_right_to_wrong"] = float(np.mean(right_p & ~right_q))
        result["flips_wrong_to_right"] = float(np.mean(~right_p & right_q))
    return result


def _mean_margin(probabilities: np.ndarray) -> float:
    if probabilities.shape[1] < 2:
        return 1.0
    top_two = np.sort(probabilities, axis=1)[:, -2:]
    return float(np.mean(top_two[:, 1] - top_two[:, 0]))


#: the figures :func:`deviation_intervals` gives an interval (``NAME_low``, ``NAME_high``, ``NAME_n``) to
INTERVAL_FIGURES = ("disagreement_rate", "accuracy_drop", "max_class_accuracy_drop")


def deviation_intervals(labels, original, exported) -> dict:
    """The 95% interval and sample size of each figure the gate judges on evaluation images: the disagreement
    rate (Clopper-Pearson), the accuracy drop (Newcombe's paired interval: the two accuracies are on the same
    images) and the largest per-class drop (the same per class, Bonferroni over the classes)."""
    from mlflow_di.intervals import clopper_pearson, extreme, paired_difference

    labels, original, exported = (np.asarray(a) for a in (labels, original, exported))
    n = len(labels)

    def paired(rows) -> tuple:
        right_o, right_e = original[rows] == labels[rows], exported[rows] == labels[rows]
        return (int(np.sum(right_o & right_e)), int(np.sum(right_o & ~right_e)), int(np.sum(~right_o & right_e)),
                int(np.sum(~right_o & ~right_e)))

    figures = {"disagreement_rate": clopper_pearson(int(np.sum(original != exported)), n),
               "accuracy_drop": paired_difference(*paired(slice(None)))}
    per_class = []
    for label in np.unique(labels):
        table = paired(labels == label)
        per_class.append(((table[1] - table[2]) / sum(table),
                          lambda confidence, table=table: paired_difference(*table, confidence=confidence)))
    if per_class:
        figures["max_class_accuracy_drop"] = extreme(per_class, largest=True)[1]
    return {f"{name}_{end}": value for name, interval in figures.items()
            for end, value in (("low", interval.low), ("high", interval.high), ("n", interval.n))}
