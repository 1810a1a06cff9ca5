"""How well a repair works: repair ratio, inducing ratio, improvement; cross-validated by seed.

On a set of inputs with the original model's label ``o``, the compressed model's ``c`` and the
repaired model's ``r`` (the DFlare paper's Drepair measures; the formulas are ours):

* repair ratio = #{o != c and r == o} / #{o != c}: deviations fixed;
* inducing ratio = #{o == c and r != o} / #{o == c}: new deviations on inputs that agreed;
* improvement = (#{o != c} - #{o != r}) / #{o != c}: the net reduction of deviations.

:func:`cross_validate` trains a head on four fifths of the seeds and measures the other fifth,
five times: every example of one seed (its seed image, trigger and mutants) falls in one fold,
so each measurement is on seeds the head never saw.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.models.head import ProbabilityHead
from mlflow_di.repair.dataset import KINDS, RepairSet
from mlflow_di.repair.training import HeadSettings, train_head
from mlflow_di.deviation import deviation_intervals
from mlflow_di.results_json import JsonRoundTrip


@dataclasses.dataclass
class RepairCounts(JsonRoundTrip):
    """Counts on one set of inputs and the three ratios (None where the denominator is 0)."""

    inputs: int
    deviating: int
    repaired: int
    agreeing: int
    induced: int

    @classmethod
    def of(cls, original: np.ndarray, compressed: np.ndarray, repaired: np.ndarray) -> "RepairCounts":
        deviating = original != compressed
        return cls(inputs=len(original), deviating=int(deviating.sum()),
                   repaired=int(np.sum(deviating & (repaired == original))), agreeing=int((~deviating).sum()),
                   induced=int(np.sum(~deviating & (repaired != original))))

    def __add__(self, other: "RepairCounts") -> "RepairCounts":
        return RepairCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    @property
    def deviations_after(self) -> int:
        return self.deviating - self.repaired + self.induced

    @property
    def repair_ratio(self) -> float | None:
        return self.repaired / self.deviating if self.deviating else None

    @property
    def inducing_ratio(self) -> float | None:
        return self.induced / self.agreeing if self.agreeing else None

    @property
    def improvement(self) -> float | None:
        return (self.deviating - self.deviations_after) / self.deviating if self.deviating else None

    def to_dict(self) -> dict:
        return {**super().to_dict(), "deviations_after": self.deviations_after, "repair_ratio": self.repair_ratio,
                "inducing_ratio": self.inducing_ratio, "improvement": self.improvement}

    @classmethod
    def from_dict(cls, values: dict) -> "RepairCounts":
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


DEFAULT_FOLDS = 5


def choose_folds(seeds: int, folds: int | None) -> int:
    """The folds to use: ``folds`` when stated (at least that many seeds needed), else
    :data:`DEFAULT_FOLDS`, or one fold per seed (leave one seed out) when there are fewer seeds."""
    if folds is None:
        folds = max(2, min(DEFAULT_FOLDS, seeds))
    check_fold_count(seeds, folds)
    return folds


def check_fold_count(seeds: int, folds: int) -> None:
    """A one-line :class:`UserError` unless there are at least ``folds`` triggering seeds to split."""
    if seeds < folds:
        raise UserError(f"{folds}-fold cross-validation needs at least {folds} triggering seeds, the campaigns have "
                        f"{seeds} (fuzz more seeds, or pass fewer --folds)")


def seed_folds(groups: np.ndarray, folds: int = 5, seed: int = 0) -> list[np.ndarray]:
    """``folds`` test masks over the examples, splitting the distinct groups (seeds) at random
    (seeded) into nearly equal parts: a group's examples are all in one fold."""
    unique = np.unique(groups)
    check_fold_count(len(unique), folds)
    order = np.random.default_rng(seed).permutation(unique)
    return [np.isin(groups, part) for part in np.array_split(order, folds)]


@dataclasses.dataclass
class CrossValidation(JsonRoundTrip):
    """Per fold and pooled over the folds' test parts: all examples, and only seeds + triggers
    (the paper's kinds of input; ``paper_kinds``)."""

    folds: list[RepairCounts]
    pooled: RepairCounts
    paper_kinds: RepairCounts


def cross_validate(data: RepairSet, settings: HeadSettings = HeadSettings(), folds: int = 5,
                   seed: int = 0) -> CrossValidation:
    """Train on all folds but one and measure that one, for each fold (split by seed, see :func:`seed_folds`)."""
    per_fold, paper = [], RepairCounts(0, 0, 0, 0, 0)
    paper_mask = np.isin(data.kinds, [KINDS.index("seed"), KINDS.index("trigger")])
    for test in seed_folds(data.groups, folds, seed):
        train = data.subset(~test)
        head = train_head(train.probabilities, train.original_labels, settings, train.deviating)
        held = data.subset(test)
        repaired = head.predict(held.probabilities)
        per_fold.append(RepairCounts.of(held.original_labels, held.compressed_labels, repaired))
        kept = paper_mask[test]
        paper = paper + RepairCounts.of(held.original_labels[kept], held.compressed_labels[kept], repaired[kept])
    pooled = per_fold[0]
    for counts in per_fold[1:]:
        pooled = pooled + counts
    return CrossValidation(per_fold, pooled, paper)


@dataclasses.dataclass
class CleanAccuracy(JsonRoundTrip):
    """Top-1 accuracy on labelled test data of the three models, and their deviations from the original;
    ``intervals``: the repaired model's judged figures against the original with their 95% intervals
    (:func:`~mlflow_di.deviation.deviation_intervals`: ``accuracy_drop_low``, ...)."""

    data: str
    images: int
    original_accuracy: float
    compressed_accuracy: float
    repaired_accuracy: float
    deviations: RepairCounts
    intervals: dict = dataclasses.field(default_factory=dict)

    JSON_OPTIONAL = {"intervals": {}}


def clean_accuracy(original, compressed, head: ProbabilityHead, data, batch_size: int | None = None) -> CleanAccuracy:
    """Accuracy of original, compressed and repaired (compressed + ``head``) on ``data`` (an ImageSet)."""
    labels = np.asarray(data.labels)
    original_labels = original.predict(data.images, batch_size)
    probabilities = compressed.predict_proba(data.images, batch_size)
    compressed_labels = probabilities.argmax(axis=1)
    repaired_labels = head.predict(probabilities)
    return CleanAccuracy(data.name, len(labels), float(np.mean(original_labels == labels)),
                         compressed_accuracy=float(np.mean(compressed_labels == labels)),
                         repaired_accuracy=float(np.mean(repaired_labels == labels)),
                         deviations=RepairCounts.of(original_labels, compressed_labels, repaired_labels),
                         intervals=deviation_intervals(labels, original_labels, repaired_labels))
