"""The corruption catalogue: named image corruptions at severities 1 (mild) to 5 (strong), built
with albumentations.

Each corruption fixes its transform's parameters per severity (point ranges, so severity alone
sets the strength); what stays random (where the noise falls, the motion blur's direction, the
elastic field, where the occluding square sits) is drawn from a generator seeded by
``(seed, corruption, severity, image index)``. The same image at the same position of the data
set is therefore corrupted the same way whatever the batch size, the other corruptions chosen or
the order they run in.

Severities follow Hendrycks & Dietterich (ICLR 2019, ImageNet-C and CIFAR-10-C):

=================  ===========================  =============================================
corruption         albumentations transform     severity 1 .. 5
=================  ===========================  =============================================
``gaussian_noise`` ``GaussNoise``               std 0.08, 0.12, 0.18, 0.26, 0.38 x 255
                                                (ImageNet-C), per channel
``gaussian_blur``  ``GaussianBlur``             sigma 0.4, 0.6, 0.7, 0.8, 1.0 px (CIFAR-10-C)
``motion_blur``    ``MotionBlur``               line kernel 3, 5, 7, 9, 11 px, random direction
``brightness``     ``RandomBrightnessContrast`` + 0.1, 0.2, 0.3, 0.4, 0.5 x 255 (ImageNet-C)
``contrast``       ``RandomBrightnessContrast`` (x - mean) * c + mean, c = 0.4, 0.3, 0.2,
                                                0.1, 0.05 (ImageNet-C; mean of each image)
``jpeg``           ``ImageCompression``         JPEG quality 25, 18, 15, 10, 7 (ImageNet-C)
``elastic``        ``ElasticTransform``         alpha 8, 16, 24, 32, 40 px, sigma 4 px
                                                (Simard et al.'s MNIST distortions: 34 and 4)
``occlusion``      ``CoarseDropout``            one mid-grey (128) square, side 0.2, 0.3, 0.4,
                                                0.5, 0.6 of the image's shorter side
=================  ===========================  =============================================

Pixel sizes (blur sigma, motion kernel, elastic alpha and sigma) are given for 32-pixel images
(CIFAR-10-C's scale) and scale with the image's shorter side, so a 28-pixel MNIST digit and a
224-pixel photo get the same relative corruption; integer sizes stay odd and strictly increase
with the severity. Noise, brightness, contrast and JPEG quality do not depend on the size.
"""
from __future__ import annotations

import dataclasses
import os
import zlib
from typing import Callable, Sequence

import numpy as np

from mlflow_di.errors import UserError

#: Every severity, mildest first.
SEVERITIES = (1, 2, 3, 4, 5)
#: Image side the pixel sizes of the table above are given for.
REFERENCE_SIDE = 32


@dataclasses.dataclass(frozen=True)
class Corruption:
    """One named corruption: which albumentations transform and its keyword arguments per severity.

    ``settings(severity, image_shape)`` returns the transform's keyword arguments (``p=1`` is added
    when it is built); ``what`` says in words what severity changes.
    """

    name: str
    transform: str
    what: str
    settings: Callable[[int, tuple[int, int, int]], dict]

    def build(self, severity: int, image_shape: tuple[int, int, int]):
        """The albumentations transform at ``severity`` for images of ``image_shape`` (H, W, C)."""
        return getattr(_albumentations(), self.transform)(**self.settings(check_severity(severity), image_shape),
                                                          p=1.0)


def _albumentations():
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no network check for a newer version on import
    import albumentations

    return albumentations


def _scale(image_shape) -> float:
    return min(image_shape[0], image_shape[1]) / REFERENCE_SIDE


def _pick(values: Sequence[float], severity: int) -> float:
    return values[severity - 1]


def _odd_sizes(sizes_at_reference: Sequence[float], image_shape) -> list[int]:
    """Odd integer sizes >= 3, scaled to the image and strictly increasing with the severity."""
    sizes: list[int] = []
    for size in sizes_at_reference:
        odd = max(3, 2 * round((size * _scale(image_shape) - 1) / 2) + 1)
        sizes.append(max(odd, sizes[-1] + 2) if sizes else odd)
    return sizes


def _gaussian_noise(severity, image_shape):
    std = _pick((0.08, 0.12, 0.18, 0.26, 0.38), severity)
    return {"std_range": (std, std), "mean_range": (0.0, 0.0), "per_channel": True}


def _gaussian_blur(severity, image_shape):
    sigma = _pick((0.4, 0.6, 0.7, 0.8, 1.0), severity) * _scale(image_shape)
    return {"blur_limit": 0, "sigma_limit": (sigma, sigma)}  # blur_limit 0: kernel size from sigma


def _motion_blur(severity, image_shape):
    size = _pick(_odd_sizes((3, 5, 7, 9, 11), image_shape), severity)
    return {"blur_limit": (size, size), "allow_shifted": False}


