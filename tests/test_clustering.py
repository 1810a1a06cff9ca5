import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_score

from mlflow_di.errors import UserError
from mlflow_di.coverage.clustering import (
    SINGLE_CLUSTER_SILHOUETTE,
    choose_clusters,
    kmeans_1d,
    nearest_centroid,
    silhouette_1d,
)

# No magnitudes below 1e-100 other than 0: sklearn squares differences, and a difference under ~1e-154
# squares to 0 there (it then calls two distinct values equal, where |a - b| does not).
_finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False,
                    allow_subnormal=False).filter(lambda v: v == 0 or abs(v) >= 1e-100)
_tied = st.sampled_from([-2.0, -0.5, 0.0, 0.0, 1.0, 1.5, 3.0, 7.25])


def _sklearn(values, labels) -> float:
    return silhouette_score(np.asarray(values, dtype=np.float64).reshape(-1, 1), labels)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n=st.integers(3, 60), n_labels=st.integers(2, 5), tied=st.booleans())
def test_silhouette_equals_sklearn_for_any_labelling(data, n, n_labels, tied):
    values = data.draw(st.lists(_tied if tied else _finite, min_size=n, max_size=n))
    labels = data.draw(st.lists(st.integers(0, n_labels - 1), min_size=n, max_size=n))
    assume(2 <= len(set(labels)) <= n - 1)
    assert abs(silhouette_1d(values, labels) - _sklearn(values, labels)) < 1e-9


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(_finite, _tied), min_size=5, max_size=80), k=st.integers(2, 4))
def test_silhouette_equals_sklearn_for_kmeans_intervals(values, k):
    assume(len(set(values)) >= k and len(values) > k)
    labels = kmeans_1d(values, k, seed=0).labels
    assume(2 <= len(set(labels.tolist())) <= len(values) - 1)
    assert abs(silhouette_1d(values, labels) - _sklearn(values, labels)) < 1e-9


def test_silhouette_on_large_shifted_narrow_clusters_keeps_its_precision():
    # sklearn's default euclidean distance goes through |a|^2 + |b|^2 - 2ab and loses ~1e-7 here;
    # its manhattan path takes |a - b| directly, which is the exact reference in 1-D.
    rng = np.random.default_rng(0)
    values = 1e3 + np.concatenate([rng.normal(0, 1e-3, 400), rng.normal(0.01, 1e-3, 400)])
    labels = (values > 1e3 + 0.005).astype(int)
    exact = silhouette_score(values.reshape(-1, 1), labels, metric="manhattan")
    assert abs(silhouette_1d(values, labels) - exact) < 1e-12


def test_silhouette_needs_two_to_n_minus_one_clusters():
    with pytest.raises(ValueError, match="2 to n-1 clusters"):
        silhouette_1d([1.0, 2.0, 3.0], [0, 0, 0])


def test_kmeans_is_deterministic_and_at_least_as_good_as_sklearn():
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.normal(0, 1, 300), rng.normal(6, 0.5, 200), rng.exponential(2, 300) + 10])
    for k in (2, 3, 4):
        first, second = kmeans_1d(values, k, seed=7), kmeans_1d(values, k, seed=7)
        np.testing.assert_array_equal(first.centroids, second.centroids)
        reference = KMeans(n_clusters=k, n_init=10, random_state=0).fit(values.reshape(-1, 1))
        assert first.inertia <= reference.inertia_ * (1 + 1e-9)
        assert np.all(np.diff(first.centroids) > 0)


def test_two_means_finds_the_optimal_split():
    rng = np.random.default_rng(2)
    values = np.sort(rng.gamma(2.0, 1.0, 200))
    costs = [values[:i].var() * i + values[i:].var() * (len(values) - i) for i in range(1, len(values))]
    assert kmeans_1d(values, 2, seed=0).inertia == pytest.approx(min(costs), rel=1e-12)


def test_nearest_centroid_breaks_ties_towards_the_lower_centroid():
    np.testing.assert_array_equal(nearest_centroid([0.0, 0.5, 0.51, 2.0], [0.0, 1.0]), [0, 0, 1, 1])


def test_choose_clusters_picks_the_visible_number_of_groups():
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.normal(c, 0.05, 100) for c in (0.0, 2.0, 5.0)])
    choice = choose_clusters(values, (2, 3, 4), seed=0)
    assert choice.k == 3
    np.testing.assert_allclose(choice.centroids, [0.0, 2.0, 5.0], atol=0.03)
    assert choice.silhouette == pytest.approx(silhouette_1d(values, nearest_centroid(values, choice.centroids)))


