"""What the searches optimise: the objective (the two models disagree), DFlare's fitness with
its novelty memory, and DiffChaser's k-uncertainty.

All functions take one probability vector per model, ``p_original`` and ``p_compressed``
(shape (C,)), as returned by the black boxes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

#: DFlare's delta: D / delta puts a probability gap of 1e-3 on the same footing as a novel state.
DEFAULT_DELTA = 1e-3
#: Resolution at which probability gaps are compared. float32 probabilities carry about seven
#: significant digits and differ in the last bits between batch compositions; without rounding,
#: ties (most often both models saturated at 1.0, D = 0) would be decided by that noise, and a
#: seed's search would depend on which other seeds shared its batch.
GAP_RESOLUTION_DIGITS = 6
#: Resolution (decimal digits) at which log-probability margins are compared: float32 outputs carry
#: about seven significant digits, and a margin of tens of nats keeps four decimals of them.
MARGIN_RESOLUTION_DIGITS = 4
#: Smallest probability a log is taken of (float32 softmax outputs underflow to 0 near 1e-45).
LOG_FLOOR = 1e-45
#: Classes up to which one row is scored on plain Python floats (numpy's per-call cost dominates on
#: MNIST's 10); longer rows (ImageNet's 1,000) are scored with numpy, faster there. Both paths
#: give the same numbers (rows holding a NaN, e.g. from an infinite logit, always take the lists).
LIST_SCORING_MAX_CLASSES = 64
#: Squared-L2 distance beyond which a probability pair counts as unseen (reference: FLANN, 0.5).
DEFAULT_NOVELTY_THRESHOLD = 0.5


def top1_labels(p_original: np.ndarray, p_compressed: np.ndarray) -> tuple[int, int]:
    """(original, compressed) top-1 labels of one input (the first class on ties, as ``argmax``)."""
    return int(np.argmax(p_original)), int(np.argmax(p_compressed))


def labels_differ(p_original: np.ndarray, p_compressed: np.ndarray):
    """The objective, defined here once: the two models' top-1 labels differ (a triggering input).

    Takes numpy arrays: for one input (probability vectors of shape (C,)) a bool; for a batch
    ((N, C) each) a bool array of shape (N,). Ties go to the first class, as ``argmax`` (and ``list.index(max(...))``)
    break them.
    """
    if p_original.ndim == 1:  # the per-query path of the searches: no axis handling, a plain bool
        return bool(p_original.argmax() != p_compressed.argmax())
    return p_original.argmax(axis=-1) != p_compressed.argmax(axis=-1)


class RowFacts(NamedTuple):
    """What scoring one query reads of its two probability rows, computed for a whole step at once by
    :func:`row_facts`: whether the top-1 labels differ, and for rows longer than
    :data:`LIST_SCORING_MAX_CLASSES` whether they hold a NaN and each row's two largest values
    (second, first), the same values a per-row partition finds (None for short rows); and where the step
    computed it, the row's novelty."""

    differ: bool
    has_nan: bool = False
    original_top2: list | None = None
    compressed_top2: list | None = None
    #: whether the rows' probability pair is novel to its search's memory, when the step computed it
    #: (:mod:`~mlflow_di.fuzz.device_fitness`); then ``pair`` is that point, for the memory to keep
    novel: bool | None = None
    pair: object = None


def row_facts(p_original: np.ndarray, p_compressed: np.ndarray, compressed_top2: bool = True) -> list[RowFacts]:
    """:class:`RowFacts` of each row of a step's (N, C) probabilities, with one NumPy call per quantity for
    all rows instead of several per row (the per-query scoring's own cost at ImageNet's 1,000 classes);
    ``compressed_top2=False`` leaves the compressed model's two largest values out (a score that reads
    only the original's)."""
    differ = labels_differ(p_original, p_compressed).tolist()
    if p_original.shape[1] <= LIST_SCORING_MAX_CLASSES:
        return [RowFacts(d) for d in differ]
    # NaN anywhere in a row makes its sum NaN, whatever the order of the additions
    has_nan = np.isnan(p_original.sum(axis=1) + p_compressed.sum(axis=1)).tolist()
    original = np.partition(p_original, -2, axis=1)[:, -2:].tolist()
    compressed = (np.partition(p_compressed, -2, axis=1)[:, -2:].tolist() if compressed_top2
                  else [None] * len(original))
    return [RowFacts(*facts) for facts in zip(differ, has_nan, original, compressed)]


def top1_gap(p_original: np.ndarray, p_compressed: np.ndarray) -> float:
    """D(x) = |p_f(x)[top1_f] - p_g(x)[top1_g]|, each model's own top-1 probability, rounded to
    1e-6 (see :data:`GAP_RESOLUTION_DIGITS`).

    This is the reference's ``org.prob[0] - cps.prob[0]``; for non-triggering inputs, the only
    ones scored, both top-1 labels are the same class.
    """
    return gap_of(float(p_original.max()), float(p_compressed.max()))


