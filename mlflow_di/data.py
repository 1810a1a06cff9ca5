"""Data specs -> :class:`ImageSet` (raw uint8 NHWC images, int labels, a name).

A data spec is a short string, so that the same words work on the command line, in MLproject
parameters and in Python:

=====================  =====================================================================
``digits``             scikit-learn's bundled 8x8 digits (1,797 images), scaled 0..16 -> 0..255
``mnist:DIR``          IDX files ``t10k-images-idx3-ubyte[.gz]`` / ``t10k-labels-idx1-ubyte[.gz]``
                       (or the ``train-`` pair) in DIR
``npz:FILE``           arrays ``x`` (N,H,W[,C], uint8 or floats in 0..1/0..255) and ``y`` (N,)
``folder:DIR``         one sub-folder per class (sorted names -> labels 0..K-1), image files inside
``cifar10:DIR``        CIFAR-10 python batches (``test_batch`` by default; ``data_batch_*`` if no
                       test batch is there)
=====================  =====================================================================

Any spec may end with ``[start:stop]`` to keep a slice, e.g. ``mnist:../shared/data/mnist[0:5000]``.
Images are never preprocessed here: models carry their own preprocessing.
"""
from __future__ import annotations

import dataclasses
import gzip
import pathlib
import pickle
import re

import numpy as np

from mlflow_di.errors import UserError

SPEC_HELP = "digits, mnist:DIR, npz:FILE, folder:DIR or cifar10:DIR, optionally ending in [start:stop]"
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


@dataclasses.dataclass
class ImageSet:
    """A labelled set of raw images: ``images`` uint8 (N, H, W, C), ``labels`` int64 (N,)."""

    images: np.ndarray
    labels: np.ndarray
    name: str

    def __post_init__(self):
        if self.images.ndim == 3:
            self.images = self.images[..., None]
        if self.images.ndim != 4 or self.images.dtype != np.uint8:
            raise UserError(
                f"data '{self.name}' must be uint8 images of shape (N, H, W, C); "
                f"got {self.images.dtype} {self.images.shape}"
            )
        self.labels = np.asarray(self.labels, dtype=np.int64).reshape(-1)
        if len(self.labels) != len(self.images):
            raise UserError(
                f"data '{self.name}' has {len(self.images)} images but {len(self.labels)} labels"
            )

    def __len__(self) -> int:
        return len(self.images)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of one image."""
        return tuple(self.images.shape[1:])

    def subset(self, index, name: str | None = None) -> "ImageSet":
        """Images at ``index`` (slice, int array or bool mask) as a new set."""
        return ImageSet(self.images[index], self.labels[index], name or self.name)

    def split(self, n_first: int) -> tuple["ImageSet", "ImageSet"]:
        """The first ``n_first`` images and the rest, for a deterministic analysis/test split."""
        return (
            self.subset(slice(0, n_first), f"{self.name}[0:{n_first}]"),
            self.subset(slice(n_first, None), f"{self.name}[{n_first}:]"),
        )


def load_images(spec: str) -> ImageSet:
    """Load the :class:`ImageSet` a data spec names (see the module docstring for the forms)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"empty data spec; give one of: {SPEC_HELP}")
    spec = spec.strip()
    base, window = _split_slice(spec)
    kind, _, arg = base.partition(":")
    loaders = {"digits": _load_digits, "mnist": _load_mnist, "npz": _load_npz,
               "folder": _load_folder, "cifar10": _load_cifar10}
    if kind not in loaders:
        raise UserError(f"unknown data spec '{spec}'; give one of: {SPEC_HELP}")
    if kind != "digits" and not arg:
        raise UserError(f"data spec '{spec}' needs a path after '{kind}:'")
    if kind == "digits" and arg:
        raise UserError(f"data spec 'digits' takes no path (got '{spec}')")
    images, labels = loaders[kind](arg)
    data = ImageSet(images, labels, spec)
    if window is not None:
        data = data.subset(slice(*window), spec)
    if len(data) == 0:
        raise UserError(f"data spec '{spec}' selects no images; check the path and the [start:stop] slice")
    return data


