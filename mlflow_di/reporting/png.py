"""PNG encoding and the small pixel helpers every report picture shares.

Every picture function of :mod:`mlflow_di.reporting` returns an RGB ``uint8`` array of shape
(height, width, 3): it can be checked pixel by pixel in tests, logged with ``mlflow.log_image``,
written with :func:`save_png`, or embedded in an HTML report (which encodes it with :func:`to_png`).
"""
from __future__ import annotations

import base64
import functools
import io
import os

import numpy as np
from PIL import Image, ImageFont

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def to_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an RGB (H, W, 3) or grey (H, W) uint8 array."""
    array = np.asarray(rgb)
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)):
        raise ValueError(f"expected a uint8 (H, W), (H, W, 3) or (H, W, 4) array, got {array.dtype} {array.shape}")
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def save_png(rgb: np.ndarray, path: str | os.PathLike) -> None:
    """Write an RGB uint8 array as a PNG file (e.g. before ``mlflow.log_artifact``)."""
    with open(path, "wb") as file:
        file.write(to_png(rgb))


def png_data_uri(png: bytes) -> str:
    """``data:image/png;base64,...`` URI of PNG bytes, so an HTML page needs no separate image file."""
    if not bytes(png[:8]) == PNG_SIGNATURE:
        raise ValueError("not PNG data (missing the PNG signature); encode arrays with to_png first")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def as_png(picture: bytes | np.ndarray) -> bytes:
    """PNG bytes of either PNG bytes (checked) or an RGB uint8 array (encoded)."""
    if isinstance(picture, np.ndarray):
        return to_png(picture)
    png = bytes(picture)
    if png[:8] != PNG_SIGNATURE:
        raise ValueError("not PNG data (missing the PNG signature); pass PNG bytes or an RGB uint8 array")
    return png


def to_rgb_batch(images: np.ndarray, what: str = "images") -> np.ndarray:
    """uint8 NHWC batch with 3 channels from N×H×W, N×H×W×1 or N×H×W×3 uint8 images."""
    array = np.asarray(images)
    if array.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8 (raw pixels), got {array.dtype}")
    if array.ndim == 3:
        array = array[..., None]
    if array.ndim != 4 or array.shape[3] not in (1, 3):
        raise ValueError(f"{what} must be N×H×W×C with C = 1 or 3, got shape {array.shape}")
    return np.repeat(array, 3, axis=3) if array.shape[3] == 1 else array


def upscale_factor(height: int, width: int, target: int = 112) -> int:
    """Integer nearest-neighbour factor that makes the longer side about ``target`` pixels (at least 1)."""
    return max(1, round(target / max(height, width)))


def upscale(image: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour enlargement (every pixel becomes a factor×factor block: no blurring of small digits)."""
    return np.repeat(np.repeat(image, factor, axis=0), factor, axis=1)


@functools.lru_cache(maxsize=8)
def font(size: int = 13, bold: bool = False) -> ImageFont.FreeTypeFont:
    """DejaVu Sans from matplotlib's own font files, so text looks the same on every machine."""
    from matplotlib import font_manager

    properties = font_manager.FontProperties(family="DejaVu Sans", weight="bold" if bold else "normal")
    return ImageFont.truetype(font_manager.findfont(properties, fallback_to_default=True), size)