def gap_of(original_top1: float, compressed_top1: float) -> float:
    """:func:`top1_gap` from each model's top-1 probability (the scoring paths that already hold them)."""
    return round(abs(original_top1 - compressed_top1), GAP_RESOLUTION_DIGITS)


def log_margin(p: np.ndarray) -> float:
    """log p[top-1] - log p[top-2] of one probability vector (>= 0), rounded to 1e-4 (see
    :data:`MARGIN_RESOLUTION_DIGITS`): the logit gap between a model's two most likely classes.

    It is 0 on the model's decision boundary and keeps growing where the top-1 probability has
    long rounded to 1.0 (the runner-up's probability still shrinks), so a search that minimises
    it has a signal on every seed, unlike D, which is ~0 whenever both models are sure.
    """
    p = np.asarray(p).ravel()
    if p.size <= LIST_SCORING_MAX_CLASSES or np.isnan(p.sum()):  # the list scan skips NaN, a partition would not
        return log_margin_list(p.tolist())
    return log_margin_row(p)


def log_margin_row(p: np.ndarray) -> float:
    """:func:`log_margin` of a 1-D row of at least two values without NaN, by a partition (the per-query
    path for long rows, whose caller has checked them)."""
    return margin_of(top2_row(p))


def top2_row(p: np.ndarray) -> list[float]:
    """A 1-D row's two largest values, ``[second, first]``, by a partition (the same two values the list scan
    finds, for a row without NaN)."""
    return np.partition(p, -2)[-2:].tolist()


def log_margin_list(values: list[float]) -> float:
    """:func:`log_margin` on a plain list (the per-query path: numpy's call overhead dominates on 10 values)."""
    first = second = -1.0
    for v in values:
        if v > first:
            first, second = v, first
        elif v > second:
            second = v
    return _margin(first, second)


def margin_of(top2: list) -> float:
    """:func:`log_margin` from a row's two largest values, ``[second, first]`` (see :class:`RowFacts`)."""
    return _margin(top2[1], top2[0])


def _margin(first: float, second: float) -> float:
    return round(math.log(max(first, LOG_FLOOR)) - math.log(max(second, LOG_FLOOR)), MARGIN_RESOLUTION_DIGITS)


def dflare_fitness(gap: float, novel: bool, delta: float = DEFAULT_DELTA) -> float:
    """H(x) = D(x) / delta + O(x) (O = 1 for a novel probability pair, else 0)."""
    return gap / delta + (1.0 if novel else 0.0)


class NoveltyMemory:
    """The probability pairs one search has seen, for DFlare's novelty term O(x).

    A point (the concatenated pair, 2C values) is novel when its squared L2 distance to every
    remembered point exceeds ``threshold``; only novel points are remembered (as TensorFuzz and
    the reference do). Exact nearest neighbour over a growing array: a search remembers at most
    a few hundred points, where this beats building a k-d tree.
    """

    def __init__(self, threshold: float = DEFAULT_NOVELTY_THRESHOLD, capacity: int = 64):
        self.threshold = threshold
        self._points: np.ndarray | None = None
        self._size = 0
        self._capacity = capacity

    def __len__(self) -> int:
        return self._size

    def nearest_squared_distance(self, point: np.ndarray) -> float:
        """Squared L2 distance to the closest remembered point (inf when empty)."""
        if self._size == 0:
            return float("inf")
        diff = self._points[: self._size] - point
        return float(np.einsum("ij,ij->i", diff, diff).min())

    def observe(self, point: np.ndarray) -> bool:
        """True (and remember the point) when it is novel, else False."""
        point = point.reshape(-1)
        if self.nearest_squared_distance(point) <= self.threshold:
            return False
        self._append(point)
        return True

    def _append(self, point: np.ndarray) -> None:
        if self._points is None:
            self._points = np.empty((self._capacity, point.size))
        elif self._size == len(self._points):
            self._points = np.concatenate([self._points, np.empty_like(self._points)])
        self._points[self._size] = point
        self._size += 1


def probability_pair(p_original: np.ndarray, p_compressed: np.ndarray) -> np.ndarray:
    """The point the novelty memory compares: both probability vectors, concatenated."""
    return np.concatenate((p_original.ravel(), p_compressed.ravel()))


def k_uncertainty(p_original: np.ndarray, p_compressed: np.ndarray, k: int = 2) -> float:
    """DiffChaser's k-uncertainty across the pair: |p_f[top-1 of f] - p_g[k-th most likely of g]|.

    Small values mean the original's confidence in its label is matched by the compressed
    model's k-th class, i.e. the input sits near a boundary where the two can part ways;
    DiffChaser's genetic search minimises it. The paper names the k-uncertainty fitness but its
    formula could not be checked here: this reading is a documented guess (see
    :mod:`mlflow_di.fuzz.diffchaser`).
    """
    k = min(k, len(p_compressed))
    kth = np.partition(np.asarray(p_compressed), -k)[-k]
    return abs(float(np.max(p_original)) - float(kth))
