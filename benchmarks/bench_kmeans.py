"""IDC's 1-D k-means: its ten k-means++ starts refined together vs one after another, in one run.

For six bimodal neurons and k = 2, 3, 4 (what IDC fits per layer with ``top_m=6``), at 256 and 2,048
values per neuron: the milliseconds of :func:`~mlflow_di.coverage.clustering.kmeans_1d` (starts refined
together by ``_lloyd_sorted_many``) and of the same starts refined one at a time as kmeans_1d did before
(the reference ``tests/test_clustering.py`` checks it against), the best of three repetitions each, and
whether both gave the same centroids (they must, bit for bit).

    .venv/bin/python -m benchmarks.bench_kmeans
"""
from __future__ import annotations

import json
import time

import numpy as np

from mlflow_di.coverage.clustering import kmeans_1d
from tests.test_clustering import _kmeans_one_start_at_a_time


def best_of(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    for count in (256, 2048):
        neurons = [np.concatenate([rng.normal(0, 1, count // 2), rng.normal(4, 0.5, count // 2)]) for _ in range(6)]
        together = best_of(3, lambda: [kmeans_1d(v, k) for v in neurons for k in (2, 3, 4)])
        alone = best_of(3, lambda: [_kmeans_one_start_at_a_time(v, k)[0] for v in neurons for k in (2, 3, 4)])
        same = all(np.array_equal(kmeans_1d(v, k).centroids, _kmeans_one_start_at_a_time(v, k)[0])
                   for v in neurons for k in (2, 3, 4))
        print(json.dumps({"values_per_neuron": count, "one_at_a_time_ms": round(alone * 1e3, 1),
                          "together_ms": round(together * 1e3, 1), "speedup": round(alone / together, 2),
                          "same_centroids": same}))


if __name__ == "__main__":
    main()
