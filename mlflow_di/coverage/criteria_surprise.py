"""Surprise adequacy (Kim et al., ICSE 2019): LSA and DSA per input, and surprise coverage (LSC, DSC).

Activations here are "activation traces": a 2-D array (inputs, neurons) of one or more layers
side by side (a conv neuron is the spatial mean of its channel). Inputs are grouped by the class
the *model predicts*, for the training set and the test set alike, as in Kim et al.'s ``sa.py``
(and DeepImportance's copy, ``coverages/sa.py``).

- LSA of x = -log f_c(x), f_c a Gaussian KDE of the training traces the model assigns to x's
  class c. Same choices as the reference: scipy.stats.gaussian_kde's estimator (full data
  covariance scaled by Scott's factor n^(-1/(d+4))), and neurons whose variance is below
  ``var_threshold`` = 1e-5 within any class are dropped first (for every class). Evaluated here
  in batched matrix form (whitened squared distances + logsumexp) instead of one
  ``kde.logpdf`` call per input; ``tests/test_criteria.py`` checks it against scipy.
- DSA of x = |x - x_a| / |x_a - x_b|: x_a the nearest training trace of x's class, x_b the
  nearest training trace of another class to x_a. Batched nearest neighbours
  (|q|^2 + |r|^2 - 2 q.r in chunks, argmin, then the exact distance to the winner); the
  denominator depends only on x_a, so it is computed once per training input at fit time.
- Surprise coverage: ``buckets`` equal slices of [lower, upper]; coverage = fraction hit. Two
  bucket rules (:data:`BUCKET_RULES`): ``"fixed"`` (the default, :func:`surprise_cells`) and
  ``"sadl"`` (:func:`sadl_surprise_cells`, Kim et al.'s ``get_sc``, for reproducing their numbers).

Differences from the reference code, all for robustness or monotonicity:
- A class with fewer than 2 training traces, or whose covariance (after dropping low-variance
  neurons) is singular (e.g. fewer traces than neurons), gets no density: inputs predicted as
  that class get LSA = NaN and cover no LSC bucket. The reference crashes (missing class) or,
  since a lone trace has zero variance in every neuron, drops all neurons and stops building
  KDEs. Classes with < 2 traces are therefore left out of the variance filter.
- A test input whose class has no training trace gets DSA = NaN (the reference crashes).
- The default (``"fixed"``) bucket range is fixed, [0, upper] unless set. The reference's
  ``get_sc`` starts the range at the *test set's* minimum SA, so adding an input can shift every
  bucket and lower the coverage, and two test sets' buckets cannot be united; it also counts all
  values above ``upper`` as one extra bucket. With fixed buckets, coverage only grows as inputs
  are added. A value *below* ``lower`` counts in the first bucket: LSA is negative whenever the
  KDE's density exceeds 1 (tight clusters of training traces, common for LeNets), and such an
  input is the least surprising kind, which is what the first bucket stands for. Dropping those
  values, as this module once did, left LSC at 0 for test sets of unsurprising inputs. Widening
  the range to the observed minimum instead would make the buckets depend on the data again.
  Values above ``upper`` and NaN still cover nothing: ``upper`` is the user's cap on how much
  surprise is worth telling apart. ``"sadl"`` reproduces ``get_sc`` exactly, NaN left out.
"""
from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

VAR_THRESHOLD = 1e-5  # Kim et al.'s default (--var_threshold), also DeepImportance's
#: How SA values map to coverage buckets: "fixed" (:func:`surprise_cells`) or "sadl" (:func:`sadl_surprise_cells`).
BUCKET_RULES = ("fixed", "sadl")
_CHUNK = 512  # most query rows per distance block
#: Most distances in one block (8 MB of float64, two such temporaries at a time): against more
#: than 2,048 references a block has fewer rows, so memory does not grow with the number of
#: training inputs beyond a few thousand (it did up to 10,000 with 40 MB blocks and four temporaries).
_BLOCK_ELEMENTS = _CHUNK * 2_048


