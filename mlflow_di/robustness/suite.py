"""The robustness suite: an original model and its compressed versions on clean and corrupted images.

Every image, clean and under each chosen corruption and severity, goes through the original and
every compressed model. Per (corruption, severity) cell the suite keeps each model's accuracy
against the labels and each compressed model's *agreement* with the original: the fraction of
images on which their top-1 labels are equal. Only counts are kept per cell, so memory does not
grow with the number of images; the data is read one batch at a time (it may be lazy).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.progress import progress_bar
from mlflow_di.results_json import JsonRoundTrip
from mlflow_di.robustness.corruptions import CORRUPTIONS, SEVERITIES, check_corruptions, check_severity, corrupt


@dataclasses.dataclass
class Cell(JsonRoundTrip):
    """One corruption at one severity: the original's accuracy; per compressed model (in the order
    given), its accuracy and its agreement with the original."""

    corruption: str
    severity: int
    accuracy: float
    compressed_accuracy: list[float]
    agreement: list[float]


@dataclasses.dataclass
class CompressedSummary(JsonRoundTrip):
    """One compressed model over every corrupted cell.

    ``agreement_min`` is the worst cell's agreement and (``worst_corruption``, ``worst_severity``)
    that cell (the first in catalogue and severity order on a tie); ``agreement_mean`` is the mean
    over the cells, each counted once. ``agreement_min_low``/``_high``: the 95% interval of the worst
    cell's true agreement, from every cell's Clopper-Pearson interval at 1 - alpha/cells (Bonferroni: which
    cell is worst was chosen on the same images).
    """

    model: str
    clean_accuracy: float
    clean_agreement: float
    accuracy_mean: float
    agreement_mean: float
    agreement_min: float
    worst_corruption: str
    worst_severity: int
    agreement_min_low: float | None = None
    agreement_min_high: float | None = None

    JSON_OPTIONAL = {"agreement_min_low": None, "agreement_min_high": None}


@dataclasses.dataclass
class RobustnessResult(JsonRoundTrip):
    """Everything the suite measured; ``cells`` in corruption-then-severity order."""

    original: str
    compressed: list[str]
    data: str
    images: int
    seed: int
    corruptions: list[str]
    severities: list[int]
    clean_accuracy: float
    clean_compressed_accuracy: list[float]
    clean_agreement: list[float]
    accuracy_mean: float
    cells: list[Cell]
    summary: list[CompressedSummary]

    JSON_DUMPS = {"indent": 2}

    def cell(self, corruption: str, severity: int) -> Cell:
        for cell in self.cells:
            if cell.corruption == corruption and cell.severity == severity:
                return cell
        raise KeyError((corruption, severity))

    def grid(self, what: str = "agreement", model: int | None = None) -> np.ndarray:
        """Corruptions x severities matrix of ``what`` ("accuracy" or "agreement"): the original's
        accuracy when ``model`` is None, else compressed model number ``model`` (0-based)."""
        values = np.empty((len(self.corruptions), len(self.severities)))
        for r, corruption in enumerate(self.corruptions):
            for c, severity in enumerate(self.severities):
                cell = self.cell(corruption, severity)
                if model is None:
                    if what != "accuracy":
                        raise ValueError("the original has an accuracy only; pass model= for agreement")
                    values[r, c] = cell.accuracy
                else:
                    values[r, c] = (cell.compressed_accuracy if what == "accuracy" else cell.agreement)[model]
        return values


def run_suite(original, compressed: Sequence, data, corruptions: Sequence[str] | None = None,
              severities: Sequence[int] = SEVERITIES, seed: int = 0, batch: int = 256,
              progress: bool = True) -> RobustnessResult:
    """Accuracy and agreement of ``original`` and ``compressed`` classifiers (``predict`` on raw
    uint8 NHWC images) on ``data`` (an :class:`mlflow_di.data.ImageSet`), clean and corrupted.

    Results do not depend on ``batch``: each image's corruption is seeded by its index in ``data``.
    """
    corruptions = check_corruptions(corruptions)
    severities = tuple(dict.fromkeys(check_severity(s) for s in severities))
    if not severities:
        raise UserError(f"no severity given; choose from {','.join(map(str, SEVERITIES))}")
    if batch < 1:
        raise UserError(f"batch must be at least 1, got {batch}")
    n = len(data)
    if n == 0:
        raise UserError(f"data '{data.name}' holds no images to corrupt")
    models = [original, *compressed]
    cells = [(name, severity) for name in corruptions for severity in severities]
    transforms = [CORRUPTIONS[name].build(severity, data.image_shape) for name, severity in cells]
    correct = np.zeros((1 + len(cells), len(models)), np.int64)  # row 0: clean images
    agree = np.zeros((1 + len(cells), len(compressed)), np.int64)

    def score(row: int, images: np.ndarray, labels: np.ndarray) -> None:
        predicted = [np.asarray(model.predict(images, batch_size=batch)) for model in models]
        correct[row] += np.array([np.sum(p == labels) for p in predicted], np.int64)
        agree[row] += np.array([np.sum(p == predicted[0]) for p in predicted[1:]], np.int64)

    with progress_bar(total=n * (1 + len(cells)), desc="robustness", unit="image", disable=not progress) as bar:
        for start in range(0, n, batch):
            images = np.asarray(data.images[start:start + batch])
            labels = data.labels[start:start + len(images)]
            indices = np.arange(start, start + len(images))
            score(0, images, labels)
            bar.update(len(images))
            for row, ((name, severity), transform) in enumerate(zip(cells, transforms), start=1):
                score(row, corrupt(images, name, severity, indices, seed, transform), labels)
                bar.update(len(images))
    accuracy, agreement = correct / n, agree / n
    result_cells = [Cell(name, severity, float(accuracy[row, 0]), [float(a) for a in accuracy[row, 1:]],
                         [float(a) for a in agreement[row]]) for row, (name, severity) in enumerate(cells, start=1)]
    summary = [_summary(getattr(model, "name", str(model)), k, accuracy, agreement=agreement, cells=cells,
                        agreeing=agree[1:, k], n=n) for k, model in enumerate(compressed)]
    return RobustnessResult(getattr(original, "name", str(original)), [getattr(m, "name", str(m)) for m in compressed],
                            data.name, images=n, seed=seed, corruptions=list(corruptions), severities=list(severities),
                            clean_accuracy=float(accuracy[0, 0]),
                            clean_compressed_accuracy=[float(a) for a in accuracy[0, 1:]],
                            clean_agreement=[float(a) for a in agreement[0]],
                            accuracy_mean=float(np.mean(accuracy[1:, 0])), cells=result_cells, summary=summary)


def _summary(name: str, k: int, accuracy: np.ndarray, agreement: np.ndarray, cells: list, agreeing: np.ndarray,
             n: int) -> CompressedSummary:
    from mlflow_di.intervals import clopper_pearson, extreme

    corrupted = agreement[1:, k]
    worst = int(np.argmin(corrupted))  # the first of equal minima
    _, spread = extreme([(count / n, lambda confidence, count=int(count): clopper_pearson(count, n, confidence))
                         for count in agreeing], largest=False)
    return CompressedSummary(name, float(accuracy[0, 1 + k]), float(agreement[0, k]),
                             accuracy_mean=float(np.mean(accuracy[1:, 1 + k])), agreement_mean=float(np.mean(corrupted)),
                             agreement_min=float(corrupted[worst]), worst_corruption=cells[worst][0],
                             worst_severity=int(cells[worst][1]), agreement_min_low=spread.low,
                             agreement_min_high=spread.high)


def example_rows(image: np.ndarray, corruptions: Sequence[str], severities: Sequence[int], seed: int = 0,
                 index: int = 0) -> list[np.ndarray]:
    """One uint8 (1 + len(severities), H, W, C) row per corruption: ``image`` clean, then at each
    severity, corrupted exactly as the suite corrupts the image at position ``index``."""
    image = np.asarray(image)
    rows = []
    for name in check_corruptions(corruptions):
        corrupted = [corrupt(image[None], name, severity, [index], seed)[0] for severity in severities]
        rows.append(np.stack([image, *corrupted]))
    return rows