def _brightness(severity, image_shape):
    shift = _pick((0.1, 0.2, 0.3, 0.4, 0.5), severity)
    return {"brightness_limit": (shift, shift), "contrast_limit": (0.0, 0.0), "brightness_by_max": True}


def _contrast(severity, image_shape):
    # albumentations computes x * alpha + beta with alpha = 1 + contrast and, when not by max,
    # beta = brightness * mean(x): alpha = c, beta = (1 - c) * mean gives (x - mean) * c + mean
    c = _pick((0.4, 0.3, 0.2, 0.1, 0.05), severity)
    return {"brightness_limit": (1 - c, 1 - c), "contrast_limit": (c - 1, c - 1), "brightness_by_max": False}


def _jpeg(severity, image_shape):
    quality = _pick((25, 18, 15, 10, 7), severity)
    return {"compression_type": "jpeg", "quality_range": (quality, quality)}


def _elastic(severity, image_shape):
    scale = _scale(image_shape)
    return {"alpha": _pick((8, 16, 24, 32, 40), severity) * scale, "sigma": 4 * scale}


def _occlusion(severity, image_shape):
    side = _pick((0.2, 0.3, 0.4, 0.5, 0.6), severity)
    return {"num_holes_range": (1, 1), "hole_height_range": (side, side), "hole_width_range": (side, side),
            "fill": 128}


#: The catalogue, in report order.
CORRUPTIONS: dict[str, Corruption] = {c.name: c for c in (
    Corruption("gaussian_noise", "GaussNoise", "noise std (fraction of 255)", _gaussian_noise),
    Corruption("gaussian_blur", "GaussianBlur", "blur sigma", _gaussian_blur),
    Corruption("motion_blur", "MotionBlur", "motion kernel length", _motion_blur),
    Corruption("brightness", "RandomBrightnessContrast", "brightness added (fraction of 255)", _brightness),
    Corruption("contrast", "RandomBrightnessContrast", "contrast kept around the image mean", _contrast),
    Corruption("jpeg", "ImageCompression", "JPEG quality (lower is stronger)", _jpeg),
    Corruption("elastic", "ElasticTransform", "elastic displacement alpha", _elastic),
    Corruption("occlusion", "CoarseDropout", "occluding square side (fraction)", _occlusion),
)}


def check_severity(severity: int) -> int:
    if severity not in SEVERITIES:
        raise UserError(f"severity {severity!r} is not one of {','.join(map(str, SEVERITIES))}")
    return int(severity)


def check_corruptions(names: Sequence[str] | None) -> tuple[str, ...]:
    """``names`` (None: the whole catalogue) checked against the catalogue, repeats dropped."""
    if names is None:
        return tuple(CORRUPTIONS)
    names = tuple(dict.fromkeys(names))
    unknown = [name for name in names if name not in CORRUPTIONS]
    if unknown or not names:
        raise UserError(f"unknown corruption {', '.join(map(repr, unknown)) or '(none given)'}; choose from: "
                        f"{','.join(CORRUPTIONS)}")
    return names


def image_seed(seed: int, corruption: str, severity: int, index: int) -> int:
    """The seed of one image's corruption: a function of the four values only."""
    entropy = [int(seed) % 2**64, zlib.crc32(corruption.encode()), int(severity), int(index)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


def corrupt(images: np.ndarray, corruption: str, severity: int, indices: Sequence[int] | None = None,
            seed: int = 0, transform=None) -> np.ndarray:
    """``images`` (uint8 N x H x W x C) under ``corruption`` at ``severity``, each seeded by its index.

    ``indices``: each image's position in its data set (default 0..N-1); ``transform``: the built
    transform, when the caller reuses one across batches.
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.dtype != np.uint8:
        raise UserError(f"corruptions take uint8 images (N, H, W, C), got {images.dtype} {images.shape}")
    indices = np.arange(len(images)) if indices is None else np.asarray(indices)
    if len(indices) != len(images):
        raise UserError(f"{len(images)} images but {len(indices)} indices")
    transform = transform or CORRUPTIONS[check_corruptions([corruption])[0]].build(severity, images.shape[1:])
    out = np.empty_like(images)
    for position, (image, index) in enumerate(zip(images, indices)):
        transform.set_random_seed(image_seed(seed, corruption, severity, index))
        out[position] = transform(image=np.ascontiguousarray(image))["image"].reshape(image.shape)
    return out


def describe(corruptions: Sequence[str], severities: Sequence[int], image_shape) -> list[dict]:
    """One row per corruption and severity: the transform and its arguments, for reports."""
    rows = []
    for name in corruptions:
        corruption = CORRUPTIONS[name]
        for severity in severities:
            settings = corruption.settings(severity, image_shape)
            text = ", ".join(f"{key}={_short(value)}" for key, value in settings.items())
            rows.append({"corruption": name, "severity": severity, "transform": corruption.transform,
                         "arguments": text})
    return rows


def _short(value) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_short(v) for v in value) + ")"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
