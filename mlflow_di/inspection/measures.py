"""Affinity measures between hidden units and hypotheses, estimated online with confidence intervals.

Every measure sees the data as it streams past, one batch at a time: ``update(x, y)`` with the
batch's unit values ``x`` (n, U) and hypothesis values ``y`` (n, H), and ``estimate()`` returns
the scores so far with a confidence interval for each, all (U, H) arrays (a group measure: (G, H),
one row per unit group). DeepBase's early stopping needs exactly that: stop reading data once every
interval is narrower than a tolerance.

* :class:`Pearson` keeps running means and co-moments (Chan et al.'s pairwise update, exact in
  any batch order); interval from Fisher's z = atanh(r), standard error 1/sqrt(n - 3).
* :class:`Spearman` needs the ranks of all values seen, so it keeps them (float32; memory n x
  (U + H)) and ranks when asked; interval by Fisher's z with the Fieller-Hartley-Pearson standard
  error sqrt(1.06 / (n - 3)).
* :class:`MutualInformation` counts a joint histogram per (unit, hypothesis) pair: bin edges are
  fixed from the first batch (equal-frequency for many distinct values, one bin per value for
  few, e.g. a 0/1 class indicator); values outside go to the end bins. The plug-in estimate in
  nats (as sklearn's ``mutual_info_score``) with Hutter's first-order variance
  (E[log^2 ratio] - I^2) / n, widened by the plug-in bias bound (Bx - 1)(By - 1) / (2n).
* :class:`Probe` fits a linear model from a *group* of units to each hypothesis on the inputs
  seen so far and scores it out of fold (k folds, seeded): ridge regression, closed form, one fit
  per fold for all hypotheses together. A categorical hypothesis (integer values, 2 to
  :data:`MAX_PROBE_CLASSES` of them) is predicted from its one-hot columns (arg-max) and scored by
  balanced accuracy, with the binomial interval of each class's recall; any other by R^2, with
  the interval of the mean squared residual (the target's variance taken as known).

An undefined score (a unit or hypothesis constant on the inputs so far, too few inputs) is NaN
with a NaN interval; early stopping ignores it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats

MEASURES = ("pearson", "spearman", "mi", "probe")
MAX_PROBE_CLASSES = 10
MIN_INPUTS = 4


def z_value(confidence: float) -> float:
    """Two-sided normal quantile for a ``confidence`` interval (1.96 for 0.95)."""
    return float(stats.norm.ppf(0.5 + confidence / 2.0))


def _fisher_interval(r: np.ndarray, n: int, z: float, se_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    if n <= 3:
        nan = np.full_like(r, np.nan)
        return nan, nan
    centre = np.arctanh(np.clip(r, -0.999999, 0.999999))
    half = z * np.sqrt(se_factor / (n - 3))
    return np.tanh(centre - half), np.tanh(centre + half)


def _correlation_from_moments(cxy, m2x, m2y) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        r = cxy / np.sqrt(np.outer(m2x, m2y))
    scale = np.sqrt(np.outer(m2x, m2y))
    r[~(scale > 1e-12 * max(float(scale.max(initial=0.0)), 1.0))] = np.nan  # a constant unit or hypothesis
    return np.clip(r, -1.0, 1.0)


class Pearson:
    """Pearson correlation of every unit with every hypothesis, from running co-moments."""

    name = "pearson"
    group = False
    samples_per_input = 1  # > 1: several correlated samples per input (positions); intervals count inputs

    def __init__(self, confidence: float = 0.95):
        self.z = z_value(confidence)
        self.n = 0

    def update(self, x: np.ndarray, y: np.ndarray) -> None:
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        nb = len(x)
        if nb == 0:
            return
        mx, my = x.mean(0), y.mean(0)
        dx, dy = x - mx, y - my
        m2x, m2y, cxy = (dx * dx).sum(0), (dy * dy).sum(0), dx.T @ dy
        if self.n == 0:
            self.mean_x, self.mean_y, self.m2x, self.m2y, self.cxy, self.n = mx, my, m2x, m2y, cxy, nb
            return
        total = self.n + nb
        ex, ey = mx - self.mean_x, my - self.mean_y
        weight = self.n * nb / total
        self.m2x = self.m2x + m2x + ex * ex * weight
        self.m2y = self.m2y + m2y + ey * ey * weight
        self.cxy = self.cxy + cxy + np.outer(ex, ey) * weight
        self.mean_x = self.mean_x + ex * nb / total
        self.mean_y = self.mean_y + ey * nb / total
        self.n = total

    def estimate(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = _correlation_from_moments(self.cxy, self.m2x, self.m2y)
        return (r, *_fisher_interval(r, self.n // self.samples_per_input, self.z))


class _StoredSamples:
    """Values seen so far, appended into arrays that grow by doubling (no per-batch list to concatenate)."""

    def __init__(self):
        self.n = 0
        self.x = self.y = None

    def update(self, x: np.ndarray, y: np.ndarray) -> None:
        nb = len(x)
        if nb == 0:
            return
        if self.x is None:
            self.x = np.empty((max(nb, 1024), x.shape[1]), np.float32)
            self.y = np.empty((max(nb, 1024), y.shape[1]), np.float32)
        while self.n + nb > len(self.x):
            self.x = np.concatenate([self.x, np.empty_like(self.x)])
            self.y = np.concatenate([self.y, np.empty_like(self.y)])
        self.x[self.n:self.n + nb] = x
        self.y[self.n:self.n + nb] = y
        self.n += nb

    def seen(self) -> tuple[np.ndarray, np.ndarray]:
        return self.x[:self.n], self.y[:self.n]


class Spearman(_StoredSamples):
    """Spearman rank correlation (Pearson correlation of average ranks) of every unit with every hypothesis."""

    name = "spearman"
    group = False

    def __init__(self, confidence: float = 0.95):
        super().__init__()
        self.z = z_value(confidence)

    def estimate(self):
        x, y = self.seen()
        rx, ry = stats.rankdata(x, axis=0), stats.rankdata(y, axis=0)
        rx, ry = rx - rx.mean(0), ry - ry.mean(0)
        r = _correlation_from_moments(rx.T @ ry, (rx * rx).sum(0), (ry * ry).sum(0))
        return (r, *_fisher_interval(r, self.n, self.z, se_factor=1.06))


def bin_edges(values: np.ndarray, n_bins: int) -> np.ndarray:
    """Interior edges for one column: one bin per value when it has at most ``n_bins`` of them, else quantiles."""
    distinct = np.unique(values)
    if len(distinct) <= n_bins:
        return (distinct[1:] + distinct[:-1]) / 2.0
    return np.unique(np.quantile(values, np.linspace(0, 1, n_bins + 1)[1:-1]))


def digitize(values: np.ndarray, edges: Sequence[np.ndarray]) -> np.ndarray:
    """Bin index of each value, column by column (column j uses ``edges[j]``): int (n, columns)."""
    return np.stack([np.searchsorted(e, values[:, j], side="right") for j, e in enumerate(edges)], axis=1) \
        if len(edges) else np.zeros((len(values), 0), np.int64)


class MutualInformation:
    """Plug-in mutual information (nats) between each unit's and each hypothesis' binned values."""

    name = "mi"
    group = False
    samples_per_input = 1

    def __init__(self, confidence: float = 0.95, n_bins: int = 8):
        self.z = z_value(confidence)
        self.n_bins = n_bins
        self.n = 0
        self.counts = None

    def update(self, x: np.ndarray, y: np.ndarray) -> None:
        if len(x) == 0:
            return
        if self.counts is None:
            self.edges_x = [bin_edges(x[:, j], self.n_bins) for j in range(x.shape[1])]
            self.edges_y = [bin_edges(y[:, j], self.n_bins) for j in range(y.shape[1])]
            self.counts = np.zeros((x.shape[1], y.shape[1], self.n_bins, self.n_bins), np.int64)
        bx, by = digitize(x, self.edges_x), digitize(y, self.edges_y)
        units, hyps, b = x.shape[1], y.shape[1], self.n_bins
        cell = (np.arange(units)[None, :, None] * hyps + np.arange(hyps)[None, None, :]) * b * b \
            + bx[:, :, None] * b + by[:, None, :]
        self.counts += np.bincount(cell.ravel(), minlength=self.counts.size).reshape(self.counts.shape)
        self.n += len(x)

    def estimate(self):
        p = self.counts / max(self.n, 1)
        n = max(self.n // self.samples_per_input, 1)
        px, py = p.sum(3, keepdims=True), p.sum(2, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_ratio = np.where(p > 0, np.log(p / (px * py)), 0.0)
        mi = (p * log_ratio).sum((2, 3))
        second = (p * log_ratio ** 2).sum((2, 3))
        used_x = (px[..., 0] > 0).sum(2)  # (U, H): occupied unit bins
        used_y = (py[:, :, 0, :] > 0).sum(2)
        half = self.z * np.sqrt(np.maximum(second - mi ** 2, 0.0) / n) + (used_x - 1) * (used_y - 1) / (2.0 * n)
        mi = np.maximum(mi, 0.0)
        undefined = (used_x < 2) | (used_y < 2)
        mi, half = np.where(undefined, np.nan, mi), np.where(undefined, np.nan, half)
        return mi, np.maximum(mi - half, 0.0), mi + half


def is_categorical(values: np.ndarray) -> bool:
    """Integer values with 2 to :data:`MAX_PROBE_CLASSES` distinct ones: a classification target."""
    distinct = np.unique(values)
    return 2 <= len(distinct) <= MAX_PROBE_CLASSES and np.allclose(distinct, np.round(distinct))


class Probe(_StoredSamples):
    """Cross-validated linear probe from each unit group's values to every hypothesis (module docstring).

    One ridge fit per fold and group serves all hypotheses at once: the targets are the continuous
    hypotheses' values and the categorical ones' one-hot columns, side by side; a categorical
    hypothesis' prediction is the arg-max over its own columns (a least-squares classifier).
    """

    name = "probe"
    group = True

    def __init__(self, groups: Sequence[Sequence[int]], confidence: float = 0.95, folds: int = 5, seed: int = 0,
                 alpha: float = 1.0):
        super().__init__()
        self.groups = [np.asarray(g, dtype=np.int64) for g in groups]
        self.z = z_value(confidence)
        self.folds, self.seed, self.alpha = folds, seed, alpha

    def estimate(self):
        x, y = self.seen()
        n_hyp = y.shape[1] if y is not None else 0
        scores = np.full((len(self.groups), n_hyp), np.nan)
        lo, hi = scores.copy(), scores.copy()
        if self.n < max(MIN_INPUTS, 2 * self.folds):
            return scores, lo, hi
        targets, blocks = self._targets(y.astype(np.float64))
        fold = np.random.default_rng(self.seed).permutation(self.n) % self.folds
        for g, units in enumerate(self.groups):
            predicted = self._out_of_fold(x[:, units].astype(np.float64), targets, fold)
            for h, block in enumerate(blocks):
                if block is not None:
                    scores[g, h], lo[g, h], hi[g, h] = self._score(y[:, h].astype(np.float64), predicted, block)
        return scores, lo, hi

    def _targets(self, y: np.ndarray) -> tuple[np.ndarray, list]:
        """The regression targets side by side, and per hypothesis which columns are its own (None: no probe).

        A block is ("value", column) or ("classes", first column, class values).
        """
        columns, blocks = [], []
        for h in range(y.shape[1]):
            values = y[:, h]
            if np.ptp(values) == 0:
                blocks.append(None)
            elif is_categorical(values):
                classes = np.unique(values)
                blocks.append(("classes", len(columns), classes))
                columns.extend((values == c).astype(np.float64) for c in classes)
            else:
                blocks.append(("value", len(columns)))
                columns.append(values)
        return (np.stack(columns, axis=1) if columns else np.zeros((len(y), 0))), blocks

    def _out_of_fold(self, x: np.ndarray, targets: np.ndarray, fold: np.ndarray) -> np.ndarray:
        """Ridge predictions of each input by the model fitted on the other folds (features standardised there)."""
        predicted = np.empty_like(targets)
        for k in range(self.folds):
            test, train = fold == k, fold != k
            mean, std = x[train].mean(0), x[train].std(0)
            std[std == 0] = 1.0
            xs = (x[train] - mean) / std
            target_mean = targets[train].mean(0)
            gram = xs.T @ xs + self.alpha * np.eye(x.shape[1])
            weights = np.linalg.solve(gram, xs.T @ (targets[train] - target_mean))
            predicted[test] = ((x[test] - mean) / std) @ weights + target_mean
        return predicted

    def _score(self, target: np.ndarray, predicted: np.ndarray, block) -> tuple[float, float, float]:
        if block[0] == "classes":
            _, first, classes = block
            guess = classes[np.argmax(predicted[:, first:first + len(classes)], axis=1)]
            counts = np.array([np.sum(target == c) for c in classes])
            recalls = np.array([np.mean(guess[target == c] == c) for c in classes])
            score = float(recalls.mean())
            half = self.z * float(np.sqrt(np.sum(recalls * (1 - recalls) / counts))) / len(classes)
            return score, score - half, score + half
        squared = (target - predicted[:, block[1]]) ** 2
        variance = float(np.var(target))
        score = 1.0 - float(squared.mean()) / variance
        half = self.z * float(squared.std(ddof=1)) / np.sqrt(len(target)) / variance
        return score, score - half, score + half


def make_measure(name: str, groups: Sequence[Sequence[int]] = (), confidence: float = 0.95, seed: int = 0):
    """A fresh accumulator for ``name`` (one of :data:`MEASURES`)."""
    if name == "pearson":
        return Pearson(confidence)
    if name == "spearman":
        return Spearman(confidence)
    if name == "mi":
        return MutualInformation(confidence)
    if name == "probe":
        return Probe(groups, confidence, seed=seed)
    raise ValueError(f"unknown measure '{name}'; choose from {', '.join(MEASURES)}")
