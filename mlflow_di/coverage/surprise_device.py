"""LSA's and DSA's distance work in torch, on the model's GPU.

LSA (a class's KDE log density) and DSA (the nearest training traces) cost a matrix product against every
training trace of an input's class, and DSA's fit one of every training trace against the other classes':
at 50,000 training traces of 512 values that is 1.3e12 multiply-adds, minutes on a few CPU cores and well
under a second on a data-centre GPU. These are :mod:`~mlflow_di.coverage.criteria_surprise`'s blocks
computed by torch in float64 where the model runs, by the same algorithm: squared distances as
|q|^2 + |r|^2 - 2 q.r in blocks of query rows, clipped at 0; the nearest reference by argmin (ties to the
lowest index, as NumPy's); the exact distance to the winner; the KDE's log-sum-exp. Only the order in which
the products are summed differs, so the values agree with the host's to about 1e-15 relative (under 5e-16 in
benchmarks/bench_surprise_device.py; tests allow 1e-12) and a value that close to a surprise bucket's edge
may fall in the neighbouring bucket.
"""
from __future__ import annotations

import numpy as np

#: Most squared distances in one block on the device (128 MB of float64): far more than on the host
#: (criteria_surprise's 8 MB blocks), since a GPU wants few large products, and far below its memory.
DEVICE_BLOCK_ELEMENTS = 2**24
#: Most query rows per block on the device.
_DEVICE_BLOCK_ROWS = 8_192


def block_rows(references: int) -> int:
    """Query rows per distance block against ``references`` rows, on the device."""
    return max(1, min(_DEVICE_BLOCK_ROWS, DEVICE_BLOCK_ELEMENTS // max(references, 1)))


def _on(values, device):
    import torch

    return torch.as_tensor(np.asarray(values, dtype=np.float64), device=device)


def _squared_distances(queries, references, reference_norms):
    """|q|^2 + |r|^2 - 2 q.r, clipped at 0 (criteria_surprise's, in torch)."""
    squared = (queries * queries).sum(dim=1)[:, None] + reference_norms[None, :]
    squared -= 2.0 * (queries @ references.T)
    return squared.clamp_min_(0.0)


def nearest_neighbours(queries, references, device) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~mlflow_di.coverage.criteria_surprise.nearest_neighbours` on ``device``: each query row's
    Euclidean distance to and index of its nearest reference row (NumPy arrays)."""
    import torch

    q, r = _on(queries, device), _on(references, device)
    norms = (r * r).sum(dim=1)
    index = torch.empty(len(q), dtype=torch.int64, device=q.device)
    rows = block_rows(len(r))
    for start in range(0, len(q), rows):
        index[start:start + rows] = _squared_distances(q[start:start + rows], r, norms).argmin(dim=1)
    return (q - r[index]).norm(dim=1).cpu().numpy(), index.cpu().numpy()


def log_density(queries, whitening, whitened, log_norm: float, device) -> np.ndarray:
    """A whitened Gaussian KDE's log density at each query row (``_ClassDensity.log_density``) on ``device``."""
    import torch

    w, points = _on(whitening, device), _on(whitened, device)
    norms = (points * points).sum(dim=1)
    q = _on(queries, device)
    out = torch.empty(len(q), dtype=torch.float64, device=q.device)
    rows = block_rows(len(points))
    for start in range(0, len(q), rows):
        squared = _squared_distances(q[start:start + rows] @ w.T, points, norms)
        out[start:start + rows] = torch.logsumexp(squared.mul_(-0.5), dim=1) + log_norm
    return out.cpu().numpy()
