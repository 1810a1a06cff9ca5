"""Neuron-level coverage criteria (NC, KMNC, NBC, SNAC, TKNC) as pure functions over activations.

Every function takes the activations of a set of inputs as a 2-D array ``values`` of shape
(inputs, neurons) -- a conv layer's neuron is a channel whose value is the spatial mean of its
feature map -- and returns the boolean *cells* that set covers. A criterion's coverage is the
fraction of its cells that are covered; because covering is a union over inputs, the cells of
several test sets combine with ``|`` and adding inputs can never lower a criterion.

Reference: DeepImportance's ``coverages/neuron_cov.py`` (NC), ``coverages/kmn.py`` (KMNC, NBC,
SNAC) and ``coverages/tkn.py`` (TKNC), which follow DeepXplore (Pei et al.) and DeepGauge
(Ma et al.). Where this module departs from that code, the function's docstring says so.
"""
from __future__ import annotations

import numpy as np
import torch

_ROWS = 4096  # inputs per block where a criterion needs per-value temporaries


def nc_scaled_means(output: torch.Tensor) -> torch.Tensor:
    """Per-input min-max scaling of a raw layer output, then the spatial mean per channel.

    ``output`` is one batch, (B, C, H, W) or (B, units); the result is (B, C) or (B, units).
    As in DeepImportance's NC (``default_scale``), each input's whole layer output (all
    channels and positions together) is scaled to [0, 1] *before* the spatial mean.
    Differs: a constant output (max == min) scales to all zeros (no neuron activated); the
    reference divides 0 by 0 and its NaN comparisons likewise activate nothing.

    The scaling is affine per input, so the mean of the scaled map equals the scaled mean of the
    map: computed that way, it costs one min/max pass instead of a scaled copy of the output.
    """
    output = output.detach()
    low, high = torch.aminmax(output.reshape(output.shape[0], -1), dim=1)
    means = output.flatten(2).mean(dim=2) if output.ndim > 2 else output.reshape(output.shape[0], -1)
    low, span = low.double()[:, None], (high.double() - low.double())[:, None]
    scaled = torch.where(span > 0, (means.double() - low) / torch.where(span > 0, span, 1.0), 0.0)
    return scaled.float()


def neuron_coverage_cells(scaled_means: np.ndarray, threshold: float = 0.75) -> np.ndarray:
    """NC cells (neurons,): a neuron is covered when some input's scaled mean exceeds ``threshold``.

    ``scaled_means`` come from :func:`nc_scaled_means`. Strict ``>`` as in the reference.
    """
    scaled_means = _as_2d(scaled_means, "scaled_means")
    return np.any(scaled_means > threshold, axis=0)


def neuron_bounds(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-neuron training [low, high] (DeepGauge's "major function region"): min and max over inputs."""
    values = _as_2d(values, "values")
    if len(values) == 0:
        raise ValueError("neuron bounds need at least one training input")
    return values.min(axis=0).astype(np.float64), values.max(axis=0).astype(np.float64)


def multisection_cells(values: np.ndarray, low: np.ndarray, high: np.ndarray, sections: int = 1000) -> np.ndarray:
    """KMNC cells (neurons, sections): which of each neuron's ``sections`` equal slices of [low, high] are hit.

    Section of value v: floor((v - low) / (high - low) * sections), with v == high in the last one.
    Differs from the reference (``kmn.py``), on purpose: values outside [low, high] cover no
    section (the reference stores their out-of-range section numbers and counts them, which can
    push KMNC above the true fraction), and v == high falls in the last section instead of a
    non-existent section ``sections``. A constant neuron (low == high) has one reachable section,
    0, hit by v == low; the reference puts *every* value of such a neuron in section 0.
    """
    values = _as_2d(values, "values")
    low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
    covered = np.zeros((values.shape[1], sections), dtype=bool)
    width = high - low
    safe_width = np.where(width > 0, width, 1.0)
    for start in range(0, len(values), _ROWS):  # float64/int64 temporaries of a block of inputs, not of all
        block = values[start:start + _ROWS]
        inside = (block >= low) & (block <= high)
        index = np.floor((block - low) / safe_width * sections)
        index = np.clip(np.nan_to_num(index, nan=0.0), 0, sections - 1).astype(np.int64)
        rows, neurons = np.nonzero(inside)
        covered[neurons, index[rows, neurons]] = True
    return covered


def boundary_cells(values: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NBC/SNAC cells: (below, above), each (neurons,): some input's value < low / > high.

    NBC = (below.sum() + above.sum()) / (2 * neurons); SNAC = above.sum() / neurons, exactly as
    in the reference (strict inequalities, the same training bounds).
    """
    values = _as_2d(values, "values")
    return np.any(values < low, axis=0), np.any(values > high, axis=0)


def top_k_cells(values: np.ndarray, layer_sizes: list[int], k: int = 3) -> np.ndarray:
    """TKNC cells (neurons,): a neuron is covered when it is among its layer's ``k`` largest for some input.

    ``values`` holds the layers side by side (columns in ``layer_sizes`` blocks). Ties are broken
    toward the later neuron, as the last ``k`` of a stable ascending ``argsort`` (the reference
    takes the last ``k`` of ``np.argsort``, whose tie order is unspecified). A layer with at most
    ``k`` neurons is entirely covered by any input.
    """
    values = _as_2d(values, "values")
    if sum(layer_sizes) != values.shape[1]:
        raise ValueError(f"layer sizes {layer_sizes} do not add up to {values.shape[1]} neurons")
    covered = np.zeros(values.shape[1], dtype=bool)
    if len(values) == 0:
        return covered
    start = 0
    for size in layer_sizes:
        block = values[:, start:start + size]
        top = np.argsort(block, axis=1, kind="stable")[:, -k:]
        covered[start + np.unique(top)] = True
        start += size
    return covered


def _as_2d(values: np.ndarray, name: str) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (inputs, neurons) array, got shape {values.shape}")
    return values
