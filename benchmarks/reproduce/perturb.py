"""Image perturbations of the IDC paper's experiments, on raw uint8 images (N, H, W, C).

Which pixels: the most relevant ones by input-pixel LRP (``relevant_pixel_mask``: relevance
magnitude above the image's (1 - fraction) percentile, so at most ``fraction`` of the pixels, as
DeepImportance's ``find_relevant_pixels``), or as many random pixels among the others
(``random_pixel_mask``, as its ``add_wn_random``). How: pixel flipping (bright -> 0, dark -> 255,
its Table 2 script) or Gaussian noise, clipped to 0..255 and rounded back to uint8.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.coverage.activations import PreprocessedImages
from mlflow_di.coverage.relevance import input_relevance


def relevant_pixel_mask(torch_model, images: np.ndarray, fraction: float, batch_size: int = 256) -> np.ndarray:
    """Bool (N, H, W): per image, pixels whose |LRP relevance| (summed over channels) exceeds its
    (1 - fraction) percentile. The relevance explains each input's predicted class."""
    relevance = input_relevance(torch_model.module, PreprocessedImages(images, torch_model.preprocessing),
                                batch_size=batch_size, progress=False)
    channel_axis = 1 if torch_model.preprocessing.layout == "NCHW" else 3
    magnitude = np.abs(relevance).sum(axis=channel_axis)
    thresholds = np.percentile(magnitude.reshape(len(magnitude), -1), 100.0 * (1.0 - fraction), axis=1)
    return magnitude > thresholds[:, None, None]


def random_pixel_mask(relevant: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Bool (N, H, W): per image, as many pixels as ``relevant`` marks, drawn among the unmarked ones."""
    mask = np.zeros_like(relevant)
    flat_relevant = relevant.reshape(len(relevant), -1)
    flat_mask = mask.reshape(len(mask), -1)
    for row, marked in enumerate(flat_relevant):
        others = np.flatnonzero(~marked)
        chosen = rng.choice(others, size=min(int(marked.sum()), len(others)), replace=False)
        flat_mask[row, chosen] = True
    return mask


def flip_pixels(images: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Pixel flipping on the masked pixels: values above 127.5 become 0, the others 255."""
    flipped = images.copy()
    where = np.broadcast_to(mask[..., None], images.shape)
    flipped[where] = np.where(images[where] > 127.5, 0, 255).astype(np.uint8)
    return flipped


def gaussian_on_pixels(images: np.ndarray, mask: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """Add N(0, std) noise (one draw per masked pixel and channel), clip to 0..255, round to uint8."""
    noise = rng.normal(0.0, std, size=images.shape) * mask[..., None]
    return _to_uint8(images.astype(np.float64) + noise)


def gaussian_all(images: np.ndarray, std: float, rng: np.random.Generator) -> np.ndarray:
    """Add N(0, std) noise to every pixel (DeepImportance's ``add_wn_all``), clip, round to uint8."""
    return _to_uint8(images.astype(np.float64) + rng.normal(0.0, std, size=images.shape))


def _to_uint8(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)
