"""Quantising one neuron's activation values: 1-D k-means, its exact Silhouette score, the best k.

IDC (Alg. 2 of the paper) clusters each important neuron's activations over the analysis set for
every k in a candidate set and keeps the k with the highest Silhouette score. Both steps are 1-D,
which makes them cheap when done on sorted values:

* :func:`kmeans_1d` is Lloyd's algorithm on sorted values: a 1-D cluster is an interval, so an
  iteration is a few binary searches plus prefix sums (O(k log n)) after one O(n log n) sort;
  k-means++ starts from a seeded generator, best of ``n_init`` by inertia (as scikit-learn does).
* :func:`silhouette_1d` is the exact Silhouette (scikit-learn's definition, distance |a-b|) in
  O(K n log n) instead of O(n^2): per cluster, its sorted values' prefix sums give every point's
  summed distance to the cluster with one binary search. No contiguity is assumed, so it is exact
  for any labelling.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from mlflow_di.errors import UserError

#: Silhouette recorded for a neuron that gets a single centroid (constant values, or too few values
#: with the reference quirks): one cluster has no Silhouette; 0 is scikit-learn's value for a point
#: alone in its cluster and means "no cluster structure".
SINGLE_CLUSTER_SILHOUETTE = 0.0
#: Reference-code quirk: neurons with fewer non-zero values than this get the single centroid 0.
REFERENCE_MIN_VALUES = 10


def _as_values(values) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(x)):
        raise ValueError("activation values contain NaN or infinity")
    return x


def silhouette_samples_1d(values, labels) -> np.ndarray:
    """Silhouette of each point of 1-D ``values`` under ``labels`` (exact; equals scikit-learn's with L1).

    s(i) = (b - a) / max(a, b) with a = mean distance to the rest of its own cluster and b = the
    smallest mean distance to another cluster; 0 for a point alone in its cluster.
    """
    x = _as_values(values)
    labels = np.asarray(labels).reshape(-1)
    if len(labels) != len(x):
        raise ValueError(f"{len(x)} values but {len(labels)} labels")
    _, codes, counts = np.unique(labels, return_inverse=True, return_counts=True)
    n_clusters = len(counts)
    if not 2 <= n_clusters <= len(x) - 1:
        raise ValueError(f"silhouette needs 2 to n-1 clusters; got {n_clusters} for {len(x)} values")
    mean_distance = np.empty((n_clusters, len(x)))
    for cluster in range(n_clusters):
        mean_distance[cluster] = _summed_distances(x, x[codes == cluster]) / counts[cluster]
    own = mean_distance[codes, np.arange(len(x))]
    own_count = counts[codes]
    a = own * own_count / np.maximum(own_count - 1, 1)  # the mean excludes the point itself (distance 0)
    mean_distance[codes, np.arange(len(x))] = np.inf
    b = mean_distance.min(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = (b - a) / np.maximum(a, b)
    s[own_count == 1] = 0.0
    return np.nan_to_num(s)


def _summed_distances(points: np.ndarray, cluster: np.ndarray) -> np.ndarray:
    """For every point, sum_j |point - cluster_j|, with one sort and one binary search per point.

    Values are taken relative to the cluster's median so that the prefix-sum differences keep
    their precision when the cluster is narrow and far from zero.
    """
    centre = np.median(cluster)
    shifted = np.sort(cluster) - centre
    prefix = np.concatenate(([0.0], np.cumsum(shifted)))
    p = points - centre
    below = np.searchsorted(shifted, p, side="right")
    above = len(shifted) - below
    return (p * below - prefix[below]) + ((prefix[-1] - prefix[below]) - p * above)


def silhouette_1d(values, labels) -> float:
    """Mean Silhouette of 1-D ``values`` under ``labels``: equals ``sklearn.metrics.silhouette_score`` (L1)."""
    return float(np.mean(silhouette_samples_1d(values, labels)))


class KMeans1D(NamedTuple):
    """A 1-D k-means result: ascending ``centroids``, each value's cluster ``labels``, and the ``inertia``."""

    centroids: np.ndarray
    labels: np.ndarray
    inertia: float


def nearest_centroid(values, centroids) -> np.ndarray:
    """Index of the nearest of the ascending ``centroids`` for each value (a tie goes to the lower one)."""
    centroids = np.asarray(centroids, dtype=np.float64)
    midpoints = (centroids[:-1] + centroids[1:]) / 2.0
    return np.searchsorted(midpoints, np.asarray(values, dtype=np.float64), side="left")


def _kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding: each next centre drawn with probability proportional to squared distance."""
    centres = [x[rng.integers(len(x))]]
    closest = (x - centres[0]) ** 2
    for _ in range(1, k):
        total = closest.sum()
        if total <= 0:
            break
        centre = x[min(np.searchsorted(np.cumsum(closest), rng.random() * total, side="right"), len(x) - 1)]
        centres.append(centre)
        closest = np.minimum(closest, (x - centre) ** 2)
    return np.sort(np.asarray(centres))


def _lloyd_sorted_many(x: np.ndarray, prefix: np.ndarray, starts: np.ndarray, max_iter: int) -> np.ndarray:
    """Lloyd iterations on sorted ``x`` from every row of ``starts`` (R, k) at once: a 1-D cluster is the
    interval between centroid midpoints, an empty cluster moves to the value farthest from its centroid,
    and each row stops when it stops moving; one binary search over ``x`` per iteration for all rows (IDC's
    ten k-means++ starts per k and neuron)."""
    centroids = starts.astype(np.float64, copy=True)
    active = np.arange(len(centroids))
    for _ in range(max_iter):
        current = centroids[active]
        midpoints = (current[:, :-1] + current[:, 1:]) / 2.0
        inner = np.searchsorted(x, midpoints.ravel(), side="right").reshape(midpoints.shape)
        bounds = np.concatenate((np.zeros((len(active), 1), np.int64), inner,
                                 np.full((len(active), 1), len(x), np.int64)), axis=1)
        sizes = np.diff(bounds, axis=1)
        sums = prefix[bounds[:, 1:]] - prefix[bounds[:, :-1]]
        updated = np.where(sizes > 0, sums / np.maximum(sizes, 1), current)
        for row in np.flatnonzero((sizes == 0).any(axis=1)):  # an empty cluster: the farthest value
            labels = np.repeat(np.arange(current.shape[1]), sizes[row])
            far = int(np.argmax(np.abs(x - updated[row][labels])))
            updated[row, np.flatnonzero(sizes[row] == 0)[0]] = x[far]
        updated = np.sort(updated, axis=1)
        moved = ~(updated == current).all(axis=1)
        centroids[active[moved]] = updated[moved]
        active = active[moved]
        if not len(active):
            break
    return centroids


def kmeans_1d(values, k: int, seed: int = 0, n_init: int = 10, max_iter: int = 300) -> KMeans1D:
    """Deterministic 1-D k-means: best of ``n_init`` k-means++ starts (seeded) by inertia, ascending centroids.

    The starts are drawn one after another from the seeded generator, then refined together
    (:func:`_lloyd_sorted_many`); the best is kept in the order they were drawn."""
    x_raw = _as_values(values)
    if k < 1 or k > len(np.unique(x_raw)):
        raise ValueError(f"k={k} needs at least {k} distinct values; got {len(np.unique(x_raw))}")
    x = np.sort(x_raw)
    prefix = np.concatenate(([0.0], np.cumsum(x)))
    rng = np.random.default_rng(seed)
    starts = [_kmeans_plus_plus(x, k, rng) for _ in range(max(1, n_init))]
    by_size: dict[int, list[int]] = {}  # k-means++ may run out of distance and give a start fewer centres
    for number, start in enumerate(starts):
        by_size.setdefault(len(start), []).append(number)
    refined = [None] * len(starts)
    for numbers in by_size.values():
        for number, centroids in zip(numbers, _lloyd_sorted_many(x, prefix, np.stack([starts[n] for n in numbers]),
                                                                 max_iter)):
            refined[number] = centroids
    best = None
    for centroids in refined:
        inertia = float(np.sum((x - centroids[nearest_centroid(x, centroids)]) ** 2))
        if best is None or inertia < best[1]:
            best = (centroids, inertia)
    centroids, inertia = best
    return KMeans1D(centroids, nearest_centroid(x_raw, centroids), inertia)


class ClusterChoice(NamedTuple):
    """The chosen quantisation of one neuron: ascending ``centroids``, their ``silhouette``, and ``k``."""

    centroids: np.ndarray
    silhouette: float
    k: int


def check_candidates(candidates: Sequence[int]) -> tuple[int, ...]:
    """Cluster counts as a sorted tuple of distinct ints >= 2; a :class:`UserError` otherwise."""
    try:
        ks = tuple(sorted({int(k) for k in candidates}))
    except (TypeError, ValueError):
        raise UserError(f"cluster counts must be integers, got {candidates!r}") from None
    if not ks or ks[0] < 2:
        raise UserError(f"cluster counts must be integers >= 2, got {list(candidates)}")
    return ks


def choose_clusters(values, candidates: Sequence[int] = (2, 3, 4), seed: int = 0,
                    reference_quirks: bool = False, n_init: int = 10) -> ClusterChoice:
    """k-means for each candidate k, keep the one with the highest Silhouette (the smaller k on a tie).

    Paper behaviour by default: all values, exact Silhouette, unrounded centroids. With
    ``reference_quirks`` the reference code's choices: exact zeros dropped first (the reference does
    so for dense neurons; here for every neuron, as a conv channel's mean is exactly 0 only when its
    whole map is), fewer than 10 values left -> the single centroid 0, centroids rounded to 2 decimals.
    Values with one distinct value (a constant neuron) get that value as single centroid, with
    silhouette :data:`SINGLE_CLUSTER_SILHOUETTE`; candidates above the number of distinct values
    are skipped.
    """
    ks = check_candidates(candidates)
    x = _as_values(values)
    if reference_quirks:
        x = x[x != 0]
        if len(x) < REFERENCE_MIN_VALUES:
            return ClusterChoice(np.zeros(1), SINGLE_CLUSTER_SILHOUETTE, 1)
        choice = _best_clusters(x, ks, seed, n_init)
        return choice._replace(centroids=np.round(choice.centroids, 2))
    return _best_clusters(x, ks, seed, n_init)


def _best_clusters(x: np.ndarray, ks: tuple[int, ...], seed: int, n_init: int) -> ClusterChoice:
    if len(x) == 0:
        raise ValueError("no activation values to cluster")
    distinct = np.unique(x)
    if len(distinct) == 1:
        return ClusterChoice(distinct, SINGLE_CLUSTER_SILHOUETTE, 1)
    largest = min(len(distinct), len(x) - 1)  # silhouette needs at most n-1 clusters
    feasible = [k for k in ks if k <= largest] or ([largest] if largest >= 2 else [])
    if not feasible:  # two distinct values, two values in all
        return ClusterChoice(np.array([float(np.mean(x))]), SINGLE_CLUSTER_SILHOUETTE, 1)
    best = None
    for k in feasible:
        result = kmeans_1d(x, k, seed=seed, n_init=n_init)
        score = silhouette_1d(x, result.labels)
        if best is None or score > best.silhouette:
            best = ClusterChoice(result.centroids, score, k)
    return best
