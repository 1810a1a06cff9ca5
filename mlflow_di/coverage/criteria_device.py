"""NC, KMNC, NBC/SNAC and TKNC cells computed where the activations are (a GPU), batch by batch.

The functions of :mod:`mlflow_di.coverage.criteria_neuron` take NumPy arrays, so on a GPU every
batch's neuron values had to travel to the host before a criterion could read them, and the
host then worked through the criteria (KMNC's sections and TKNC's sorts) while the GPU waited (what
each side costs: ``benchmarks/bench_criteria_cells``, benchmarks/RESULTS.md).
These are the same criteria in torch, for tensors on any device: each gives the cells one batch
covers, and since covering is a union over inputs, the cells of the batches ``|``-ed together are
the cells of the whole set. :class:`~mlflow_di.coverage.criteria.DeviceCells` runs them during a
scoring pass on a CUDA model.

Each function gives exactly the cells of its NumPy twin for the same float32 values (the tests
compare them on random, tied, constant, out-of-range and non-finite values): the comparisons and
KMNC's section arithmetic run in the dtypes NumPy's promotion picks (float64 against the float64
training bounds), ties among TKNC's largest values go to the later neuron as a stable sort's do,
and a NaN sorts as the largest value, as in NumPy. Nothing here waits for the device: no
boolean indexing, no ``.item()``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def neuron_coverage_cells(scaled_means: torch.Tensor, threshold: float) -> torch.Tensor:
    """NC cells (neurons,) of one batch: some input's scaled mean > ``threshold`` (compared in the
    dtype NumPy compares a float32 array with ``threshold`` in: float32 for a Python float)."""
    dtype = torch.float64 if np.result_type(np.float32, threshold) == np.float64 else torch.float32
    limit = torch.tensor(float(threshold), dtype=dtype, device=scaled_means.device)
    return (scaled_means.to(dtype) > limit).any(dim=0)


def multisection_cells(values: torch.Tensor, low: torch.Tensor, high: torch.Tensor, sections: int) -> torch.Tensor:
    """KMNC cells (neurons, sections) of one batch; ``low``/``high`` are the float64 training bounds
    on the values' device. Values outside [low, high] (NaN included) cover no section."""
    values = values.double()
    inside = (values >= low) & (values <= high)
    width = high - low
    safe_width = torch.where(width > 0, width, torch.ones_like(width))
    index = torch.floor((values - low) / safe_width * sections)
    index = torch.nan_to_num(index, nan=0.0).clamp(0, sections - 1).long()
    # an outside value lands in an extra column that is dropped: no boolean indexing, no wait for the device
    column = torch.where(inside, index, torch.full_like(index, sections))
    covered = torch.zeros((values.shape[1], sections + 1), dtype=torch.bool, device=values.device)
    covered.scatter_(1, column.T, True)
    return covered[:, :sections]


def boundary_cells(values: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NBC/SNAC cells of one batch: (below, above), each (neurons,): some value < low / > high."""
    values = values.double()
    return (values < low).any(dim=0), (values > high).any(dim=0)


def top_k_cells(values: torch.Tensor, layer_sizes: Sequence[int], k: int) -> torch.Tensor:
    """TKNC cells (neurons,) of one batch: the ``k`` largest of each layer per input, ties toward the
    later neuron (the last ``k`` of a stable ascending sort, as the NumPy twin takes them)."""
    covered = torch.zeros(values.shape[1], dtype=torch.bool, device=values.device)
    start = 0
    for size in layer_sizes:
        top = torch.sort(values[:, start:start + size], dim=1, stable=True).indices[:, -k:]
        covered[start:start + size].scatter_(0, top.reshape(-1), True)
        start += size
    return covered