def _split_slice(spec: str) -> tuple[str, tuple[int | None, int | None] | None]:
    match = re.fullmatch(r"(.*)\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\]", spec)
    if not match:
        if "[" in spec:
            raise UserError(f"bad slice in data spec '{spec}'; write it as [start:stop], e.g. [0:5000]")
        return spec, None
    base, start, stop = match.groups()
    return base, (int(start) if start else None, int(stop) if stop else None)


def _existing(path: str, what: str) -> pathlib.Path:
    resolved = pathlib.Path(path).expanduser()
    if not resolved.exists():
        raise UserError(f"{what} '{path}' does not exist")
    return resolved


def _load_digits(_arg: str):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 -> 0..255
    return images[..., None], bunch.target


def read_idx(path: pathlib.Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped) into a uint8 array of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise UserError(f"'{path}' is not an unsigned-byte IDX file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise UserError(f"IDX file '{path}' is truncated: header says {shape}")
    return data.reshape(shape)


def _find_idx(folder: pathlib.Path, stem: str) -> pathlib.Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).exists():
            return folder / name
    return None


def _load_mnist(arg: str):
    folder = _existing(arg, "MNIST folder")
    for prefix in ("t10k", "train"):
        images = _find_idx(folder, f"{prefix}-images-idx3-ubyte")
        labels = _find_idx(folder, f"{prefix}-labels-idx1-ubyte")
        if images and labels:
            return read_idx(images), read_idx(labels)
    raise UserError(
        f"no MNIST IDX files in '{arg}'; expected t10k-images-idx3-ubyte[.gz] and "
        "t10k-labels-idx1-ubyte[.gz] (or the train- pair)"
    )


def _load_npz(arg: str):
    path = _existing(arg, "npz file")
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read npz file '{arg}': {exc}") from None
    missing = {"x", "y"} - set(archive.files)
    if missing:
        raise UserError(f"npz file '{arg}' needs arrays 'x' and 'y'; it has {sorted(archive.files)}")
    return to_uint8(archive["x"], arg), archive["y"]


def to_uint8(x: np.ndarray, name: str) -> np.ndarray:
    """Raw pixel values as uint8: uint8 kept, floats in [0, 1] scaled by 255, floats in [0, 255] rounded."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        return x
    if x.size == 0:
        raise UserError(f"data '{name}' is empty")
    if not np.issubdtype(x.dtype, np.number):
        raise UserError(f"data '{name}' must be numeric, got {x.dtype}")
    x = x.astype(np.float64)
    if not np.all(np.isfinite(x)):
        raise UserError(f"data '{name}' contains NaN or infinite values; clean or drop those images")
    low, high = float(x.min()), float(x.max())
    if low < 0 or high > 255:
        raise UserError(
            f"data '{name}' has values in [{low:g}, {high:g}]; give raw pixels in 0..255 (or 0..1)"
        )
    if high <= 1.0:
        x = x * 255.0
    return np.rint(x).astype(np.uint8)


def _load_folder(arg: str):
    from PIL import Image

    root = _existing(arg, "image folder")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise UserError(f"image folder '{arg}' has no class sub-folders (expected DIR/<class>/<image>)")
    images, labels = [], []
    for label, class_dir in enumerate(classes):
        for file in sorted(class_dir.iterdir()):
            if file.suffix.lower() in _IMAGE_SUFFIXES:
                with Image.open(file) as img:
                    images.append(np.asarray(img.convert("L" if img.mode in ("L", "1") else "RGB")))
                labels.append(label)
    if not images:
        raise UserError(f"image folder '{arg}' holds no image files ({', '.join(sorted(_IMAGE_SUFFIXES))})")
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise UserError(f"images in '{arg}' differ in size {sorted(shapes)[:3]}; resize them to one size")
    return np.stack(images), np.array(labels)


def _load_cifar10(arg: str):
    folder = _existing(arg, "CIFAR-10 folder")
    batches = [folder / "test_batch"] if (folder / "test_batch").exists() else sorted(folder.glob("data_batch_*"))
    if not batches:
        raise UserError(f"no CIFAR-10 python batches (test_batch or data_batch_*) in '{arg}'")
    images, labels = [], []
    for batch in batches:
        with open(batch, "rb") as handle:
            content = pickle.load(handle, encoding="bytes")
        images.append(np.asarray(content[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.append(np.asarray(content[b"labels"]))
    return np.concatenate(images), np.concatenate(labels)
