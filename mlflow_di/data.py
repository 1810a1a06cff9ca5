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
The slice means what it means in Python: either bound may be left out and negative bounds count
from the end, so ``digits[-50:]`` is the last 50 images and ``digits[:-100]`` all but the last 100.
A step (``[0:10:2]``) is refused: seeds are taken as one contiguous window.
Images are never preprocessed here: models carry their own preprocessing.
"""
from __future__ import annotations

import dataclasses
import gzip
import pathlib
import pickle
import re
import zlib

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
        if re.fullmatch(r".*\[\s*-?\d*\s*:\s*-?\d*\s*:\s*-?\d*\s*\]", spec):
            raise UserError(f"data spec '{spec}' has a step in its slice, which is not supported; "
                            "write [start:stop] (e.g. [0:5000] or [-50:] for the last 50)")
        if "[" in spec:
            raise UserError(f"bad slice in data spec '{spec}'; write it as [start:stop], e.g. [0:5000] or [-50:]")
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
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise UserError(f"'{path}' is a corrupt or truncated gzip file ({_reason(exc)}); "
                        "download it again or replace it with the unpacked IDX file") from None
    except OSError as exc:
        raise UserError(f"cannot read '{path}': {_reason(exc)}; check the file and its permissions") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise UserError(f"'{path}' is not an unsigned-byte IDX file; download the MNIST IDX files again")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise UserError(f"IDX file '{path}' is truncated: header says {shape}; download it again")
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
                images.append(_read_image(file))
                labels.append(label)
    if not images:
        raise UserError(f"image folder '{arg}' holds no image files ({', '.join(sorted(_IMAGE_SUFFIXES))})")
    shapes = {im.shape for im in images}
    if len(shapes) != 1:
        raise UserError(f"images in '{arg}' differ in size {sorted(shapes)[:3]}; resize them to one size")
    return np.stack(images), np.array(labels)


def _read_image(file: pathlib.Path) -> np.ndarray:
    """One image file as uint8 (H, W) grey or (H, W, 3) RGB; a UserError naming the file if it is unreadable."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as img:
            return np.asarray(img.convert("L" if img.mode in ("L", "1") else "RGB"))
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        # SyntaxError: Pillow's parsers raise it for some malformed headers (e.g. broken PNG chunks)
        raise UserError(f"image file '{file}' is corrupt or not an image ({_reason(exc)}); "
                        "delete or replace it, or move it out of the folder") from None


def _reason(exc: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _load_cifar10(arg: str):
    folder = _existing(arg, "CIFAR-10 folder")
    batches = [folder / "test_batch"] if (folder / "test_batch").exists() else sorted(folder.glob("data_batch_*"))
    if not batches:
        raise UserError(f"no CIFAR-10 python batches (test_batch or data_batch_*) in '{arg}'")
    images, labels = [], []
    for batch in batches:
        images_part, labels_part = _read_cifar10_batch(batch)
        images.append(images_part)
        labels.append(labels_part)
    return np.concatenate(images), np.concatenate(labels)


def _read_cifar10_batch(batch: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """(images N×32×32×3, labels N) of one CIFAR-10 python batch; a UserError if it is corrupt or truncated."""
    fix = "download and unpack cifar-10-python.tar.gz again"
    try:
        with open(batch, "rb") as handle:
            content = pickle.load(handle, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError,
            IndexError, KeyError, MemoryError, UnicodeDecodeError) as exc:
        raise UserError(f"CIFAR-10 batch '{batch}' is corrupt or truncated ({type(exc).__name__}: "
                        f"{_reason(exc)}); {fix}") from None
    except OSError as exc:
        raise UserError(f"cannot read CIFAR-10 batch '{batch}': {_reason(exc)}; check the file") from None
    if not isinstance(content, dict) or b"data" not in content or b"labels" not in content:
        raise UserError(f"CIFAR-10 batch '{batch}' lacks its data or labels; {fix}")
    data = np.asarray(content[b"data"])
    labels = np.asarray(content[b"labels"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise UserError(f"CIFAR-10 batch '{batch}' holds {data.shape} data for {len(labels)} labels, "
                        f"not N×3072 for N labels; {fix}")
    return data.astype(np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels
