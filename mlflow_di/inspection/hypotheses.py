"""Hypothesis functions: what a model's hidden units might respond to (DeepBase, Sellam et al. 2019).

A hypothesis is a plain callable from a batch of raw images (uint8 N x H x W x C, as the data
specs give them) and their labels to either

* one value per input (``kind="value"``, shape (N,)): "amount of ink", "the digit has a closed
  loop", "the class is 7"; or
* one value per pixel (``kind="mask"``, shape (N, H, W)): "this pixel is ink", "this pixel is on
  an edge". A conv channel is then compared with the mask position by position (the mask
  averaged down to the feature map's size); a dense unit, which has no positions, with the
  mask's mean per input.

Hypotheses see raw pixels, never the model's preprocessing, so the same hypothesis means the
same thing for every model. The built-in ones are written for grey digits (MNIST, digits) but
work on any image (colour images are averaged to grey first). A user's own come from a module
path: ``--hypotheses mymodule:HYPOTHESES`` names a list of :class:`Hypothesis` or a dict of
name -> callable (callables are value hypotheses).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy import ndimage

from mlflow_di.errors import UserError

KINDS = ("value", "mask")

#: A pixel is "ink" when its grey level is above this fraction of the image's brightest pixel.
INK_THRESHOLD = 0.5


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """A named function of (images, labels) and whether it gives one value per input or per pixel."""

    name: str
    function: Callable[[np.ndarray, np.ndarray], np.ndarray]
    kind: str = "value"
    description: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UserError(f"hypothesis '{self.name}': kind must be one of {', '.join(KINDS)}, got '{self.kind}'")

    def __call__(self, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The hypothesis on one batch, checked: float64 (N,) for a value, (N, H, W) for a mask."""
        try:
            values = np.asarray(self.function(images, labels), dtype=np.float64)
        except UserError:
            raise
        except Exception as exc:  # a user's function failing is their input, not our crash
            raise UserError(f"hypothesis '{self.name}' failed on a batch: {type(exc).__name__}: {exc}") from exc
        expected = (len(images),) if self.kind == "value" else tuple(np.shape(images)[:3])
        if values.shape != expected:
            raise UserError(f"hypothesis '{self.name}' ({self.kind}) returned shape {values.shape}, expected {expected}")
        if not np.all(np.isfinite(values)):
            raise UserError(f"hypothesis '{self.name}' returned NaN or infinite values; return finite numbers")
        return values


# ------------------------------------------------------------------------------ image helpers
def grey(images: np.ndarray) -> np.ndarray:
    """Float grey levels in [0, 1], shape (N, H, W), from uint8 N x H x W [x C] images."""
    images = np.asarray(images, dtype=np.float64)
    if images.ndim == 4:
        images = images.mean(axis=3)
    return images / 255.0


def ink_mask(images: np.ndarray) -> np.ndarray:
    """Boolean (N, H, W): pixels brighter than :data:`INK_THRESHOLD` of each image's brightest pixel."""
    levels = grey(images)
    peak = levels.reshape(len(levels), -1).max(axis=1)[:, None, None]
    return levels > INK_THRESHOLD * np.maximum(peak, 1e-12)


def _edge_magnitude(levels: np.ndarray) -> np.ndarray:
    """Sobel gradient magnitude of each (H, W) grey image."""
    return np.hypot(ndimage.sobel(levels, axis=1), ndimage.sobel(levels, axis=2))


def _edge_mask(images, _labels) -> np.ndarray:
    magnitude = _edge_magnitude(grey(images))
    return magnitude > 0.5 * np.maximum(magnitude.reshape(len(magnitude), -1).max(axis=1), 1e-12)[:, None, None]


def _ink(images, _labels) -> np.ndarray:
    return grey(images).mean(axis=(1, 2))


def _contrast(images, _labels) -> np.ndarray:
    return grey(images).std(axis=(1, 2))


def _edge_density(images, labels) -> np.ndarray:
    return _edge_mask(images, labels).mean(axis=(1, 2))


def _centre_of_mass(axis: int) -> Callable:
    def centre(images, _labels):
        levels = grey(images)
        size = levels.shape[axis]
        weights = levels.sum(axis=3 - axis)  # axis 1 (rows): sum over columns; axis 2: over rows
        total = np.maximum(weights.sum(axis=1), 1e-12)
        return (weights * np.arange(size)).sum(axis=1) / total / max(size - 1, 1)

    return centre