def test_constant_neuron_gets_one_centroid():
    choice = choose_clusters(np.full(50, 0.3))
    assert (choice.k, choice.centroids.tolist(), choice.silhouette) == (1, [0.3], SINGLE_CLUSTER_SILHOUETTE)


def test_candidates_beyond_the_distinct_values_are_skipped():
    assert choose_clusters([1.0] * 10 + [2.0] * 10, (3, 4)).k == 2


def test_reference_quirks_drop_zeros_round_and_fall_back_to_zero():
    rng = np.random.default_rng(4)
    values = np.concatenate([np.zeros(500), rng.normal(1.0, 0.01, 50), rng.normal(3.0, 0.01, 50)])
    paper = choose_clusters(values, (2, 3), seed=0)
    reference = choose_clusters(values, (2, 3), seed=0, reference_quirks=True)
    assert paper.k == 3 and paper.centroids[0] == 0.0
    assert reference.k == 2
    np.testing.assert_array_equal(reference.centroids, np.round(reference.centroids, 2))
    np.testing.assert_allclose(reference.centroids, [1.0, 3.0], atol=0.011)
    sparse = choose_clusters(np.concatenate([np.zeros(100), np.arange(1.0, 10.0)]), reference_quirks=True)
    assert (sparse.k, sparse.centroids.tolist()) == (1, [0.0])


def test_bad_cluster_counts_are_a_user_error():
    with pytest.raises(UserError, match=">= 2"):
        choose_clusters([1.0, 2.0, 3.0], (1, 2))


def _lloyd_one_start(x: np.ndarray, prefix: np.ndarray, centroids: np.ndarray, max_iter: int) -> np.ndarray:
    """kmeans_1d's refinement as it was, one start at a time (the reference the batched one must match)."""
    for _ in range(max_iter):
        bounds = np.concatenate(([0], np.searchsorted(x, (centroids[:-1] + centroids[1:]) / 2.0, side="right"),
                                 [len(x)]))
        sizes = np.diff(bounds)
        sums = prefix[bounds[1:]] - prefix[bounds[:-1]]
        updated = np.where(sizes > 0, sums / np.maximum(sizes, 1), centroids)
        if np.any(sizes == 0):  # an empty cluster moves to the value farthest from its centroid
            labels = np.repeat(np.arange(len(centroids)), sizes)
            far = int(np.argmax(np.abs(x - updated[labels])))
            updated[np.flatnonzero(sizes == 0)[0]] = x[far]
        updated = np.sort(updated)
        if np.array_equal(updated, centroids):
            break
        centroids = updated
    return centroids


def _kmeans_one_start_at_a_time(values, k, seed=0, n_init=10, max_iter=300):
    """kmeans_1d as it was: each k-means++ start refined alone by _lloyd_one_start, the best kept in order."""
    from mlflow_di.coverage.clustering import _kmeans_plus_plus

    x = np.sort(np.asarray(values, np.float64))
    prefix = np.concatenate(([0.0], np.cumsum(x)))
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(n_init):
        centroids = _lloyd_one_start(x, prefix, _kmeans_plus_plus(x, k, rng), max_iter)
        inertia = float(np.sum((x - centroids[nearest_centroid(x, centroids)]) ** 2))
        if best is None or inertia < best[1]:
            best = (centroids, inertia)
    return best


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), k=st.integers(1, 6), levels=st.integers(2, 40), max_iter=st.sampled_from([1, 2, 3, 300]))
def test_refining_every_start_at_once_is_refining_each_alone(data, k, levels, max_iter):
    # few distinct levels make clusters empty and points tie at midpoints; max_iter 1-3 stops rows mid-way
    n = data.draw(st.integers(k + 1, 80))
    codes = data.draw(st.lists(st.integers(0, levels - 1), min_size=n, max_size=n))
    values = np.asarray(codes, np.float64) * data.draw(st.sampled_from([1.0, 0.1, 1e-7])) + 3.0
    assume(len(np.unique(values)) >= k)
    seed = data.draw(st.integers(0, 5))
    result = kmeans_1d(values, k, seed=seed, n_init=7, max_iter=max_iter)
    centroids, inertia = _kmeans_one_start_at_a_time(values, k, seed=seed, n_init=7, max_iter=max_iter)
    np.testing.assert_array_equal(result.centroids, centroids)
    assert result.inertia == inertia