def _block_rows(references: int) -> int:
    """Query rows per distance block against ``references`` rows."""
    return max(1, min(_CHUNK, _BLOCK_ELEMENTS // max(references, 1)))


class LikelihoodSurprise:
    """Per-class Gaussian KDEs over training traces; ``score_samples`` gives LSA = -log density.

    Fitted attributes: ``kept_columns_`` (bool mask of neurons kept after the variance filter),
    ``densities_`` (class -> :class:`_ClassDensity`), ``classes_without_density_`` (classes
    seen in training that got no density, see the module docstring).
    """

    def __init__(self, var_threshold: float = VAR_THRESHOLD):
        self.var_threshold = var_threshold

    def fit(self, traces: np.ndarray, classes: np.ndarray) -> "LikelihoodSurprise":
        """One KDE per class (a covariance and its Cholesky factor each: cheap, so always on the host)."""
        traces, classes = _check_traces(traces, classes)
        groups = {int(c): traces[classes == c] for c in np.unique(classes)}
        low_variance = np.zeros(traces.shape[1], dtype=bool)
        for members in groups.values():
            if len(members) >= 2:
                low_variance |= members.var(axis=0) < self.var_threshold
        self.kept_columns_ = ~low_variance
        self.densities_ = {}
        self.classes_without_density_ = []
        for label, members in groups.items():
            density = _ClassDensity.fit(members[:, self.kept_columns_])
            if density is None:
                self.classes_without_density_.append(label)
            else:
                self.densities_[label] = density
        return self

    def score_samples(self, traces: np.ndarray, classes: np.ndarray, device=None) -> np.ndarray:
        """LSA per input (NaN where its class has no density); the densities computed by torch on ``device``
        when given (a GPU, see :mod:`~mlflow_di.coverage.surprise_device`), else by NumPy."""
        traces, classes = _check_traces(traces, classes)
        surprise = np.full(len(traces), np.nan)
        kept = traces[:, self.kept_columns_]
        for label, density in self.densities_.items():
            rows = np.flatnonzero(classes == label)
            if len(rows):
                surprise[rows] = -density.log_density(kept[rows], device)
        return surprise


class _ClassDensity:
    """A Gaussian KDE with scipy.stats.gaussian_kde's bandwidth (Scott's rule), in whitened form."""

    def __init__(self, whitening: np.ndarray, whitened: np.ndarray, log_norm: float):
        self.whitening = whitening  # W with W K W^T = I for the kernel covariance K
        self.whitened = whitened  # training points times W^T, (n, d)
        self.squared_norms = np.einsum("ij,ij->i", whitened, whitened)
        self.log_norm = log_norm  # -log n - log sqrt(det(2 pi K))

    @classmethod
    def fit(cls, points: np.ndarray) -> "_ClassDensity | None":
        """The KDE of ``points`` (n, d), or None when it does not exist (n < 2 or singular covariance)."""
        n, d = points.shape
        if n < 2 or d == 0 or n <= d:
            return None
        factor = n ** (-1.0 / (d + 4))  # scipy's scotts_factor with equal weights
        kernel_cov = np.atleast_2d(np.cov(points, rowvar=False)) * factor**2
        eigenvalues = np.linalg.eigvalsh(kernel_cov)
        if eigenvalues[0] <= eigenvalues[-1] * 1e-12:
            return None  # numerically singular: the KDE would put infinite density on a subspace
        chol = np.linalg.cholesky(kernel_cov)
        whitening = np.linalg.inv(chol)
        log_det = 2.0 * np.log(np.diag(chol)).sum()
        log_norm = -np.log(n) - 0.5 * (d * np.log(2 * np.pi) + log_det)
        return cls(whitening, points @ whitening.T, log_norm)

    def log_density(self, queries: np.ndarray, device=None) -> np.ndarray:
        """The KDE's log density at each query row (by torch on ``device`` when given)."""
        if device is not None:
            from mlflow_di.coverage import surprise_device

            return surprise_device.log_density(queries, self.whitening, self.whitened, self.log_norm, device)
        out = np.empty(len(queries))
        rows = _block_rows(len(self.whitened))
        for start in range(0, len(queries), rows):
            block = queries[start:start + rows] @ self.whitening.T
            squared = _squared_distances(block, self.whitened, self.squared_norms)
            squared *= -0.5
            out[start:start + rows] = logsumexp(squared, axis=1) + self.log_norm
        return out


class DistanceSurprise:
    """Nearest-neighbour distances among training traces; ``score_samples`` gives DSA.

    Fitted attributes: ``traces_`` (n, d) float64, ``classes_`` (n,), ``nearest_other_`` (n,):
    each training trace's distance to the nearest trace of another class (inf when there is no
    other class, making DSA 0).
    """

    def fit(self, traces: np.ndarray, classes: np.ndarray, nearest_other: np.ndarray | None = None,
            progress: bool = False, device=None) -> "DistanceSurprise":
        """Fit; ``nearest_other`` skips the quadratic step when it was saved with the traces, which otherwise
        runs by torch on ``device`` when given (a GPU), else by NumPy."""
        traces, classes = _check_traces(traces, classes)
        self.traces_, self.classes_ = traces, classes
        if nearest_other is None:
            nearest_other = _nearest_other_class_distance(traces, classes, progress, device)
        self.nearest_other_ = np.asarray(nearest_other, dtype=np.float64)
        return self

    def score_samples(self, traces: np.ndarray, classes: np.ndarray, device=None) -> np.ndarray:
        """DSA per input (NaN where its class has no training trace); the nearest neighbours found by torch
        on ``device`` when given (a GPU), else by NumPy."""
        traces, classes = _check_traces(traces, classes)
        surprise = np.full(len(traces), np.nan)
        for label in np.unique(classes):
            members = np.flatnonzero(self.classes_ == label)
            if len(members) == 0:
                continue
            rows = np.flatnonzero(classes == label)
            distance, index = nearest_neighbours(traces[rows], self.traces_[members], device)
            with np.errstate(divide="ignore", invalid="ignore"):
                surprise[rows] = distance / self.nearest_other_[members[index]]
        return surprise


def nearest_neighbours(queries: np.ndarray, references: np.ndarray, device=None) -> tuple[np.ndarray, np.ndarray]:
    """For each query row, the Euclidean distance to and index of its nearest reference row.

    Batched: squared distances as |q|^2 + |r|^2 - 2 q.r in blocks of rows, argmin per row (ties
    go to the lowest index, like ``np.argmin`` in the reference's loop), then the exact distance
    to the winner so cancellation in the expansion cannot leak into the result. With ``device``
    (a GPU) the same in torch there (:mod:`~mlflow_di.coverage.surprise_device`).
    """
    if device is not None:
        from mlflow_di.coverage import surprise_device

        return surprise_device.nearest_neighbours(queries, references, device)
    queries = np.asarray(queries, dtype=np.float64)
    references = np.asarray(references, dtype=np.float64)
    reference_norms = np.einsum("ij,ij->i", references, references)
    index = np.empty(len(queries), dtype=np.int64)
    rows = _block_rows(len(references))
    for start in range(0, len(queries), rows):
        block = queries[start:start + rows]
        index[start:start + rows] = _squared_distances(block, references, reference_norms).argmin(axis=1)
    distance = np.linalg.norm(queries - references[index], axis=1)
    return distance, index


def _nearest_other_class_distance(traces: np.ndarray, classes: np.ndarray, progress: bool, device=None) -> np.ndarray:
    """Each trace's distance to the nearest trace of a different class (inf if none)."""
    from mlflow_di.progress import progress_bar as tqdm

    out = np.full(len(traces), np.inf)
    labels = np.unique(classes)
    for label in tqdm(labels, desc="DSA reference distances", disable=not progress or len(labels) < 2):
        rows, others = np.flatnonzero(classes == label), np.flatnonzero(classes != label)
        if len(others):
            out[rows] = nearest_neighbours(traces[rows], traces[others], device)[0]
    return out


def distance_surprise_naive(test_traces, test_classes, train_traces, train_classes) -> np.ndarray:
    """DSA by the reference's per-input loop (``fetch_dsa`` in Kim et al.'s ``sa.py``).

    Kept as the yardstick for tests and ``benchmarks/bench_criteria.py``; use
    :class:`DistanceSurprise` for real work.
    """
    train_traces = np.asarray(train_traces, dtype=np.float64)
    out = np.full(len(test_traces), np.nan)
    for i, (trace, label) in enumerate(zip(np.asarray(test_traces, np.float64), test_classes)):
        same, other = train_traces[train_classes == label], train_traces[train_classes != label]
        if len(same) == 0:
            continue
        distances = np.linalg.norm(trace - same, axis=1)
        nearest = same[np.argmin(distances)]
        other_distance = np.linalg.norm(nearest - other, axis=1).min() if len(other) else np.inf
        with np.errstate(divide="ignore", invalid="ignore"):
            out[i] = distances.min() / other_distance
    return out


def surprise_cells(values: np.ndarray, lower: float, upper: float, buckets: int = 1000) -> np.ndarray:
    """Surprise coverage cells (buckets,) with fixed buckets: equal slices of [lower, upper] some value falls in.

    Bucket of v: floor((v - lower) / (upper - lower) * buckets), v == upper in the last bucket;
    values below ``lower`` count in the first bucket (the least surprising, see the module
    docstring); values above ``upper`` and NaN cover nothing.
    """
    if not upper > lower:
        raise ValueError(f"surprise bucket range needs upper > lower, got [{lower}, {upper}]")
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    values = np.maximum(values[values <= upper], lower)  # drops NaN too
    index = np.floor((values - lower) / (upper - lower) * buckets).astype(np.int64)
    covered = np.zeros(buckets, dtype=bool)
    covered[np.minimum(index, buckets - 1)] = True
    return covered


def sadl_surprise_cells(values: np.ndarray, upper: float, buckets: int = 1000) -> np.ndarray:
    """Surprise coverage cells (buckets,) by Kim et al.'s rule (``get_sc`` in SADL's ``sa.py``).

    The ``buckets`` bucket edges are ``np.linspace(min(values), upper, buckets)`` and a value's
    bucket is ``np.digitize`` of it minus 1: ``buckets - 1`` equal slices from the set's smallest
    value up to ``upper``, and a last bucket for every value at or above ``upper``. So the cells
    depend on the set's minimum: scores of two sets are merged by recomputing on their values
    together, never by uniting cells. NaN values are left out (``get_sc`` has none: it crashes
    first); when no value is below ``upper``, only the last bucket is covered.
    """
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    values = values[~np.isnan(values)]
    covered = np.zeros(buckets, dtype=bool)
    if len(values) == 0:
        return covered
    lower = float(values.min())
    if lower >= upper:
        covered[-1] = True
        return covered
    index = np.digitize(values, np.linspace(lower, upper, buckets))  # 1..buckets: every value is >= lower
    covered[index - 1] = True
    return covered


def bucket_cells(values: np.ndarray, rule: str, lower: float, upper: float, buckets: int) -> np.ndarray:
    """Surprise coverage cells of ``values`` by the bucket ``rule`` (``lower`` is unused by "sadl")."""
    if rule == "sadl":
        return sadl_surprise_cells(values, upper, buckets)
    if rule == "fixed":
        return surprise_cells(values, lower, upper, buckets)
    raise ValueError(f"unknown surprise bucket rule {rule!r}; choose one of {', '.join(BUCKET_RULES)}")


def _squared_distances(queries: np.ndarray, references: np.ndarray, reference_norms: np.ndarray) -> np.ndarray:
    """|q|^2 + |r|^2 - 2 q.r, clipped at 0, with two (queries, references) temporaries instead of four."""
    squared = np.add.outer(np.einsum("ij,ij->i", queries, queries), reference_norms)
    product = queries @ references.T
    product *= 2.0
    squared -= product
    return np.maximum(squared, 0.0, out=squared)


def _check_traces(traces: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    traces = np.asarray(traces, dtype=np.float64)
    classes = np.asarray(classes).reshape(-1).astype(np.int64)
    if traces.ndim != 2 or len(traces) != len(classes):
        raise ValueError(f"traces must be (inputs, neurons) with one class per input; "
                         f"got {traces.shape}, {classes.shape}")
    return traces, classes