def _stroke_thickness(images, _labels) -> np.ndarray:
    """Mean stroke width in pixels: twice the mean distance to the background over the ink's ridge pixels.

    A ridge pixel is a local maximum of the distance transform (its 3x3 neighbourhood), so the
    value is the width at the stroke's centre line, not its area.
    """
    out = np.zeros(len(images))
    for i, ink in enumerate(ink_mask(images)):
        if not ink.any():
            continue
        distance = ndimage.distance_transform_edt(ink)
        ridge = ink & (distance >= ndimage.maximum_filter(distance, size=3))
        out[i] = 2.0 * distance[ridge].mean()
    return out


def _components(images, _labels) -> np.ndarray:
    """Connected pieces of ink (8-connectivity)."""
    return np.array([ndimage.label(ink, structure=np.ones((3, 3)))[1] for ink in ink_mask(images)], dtype=np.float64)


def _closed_loops(images, _labels) -> np.ndarray:
    """Holes in the ink: background regions (4-connectivity) that do not touch the image border (0, 8 has 2)."""
    out = np.zeros(len(images))
    for i, ink in enumerate(ink_mask(images)):
        regions, count = ndimage.label(~ink)
        border = np.unique(np.concatenate([regions[0], regions[-1], regions[:, 0], regions[:, -1]]))
        out[i] = count - np.count_nonzero(border)
    return out


def class_indicator(label: int) -> Hypothesis:
    """1 where the input's true label is ``label``, else 0."""
    return Hypothesis(f"class_{label}", lambda _images, labels: (np.asarray(labels) == label).astype(np.float64),
                      description=f"the input's label is {label}")


IMAGE_HYPOTHESES = (
    Hypothesis("ink", _ink, description="mean grey level (amount of ink)"),
    Hypothesis("contrast", _contrast, description="standard deviation of the grey levels"),
    Hypothesis("edge_density", _edge_density, description="share of pixels on a strong Sobel edge"),
    Hypothesis("centre_x", _centre_of_mass(2), description="horizontal centre of mass (0 left, 1 right)"),
    Hypothesis("centre_y", _centre_of_mass(1), description="vertical centre of mass (0 top, 1 bottom)"),
    Hypothesis("stroke_thickness", _stroke_thickness, description="mean stroke width in pixels"),
    Hypothesis("components", _components, description="connected pieces of ink"),
    Hypothesis("closed_loops", _closed_loops, description="holes enclosed by ink (0 has 1, 8 has 2)"),
    Hypothesis("ink_mask", lambda images, _labels: ink_mask(images), kind="mask", description="this pixel is ink"),
    Hypothesis("edge_mask", _edge_mask, kind="mask", description="this pixel is on a strong edge"),
)


def builtin_hypotheses(classes: Sequence[int] = ()) -> list[Hypothesis]:
    """One indicator per class in ``classes``, then the image hypotheses."""
    return [class_indicator(int(c)) for c in classes] + list(IMAGE_HYPOTHESES)


def load_hypotheses(spec: str) -> list[Hypothesis]:
    """The hypotheses a ``module:ATTRIBUTE`` spec names: a list of :class:`Hypothesis` or a dict name -> callable."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UserError(f"--hypotheses '{spec}' is not MODULE:ATTRIBUTE, e.g. mymodule:HYPOTHESES")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import hypothesis module '{module_name}' ({exc}); put it on PYTHONPATH") from None
    if not hasattr(module, attribute):
        raise UserError(f"module '{module_name}' has no attribute '{attribute}'")
    value = getattr(module, attribute)
    if isinstance(value, Mapping):
        value = [item if isinstance(item, Hypothesis) else Hypothesis(str(name), item) for name, item in value.items()]
    if not isinstance(value, (list, tuple)) or not value:
        raise UserError(f"'{spec}' must be a non-empty list of Hypothesis or a dict of name -> callable")
    for item in value:
        if not isinstance(item, Hypothesis):
            raise UserError(f"'{spec}' holds {type(item).__name__}, not mlflow_di.inspection.Hypothesis")
    return list(value)


def check_unique(hypotheses: Sequence[Hypothesis]) -> None:
    """Two hypotheses with one name would overwrite each other's scores."""
    names = [h.name for h in hypotheses]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise UserError(f"hypothesis names must be unique; repeated: {', '.join(duplicated)}")
