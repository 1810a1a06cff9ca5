"""Data specs -> :class:`ImageSet` (raw uint8 NHWC images, int labels, a name).

A data spec is a short string, so that the same words work on the command line, in MLproject
parameters and in Python:

=====================  =====================================================================
``digits``             scikit-learn's bundled 8x8 digits (1,797 images), scaled 0..16 -> 0..255
``mnist-test:DIR``     MNIST's test split: IDX files ``t10k-images-idx3-ubyte[.gz]`` /
                       ``t10k-labels-idx1-ubyte[.gz]`` in DIR (10,000 images); an error if absent
``mnist-train:DIR``    MNIST's training split: ``train-images-idx3-ubyte[.gz]`` /
                       ``train-labels-idx1-ubyte[.gz]`` in DIR (60,000 images); an error if absent
``mnist:DIR``          the test split as ``mnist-test:DIR``, but falling back to the ``train-`` pair
                       when DIR holds no ``t10k-`` pair (the spec's meaning before the two above
                       existed, kept so that old commands and MLproject runs read the same data)
``npz:FILE``           arrays ``x`` (N,H,W[,C], uint8 or floats in 0..1/0..255) and ``y`` (N,)
``folder:DIR``         one sub-folder per class, image files inside (labels: see :func:`folder_labels`)
``cifar10:DIR``        CIFAR-10 python batches (``test_batch`` by default; ``data_batch_*`` if no
                       test batch is there)
=====================  =====================================================================

The papers analyse importance on the training split and measure coverage on the test split, so
write ``mnist-train:`` and ``mnist-test:`` when the split matters: they never substitute one split
for the other, and their errors name the split they looked for.

Each form is a :class:`DataSource` declaration in :data:`SOURCES`; an installed extension adds its
own with :func:`register_source`, and its specs then work wherever a spec is read (every command, the
policy, MLflow's dataset records, the Ray workers).

Any spec may end with ``[start:stop]`` to keep a slice, e.g. ``mnist-train:../shared/data/mnist[0:5000]``.
The slice means what it means in Python: either bound may be left out and negative bounds count
from the end, so ``digits[-50:]`` is the last 50 images and ``digits[:-100]`` all but the last 100.
A step (``[0:10:2]``) is refused: seeds are taken as one contiguous window.
Images are never preprocessed here: models carry their own preprocessing.

Data bigger than memory: ``folder:`` and ``npz:`` sets are read lazily. Their ``ImageSet.images``
is a :class:`LazyImages`, an array-like (``len``, ``shape``, ``dtype``, ``ndim``) whose indexing
(an int, a slice, an index array or a bool mask) reads and decodes just those images and returns
a uint8 NHWC numpy array, so code that slices ``data.images[a:b]`` works unchanged while nothing
holds the whole set; ``ImageSet.subset`` and spec slices stay lazy (they keep a list of
positions); ``ImageSet.batches(n)`` walks the set n images at a time. Only the labels and, for a
folder, the file list are held in memory. Reading a whole lazy set at once (``np.asarray``) is
possible but is what the engines avoid.

- ``folder:DIR`` decodes each batch's files when it is read; an unreadable file is a one-line
  :class:`UserError` naming it at the moment it is reached. Files may differ in size: a model whose
  preprocessing has a raw-image step (``resize``/``center_crop``, see
  :mod:`mlflow_di.models.preprocessing`) resizes each decoded image to its input size
  (``Preprocessing.prepare``); without one, images of another size than the first are refused when
  their batch is read.
- ``npz:FILE`` written by ``np.savez`` (members stored uncompressed) is read per batch at each
  row's byte offset in the file. ``np.load(mmap_mode='r')`` is not used: numpy ignores
  ``mmap_mode`` for ``.npz`` archives, and a memory map would count every page it touched in the
  process's resident memory. ``np.savez_compressed`` members are decompressed as a stream: reading
  forward (batches in order) costs one pass in all, but a read behind the stream's position
  restarts that member's decompression from its start, so random access is slow there; write big
  sets with ``np.savez``. Float pixels (0..1 or 0..255) are checked in one streaming pass at load.
- ``digits``, ``mnist:`` and ``cifar10:`` are small and stay plain in-memory arrays.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import math
import pathlib
import pickle
import re
import struct
import zipfile
import zlib
from typing import Callable, Iterator, Sequence

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.registry import Registry

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


#: Images per read when a caller walks a set without naming a batch size.
BATCH_SIZE = 256
#: Bytes of raw values per read when a whole npz array is scanned (float pixels' range check).
_SCAN_BYTES = 64 * 2**20
MIXED_SIZES_FIX = ("resize the files to one size, or give the model a raw-image step "
                   "(--preprocessing resize=256,center_crop=224)")


class LazyImages:
    """uint8 (N, H, W, C) images read from their source only when indexed.

    Array-like: ``len``, ``shape``, ``dtype`` (uint8), ``ndim`` (4). Indexing with an int, a slice,
    an index array or a bool mask reads (decodes) just those images and returns a numpy array;
    :meth:`select` is the lazy counterpart (a view on some positions, nothing read), and
    :meth:`map` applies a per-image function (e.g. the model's resize) to every image as it is
    read. All images must come out of the same size as the first one.
    """

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, source, positions: np.ndarray | None = None, transform: Callable | None = None,
                 image_shape: tuple[int, int, int] | None = None):
        self._source = source
        self._positions = np.arange(len(source), dtype=np.int64) if positions is None else positions
        self._transform = transform
        self._image_shape = image_shape

    def __len__(self) -> int:
        return len(self._positions)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image: that of the first one (read once) unless a transform declared it."""
        if self._image_shape is None:
            if len(self) == 0:
                raise UserError(f"{self._source.name} selects no images")
            self._image_shape = tuple(self._read(self._positions[:1])[0].shape)
        return self._image_shape

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self), *self.image_shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def _one(self, index) -> np.ndarray:
        return self._positions[[index]] if isinstance(index, (int, np.integer)) else self._positions[index]

    def __getitem__(self, index) -> np.ndarray:
        """The images at ``index`` (int: one (H, W, C) image; slice, index array, bool mask: (n, H, W, C)).

        A tuple index reads the images its first element picks and indexes them with the rest
        (``images[2, 0, 0]``); a leading ``...`` reads every image.
        """
        if isinstance(index, tuple):
            if not index or index[0] is Ellipsis:
                return np.asarray(self)[index]
            picked = self[index[0]]
            return picked[index[1:]] if isinstance(index[0], (int, np.integer)) else picked[(slice(None), *index[1:])]
        images = self._decode(self._one(index))
        return images[0] if isinstance(index, (int, np.integer)) else images

    def select(self, index) -> "LazyImages":
        """The images at ``index`` as another lazy view (nothing is read)."""
        return LazyImages(self._source, self._one(index), self._transform, self._image_shape)

    def map(self, transform: Callable[[np.ndarray], np.ndarray],
            image_shape: tuple[int, int, int] | None = None) -> "LazyImages":
        """These images with ``transform`` (one uint8 (H, W, C) image -> another) applied as each is read."""
        before = self._transform
        composed = transform if before is None else (lambda image: transform(before(image)))
        return LazyImages(self._source, self._positions, composed, image_shape)

    def batches(self, batch_size: int = BATCH_SIZE) -> Iterator[np.ndarray]:
        """The images in order, ``batch_size`` at a time (the last batch may be shorter)."""
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}")
        for start in range(0, len(self), batch_size):
            yield self[start:start + batch_size]

    def __iter__(self) -> Iterator[np.ndarray]:
        for batch in self.batches():
            yield from batch

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """Every image in one array: the whole set in memory (the engines read batches instead)."""
        out = np.empty(self.shape, np.uint8)
        for start, batch in zip(range(0, len(self), BATCH_SIZE), self.batches(BATCH_SIZE)):
            out[start:start + len(batch)] = batch
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyImages({self._source.name}, {len(self)} images)"

    def _read(self, positions: np.ndarray) -> np.ndarray | list[np.ndarray]:
        images = self._source.read(positions)
        if self._transform is not None:
            images = [self._transform(image) for image in images]
        return images

    def _decode(self, positions: np.ndarray) -> np.ndarray:
        images = self._read(positions)
        if isinstance(images, np.ndarray):  # a block of rows, all of one shape already
            return images
        shape = self.image_shape
        for image, position in zip(images, positions):
            if image.shape != shape:
                size = "x".join(map(str, image.shape))
                raise UserError(f"{self._source.describe(position)} is {size} (HxWxC) but the images before it are "
                                f"{'x'.join(map(str, shape))}; {MIXED_SIZES_FIX}")
        return np.stack(images) if images else np.zeros((0, *shape), np.uint8)


@dataclasses.dataclass
class ImageSet:
    """A labelled set of raw images: ``images`` uint8 (N, H, W, C), ``labels`` int64 (N,).

    ``images`` is a numpy array or, for sets read lazily (``folder:``, ``npz:``), a
    :class:`LazyImages`; both slice the same way.
    """

    images: np.ndarray | LazyImages
    labels: np.ndarray
    name: str

    def __post_init__(self):
        if not isinstance(self.images, LazyImages):
            if self.images.ndim == 3:
                self.images = self.images[..., None]
            if self.images.ndim != 4 or self.images.dtype != np.uint8:
                raise UserError(
                    f"data '{self.name}' must be uint8 images of shape (N, H, W, C); "
                    f"got {self.images.dtype} {self.images.shape}"
                )
        self.labels = _class_numbers(self.labels, self.name)
        if len(self.labels) != len(self.images):
            raise UserError(
                f"data '{self.name}' has {len(self.images)} images but {len(self.labels)} labels"
            )

    def __len__(self) -> int:
        return len(self.images)

    def check_labels(self, num_classes: int) -> None:
        """A one-line :class:`UserError` when a label is not one of a model's ``num_classes`` outputs."""
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= num_classes):
            raise UserError(f"data '{self.name}' has labels {int(self.labels.min())}..{int(self.labels.max())} but the "
                            f"model has {num_classes} outputs (classes 0..{num_classes - 1}); use data labelled as the "
                            "model's classes (folder: integer folder names are the labels)")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of one image."""
        return tuple(self.images.shape[1:])

    def subset(self, index, name: str | None = None) -> "ImageSet":
        """Images at ``index`` (slice, int array or bool mask) as a new set (lazy sets stay lazy)."""
        images = self.images.select(index) if isinstance(self.images, LazyImages) else self.images[index]
        return ImageSet(images, self.labels[index], name or self.name)

    @classmethod
    def concatenate(cls, sets: "list[ImageSet]", name: str | None = None) -> "ImageSet":
        """The images of ``sets`` one after another, named ``"a + b"`` unless ``name`` is given.

        Lazy when any set is lazy: each set's images are still read (and transformed) only when indexed.
        """
        if not sets:
            raise UserError("no image sets to put together")
        shapes = {data.image_shape for data in sets}
        if len(shapes) != 1:
            raise UserError(f"cannot put together images of shapes {sorted(shapes)}; give sets of one image size")
        name = name or " + ".join(data.name for data in sets)
        labels = np.concatenate([data.labels for data in sets])
        if not any(isinstance(data.images, LazyImages) for data in sets):
            return cls(np.concatenate([data.images for data in sets]), labels, name)
        return cls(LazyImages(_JoinedSets(sets, name), image_shape=shapes.pop()), labels, name)  # stays lazy

    def split(self, n_first: int) -> tuple["ImageSet", "ImageSet"]:
        """The first ``n_first`` images and the rest, for a deterministic analysis/test split."""
        return (
            self.subset(slice(0, n_first), f"{self.name}[0:{n_first}]"),
            self.subset(slice(n_first, None), f"{self.name}[{n_first}:]"),
        )

    def batches(self, batch_size: int = BATCH_SIZE) -> Iterator[np.ndarray]:
        """The images in order as uint8 arrays of ``batch_size`` (the last may be shorter)."""
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {batch_size}")
        for start in range(0, len(self), batch_size):
            yield self.images[start:start + batch_size]

    def map_images(self, transform: Callable[[np.ndarray], np.ndarray],
                   image_shape: tuple[int, int, int] | None = None) -> "ImageSet":
        """This set with ``transform`` applied to each image as it is read (lazily, also for in-memory sets)."""
        images = self.images if isinstance(self.images, LazyImages) else LazyImages(_ArrayRows(self.images, self.name))
        return ImageSet(images.map(transform, image_shape), self.labels, self.name)


def fingerprint(data: ImageSet, batch_size: int = BATCH_SIZE, progress: bool = False,
                desc: str = "fingerprint") -> str:
    """SHA-256 (hex) of every image's pixels in order, then the labels: the same digest whether
    ``data`` is lazy or in memory, whatever ``batch_size`` (the set is read that many images at a time)."""
    from mlflow_di.progress import progress_bar

    digest = hashlib.sha256()
    for images in progress_bar(data.batches(batch_size), total=-(-len(data) // batch_size), desc=desc,
                               unit="batch", disable=not progress, leave=False):
        digest.update(np.ascontiguousarray(images).tobytes())
    digest.update(np.ascontiguousarray(data.labels).tobytes())
    return digest.hexdigest()


def shared_images(reference: ImageSet, data: ImageSet, batch_size: int = BATCH_SIZE) -> int:
    """How many images of ``data`` also appear in ``reference`` (same pixels), both read in batches.

    What tells evidence measured on held-out images from evidence measured on the calibration set
    when the two specs differ (``digits[0:1300]`` holds ``digits[0:300]``)."""
    seen = {hashlib.blake2b(image.tobytes(), digest_size=16).digest()
            for images in reference.batches(batch_size) for image in np.ascontiguousarray(images)}
    return sum(hashlib.blake2b(image.tobytes(), digest_size=16).digest() in seen
               for images in data.batches(batch_size) for image in np.ascontiguousarray(images))


def is_training_split(spec: str) -> bool:
    """Whether a data spec names a training split by its source (``mnist-train:``; see ``DataSource.training_split``)."""
    source, _ = _source_of(spec.strip())
    return source is not None and source.training_split


class _ArrayRows:
    """An in-memory array as a :class:`LazyImages` source (so a transform applies lazily to it)."""

    def __init__(self, array: np.ndarray, name: str):
        self.array, self.name = array, f"data '{name}'"

    def __len__(self) -> int:
        return len(self.array)

    def read(self, positions: np.ndarray) -> np.ndarray:
        return self.array[positions]

    def describe(self, position: int) -> str:
        return f"image {position} of {self.name}"


class _JoinedSets:
    """The images of several :class:`ImageSet` s one after another, as a :class:`LazyImages` source."""

    def __init__(self, sets: Sequence["ImageSet"], name: str):
        self.sets, self.name = list(sets), f"data '{name}'"
        self.starts = np.cumsum([0] + [len(data) for data in self.sets])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _part(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, positions, side="right") - 1

    def read(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        parts = self._part(positions)
        out = np.empty((len(positions), *self.sets[0].image_shape), np.uint8)
        for part in np.unique(parts):
            rows = parts == part
            out[rows] = self.sets[part].images[positions[rows] - self.starts[part]]
        return out

    def describe(self, position: int) -> str:
        part = int(self._part(np.array([position]))[0])
        return f"image {position - int(self.starts[part])} of data '{self.sets[part].name}'"


class _ImageFiles:
    """Image files, decoded when read (grey files as (H, W, 1), everything else as RGB)."""

    def __init__(self, paths: Sequence[str], folder: str):
        self.paths, self.name = list(paths), f"image folder '{folder}'"

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, positions: np.ndarray) -> list[np.ndarray]:
        images = [_read_image(pathlib.Path(self.paths[position])) for position in positions]
        return [image[..., None] if image.ndim == 2 else image for image in images]

    def describe(self, position: int) -> str:
        return f"image file '{self.paths[position]}'"


class _NpyRows:
    """Rows of one array in an ``.npz`` archive, read on demand (never the whole array).

    A stored member (``np.savez``) is read at each run of rows' byte offset in the file; a
    deflated one (``np.savez_compressed``) through one open decompressing stream, which reads
    forward cheaply and restarts from the member's start for a read behind its position. Float
    or wider integer pixels are turned into uint8 with ``scale`` (see :func:`to_uint8`).
    """

    def __init__(self, path: pathlib.Path, member: str, spec: str):
        self.path, self.member, self.name = path, member, f"npz file '{spec}'"
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(member)
            with archive.open(info) as stream:
                version = np.lib.format.read_magic(stream)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                self.shape, self.fortran_order, self.dtype = read_header(stream)
                header = stream.tell()
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        self.declared_bytes = self.dtype.itemsize * math.prod(self.shape)
        if self.declared_bytes > max(info.file_size - header, 0):  # the zip's own record of what it holds
            raise UserError(f"{self.name}: array '{member.removesuffix('.npy')}' claims shape {self.shape} "
                            f"({self.declared_bytes:,} bytes) but holds {max(info.file_size - header, 0):,}; the file "
                            "is truncated or was not written by numpy.savez, write it again")
        self.stored = info.compress_type == zipfile.ZIP_STORED
        self.data_offset = header + (_local_data_offset(path, info) if self.stored else 0)
        self.scale: float | None = None  # set for non-uint8 pixels once their range is known
        self._stream = None

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty((len(positions), *self.shape[1:]), self.dtype)
        breaks = np.flatnonzero(np.diff(positions) != 1) + 1  # runs of consecutive rows: one read each
        for first, last in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(positions)]])):
            out[first:last] = self.rows(int(positions[first]), int(positions[last - 1]) + 1)
        if self.scale is not None:
            out = np.rint(out.astype(np.float64) * self.scale).astype(np.uint8)
        return out.reshape(len(out), *self.image_shape) if len(self.shape) == 3 else out

    @property
    def image_shape(self) -> tuple[int, ...]:
        return (*self.shape[1:], 1) if len(self.shape) == 3 else tuple(self.shape[1:])

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Raw rows ``start:stop`` in the member's own dtype."""
        count = (stop - start) * self.row_bytes
        offset = self.data_offset + start * self.row_bytes
        try:
            if self.stored:
                with open(self.path, "rb") as handle:
                    handle.seek(offset)
                    raw = handle.read(count)
            else:
                if self._stream is None:
                    self._stream = zipfile.ZipFile(self.path).open(self.member)
                self._stream.seek(offset)
                raw = self._stream.read(count)
        except (OSError, zlib.error, zipfile.BadZipFile, EOFError) as exc:
            raise UserError(f"cannot read {self.name}: {_reason(exc)}; check the file or write it again") from None
        if len(raw) != count:
            raise UserError(f"{self.name} is truncated (array '{self.member}' ends before row {stop}); write it again")
        return np.frombuffer(raw, dtype=self.dtype).reshape(stop - start, *self.shape[1:])

    def describe(self, position: int) -> str:
        return f"image {position} of {self.name}"


def _local_data_offset(path: pathlib.Path, info: zipfile.ZipInfo) -> int:
    """Where a stored zip member's bytes start: after its local header (whose extra field may differ from the central one)."""
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        local = handle.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {info.filename}")
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_length + extra_length


def load_images(spec: str) -> ImageSet:
    """Load the :class:`ImageSet` a data spec names (see the module docstring for the forms)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"empty data spec; give one of: {spec_help()}")
    spec = spec.strip()
    base, window = _split_slice(spec)
    source, arg = _source_of(base)
    if source is None:
        raise UserError(f"unknown data spec '{spec}'; give one of: {spec_help()}")
    if source.argument and not arg:
        what = "a path" if source.argument in ("DIR", "FILE") else source.argument
        raise UserError(f"data spec '{spec}' needs {what} after '{source.name}:' (write {source.form})")
    if not source.argument and arg:
        raise UserError(f"data spec '{source.name}' takes no path (got '{spec}')")
    images, labels = source.load(arg)
    if not isinstance(images, LazyImages):
        images = to_uint8(images, spec)
    data = ImageSet(images, labels, spec)
    if window is not None:
        data = data.subset(slice(*window), spec)
    if len(data) == 0:
        raise UserError(f"data spec '{spec}' selects no images; check the path and the [start:stop] slice")
    return data


@dataclasses.dataclass(frozen=True)
class DataSource:
    """One form of data spec, ``name`` or ``name:ARGUMENT``: what the command line, the policy, MLflow's
    dataset records and the Ray workers all read through :func:`load_images`.

    ``load(argument)`` returns ``(images, labels)``: images as (N, H, W[, C]) uint8, floats in 0..1 or
    0..255 (scaled to uint8 here), or a :class:`LazyImages`; labels as whole class numbers. ``argument``
    names what follows the colon ("DIR", "FILE"), or is None for a source that takes nothing (``digits``).
    ``training_split``: its images are a training split (evidence measured on them is labelled so).
    ``class_names(argument)``: label -> class name where the source knows names, else None.
    """

    name: str
    summary: str
    load: Callable[[str], tuple]
    argument: str | None = "DIR"
    training_split: bool = False
    class_names: Callable[[str], dict[int, str] | None] | None = None

    @property
    def form(self) -> str:
        """How a spec of this source is written: ``mnist-test:DIR``, ``digits``."""
        return f"{self.name}:{self.argument}" if self.argument else self.name


def register_source(source: DataSource) -> DataSource:
    """Declare a data source: its specs work in every command, policy and dataset record at once."""
    return SOURCES.register(source)


def unregister_source(name: str) -> None:
    """Forget a registered source (the built-in ones stay)."""
    SOURCES.unregister(name)


def spec_help() -> str:
    """The declared forms, for help texts and errors: ``digits, mnist-train:DIR, ... or cifar10:DIR, ...``."""
    forms = [source.form for source in SOURCES.values()]
    listed = ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else forms[0]
    return f"{listed}, optionally ending in [start:stop]"


def _source_of(base: str) -> tuple["DataSource | None", str]:
    """The declared source a spec (without its slice) names, and its argument ('' when none). A name not
    declared imports the installed extensions first (once per process): a process the command line did not
    start (a Ray worker, a Python caller) may name an extension's source."""
    name, _, arg = base.partition(":")
    if name not in SOURCES:
        from mlflow_di.extensions import load_extensions

        load_extensions()
    return SOURCES.get(name), arg


def _class_numbers(labels, name: str) -> np.ndarray:
    """Labels as int64 class numbers; a UserError for labels that are not whole numbers (0.5, NaN, text)."""
    values = np.asarray(labels)
    if values.dtype.kind in "iub":
        return values.astype(np.int64, copy=False).reshape(-1)
    if values.dtype.kind == "f":
        flat = values.reshape(-1)
        bad = np.flatnonzero(~np.isfinite(flat) | (flat != np.round(flat)))
        if len(bad):
            raise UserError(f"data '{name}' has label {float(flat[bad[0]])!r} (image {int(bad[0])}); labels are whole class "
                            "numbers (0, 1, 2, ...)")
        return flat.astype(np.int64)
    raise UserError(f"data '{name}' has labels of type {values.dtype}; labels are whole class numbers (0, 1, 2, ...)")


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
    if any(len(bound.lstrip("-")) > 18 for bound in (start, stop)):
        raise UserError(f"the slice of data spec '{base}[...]' has a bound of more than 18 digits; no data set is that "
                        "big (write [start:stop], e.g. [0:5000])")
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


#: MNIST's splits and the prefix of their IDX file names.
MNIST_SPLITS = {"test": "t10k", "train": "train"}


def _mnist_pair(folder: pathlib.Path, split: str) -> tuple[pathlib.Path, pathlib.Path] | None:
    """The (images, labels) IDX files of one MNIST split in ``folder``, or None when either is missing."""
    prefix = MNIST_SPLITS[split]
    images = _find_idx(folder, f"{prefix}-images-idx3-ubyte")
    labels = _find_idx(folder, f"{prefix}-labels-idx1-ubyte")
    return (images, labels) if images and labels else None


def _expected_files(split: str) -> str:
    prefix = MNIST_SPLITS[split]
    return f"{prefix}-images-idx3-ubyte[.gz] and {prefix}-labels-idx1-ubyte[.gz]"


def _load_mnist_split(arg: str, split: str):
    """One MNIST split, strictly: a UserError naming the split and its files when they are absent."""
    folder = _existing(arg, "MNIST folder")
    pair = _mnist_pair(folder, split)
    if pair is None:
        raise UserError(f"no MNIST {split} split in '{arg}'; expected {_expected_files(split)} there")
    return _read_mnist_pair(*pair)


def _load_mnist(arg: str):
    """``mnist:DIR``: the test split, else the training split (the spec's meaning before the strict forms)."""
    folder = _existing(arg, "MNIST folder")
    for split in ("test", "train"):
        pair = _mnist_pair(folder, split)
        if pair is not None:
            return _read_mnist_pair(*pair)
    raise UserError(
        f"no MNIST IDX files in '{arg}'; expected the test split ({_expected_files('test')}) "
        f"or the train split ({_expected_files('train')})"
    )


def _read_mnist_pair(images: pathlib.Path, labels: pathlib.Path):
    """Images and labels of one split; a UserError when their counts differ (files of different splits)."""
    pixels, classes = read_idx(images), read_idx(labels)
    if len(pixels) != len(classes):
        raise UserError(f"'{images.name}' holds {len(pixels)} images but '{labels.name}' {len(classes)} labels; "
                        "the two files come from different splits or downloads, download them again")
    return pixels, classes


def _load_npz(arg: str):
    from mlflow_di.input_files import regular_file

    path = regular_file(arg, "npz file")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        members = {name.removesuffix(".npy") for name in names}
        if not {"x", "y"} <= members:
            raise UserError(f"npz file '{arg}' needs arrays 'x' and 'y'; it has {sorted(members)}")
        images = _NpyRows(path, "x.npy", arg)
        labels_rows = _NpyRows(path, "y.npy", arg)
        whole = [labels_rows] + ([images] if images.fortran_order or images.dtype.hasobject else [])
        _fits_in_memory(whole, arg)  # the arrays read whole, checked on their headers before reading
        with np.load(path, allow_pickle=False) as archive:
            labels = archive["y"]
            if images.fortran_order or images.dtype.hasobject:  # rows not contiguous: read it whole
                return to_uint8(archive["x"], arg), labels
    except (ValueError, OSError, zipfile.BadZipFile, KeyError, EOFError, zlib.error) as exc:
        raise UserError(f"cannot read npz file '{arg}': {_reason(exc)}") from None
    if len(images.shape) not in (3, 4):
        raise UserError(f"data '{arg}' must be images of shape (N, H, W[, C]); got {images.dtype} {images.shape}")
    if images.dtype != np.uint8:
        images.scale = _pixel_scale(*_scan_range(images, arg), arg)
    return LazyImages(images), labels


def _fits_in_memory(arrays: list, name: str) -> None:
    """A UserError, before reading, when an npz array read whole would take more memory than allowed
    (:func:`mlflow_di.input_files.check_allocation`; a zip bomb declares its unpacked size in its header)."""
    from mlflow_di.input_files import check_allocation

    for rows in arrays:
        check_allocation(f"npz file '{name}': array '{rows.member.removesuffix('.npy')}' of shape {rows.shape}",
                         rows.declared_bytes, "split the file" if rows.member == "y.npy" else
                         "store x C-ordered (np.savez) so it is read per batch, or split the file")


def _scan_range(rows: _NpyRows, name: str) -> tuple[float, float]:
    """(min, max) of every value of a numeric npz array, read in chunks; NaN/inf refused."""
    _check_numeric(rows.dtype, len(rows), name)
    step = max(1, _SCAN_BYTES // max(rows.row_bytes, 1))
    low, high = np.inf, -np.inf
    for start in range(0, len(rows), step):
        chunk = rows.rows(start, min(start + step, len(rows)))
        _check_finite(chunk, name)
        low, high = min(low, float(chunk.min())), max(high, float(chunk.max()))
    return low, high


def to_uint8(x: np.ndarray, name: str) -> np.ndarray:
    """Raw pixel values as uint8: uint8 kept, floats in [0, 1] scaled by 255, floats in [0, 255] rounded."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        return x
    _check_numeric(x.dtype, x.size, name)
    x = x.astype(np.float64)
    _check_finite(x, name)
    return np.rint(x * _pixel_scale(float(x.min()), float(x.max()), name)).astype(np.uint8)


def _check_numeric(dtype: np.dtype, size: int, name: str) -> None:
    if size == 0:
        raise UserError(f"data '{name}' is empty")
    if not np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.complexfloating):
        raise UserError(f"data '{name}' must be real numbers (pixel values), got {dtype}")


def _check_finite(x: np.ndarray, name: str) -> None:
    if np.issubdtype(x.dtype, np.inexact) and not np.all(np.isfinite(x)):
        raise UserError(f"data '{name}' contains NaN or infinite values; clean or drop those images")


def _pixel_scale(low: float, high: float, name: str) -> float:
    """255 for values in [0, 1], 1 for values in [0, 255]; a UserError for anything else."""
    if low < 0 or high > 255:
        raise UserError(
            f"data '{name}' has values in [{low:g}, {high:g}]; give raw pixels in 0..255 (or 0..1)"
        )
    return 255.0 if high <= 1.0 else 1.0


def folder_labels(root: pathlib.Path) -> dict[str, int]:
    """Class folder name -> label, the same for every split of a data set whatever classes a split lacks.

    Folders named by integers (``0``, ``1``, ... as MNIST and CIFAR exports write them) are their
    label. Other names are numbered in sorted order over the union of the class folders of ``root``
    and of its sibling splits (``data/train``, ``data/val``, ``data/test``: the folders beside
    ``root`` that share a class name with it), so a test split without ``cat`` still labels ``dog`` as
    the training split does.
    """
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    if names and all(name.isdigit() for name in names):
        return {name: int(name) for name in names}
    union = set(names)
    if root.parent != root:
        for sibling in root.parent.iterdir():
            if sibling != root and sibling.is_dir():
                try:
                    theirs = {p.name for p in sibling.iterdir() if p.is_dir()}
                except OSError:
                    continue
                if theirs & union:
                    union |= theirs
    return {name: label for label, name in enumerate(sorted(union))}


def class_names(spec: str) -> dict[int, str] | None:
    """Label -> class name for a spec whose source knows names (``folder:``: the mapping :func:`folder_labels`
    made); None for other specs, whose labels are numbers already."""
    base, _ = _split_slice(spec.strip()) if isinstance(spec, str) else (None, None)
    source, arg = _source_of(base) if base else (None, "")
    if source is None or source.class_names is None:
        return None
    return source.class_names(arg)


def _folder_class_names(arg: str) -> dict[int, str] | None:
    root = pathlib.Path(arg).expanduser()
    if not root.is_dir():
        return None
    return {label: name for name, label in sorted(folder_labels(root).items(), key=lambda item: item[1])}


def _load_folder(arg: str):
    from mlflow_di.input_files import regular_file

    root = _existing(arg, "image folder")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise UserError(f"image folder '{arg}' has no class sub-folders (expected DIR/<class>/<image>)")
    numbers = folder_labels(root)
    paths, labels = [], []
    for class_dir in classes:
        label = numbers[class_dir.name]
        for file in sorted(class_dir.iterdir()):
            if file.suffix.lower() in _IMAGE_SUFFIXES:
                paths.append(str(regular_file(file, f"image folder '{arg}': the file", "move it out of the folder")))
                labels.append(label)
    if not paths:
        raise UserError(f"image folder '{arg}' holds no image files ({', '.join(sorted(_IMAGE_SUFFIXES))})")
    return LazyImages(_ImageFiles(paths, arg)), np.array(labels)


#: Pixels one image file may have (64 megapixels: 192 MiB decoded as RGB), checked on its header.
MAX_IMAGE_PIXELS = 64_000_000


def _read_image(file: pathlib.Path) -> np.ndarray:
    """One image file as uint8 (H, W) grey or (H, W, 3) RGB; a UserError naming the file if it is unreadable."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as img:  # reads the header only: the size is known before any pixel is decoded
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise UserError(f"image file '{file}' is {width}x{height} pixels, more than {MAX_IMAGE_PIXELS:,} "
                                "(a decompression bomb, or a photo far bigger than a classifier takes); resize it "
                                "or move it out of the folder")
            return np.asarray(img.convert("L" if img.mode in ("L", "1") else "RGB"))
    except Image.DecompressionBombError as exc:
        raise UserError(f"image file '{file}' is too big to decode safely ({_reason(exc)}); resize it or move it "
                        "out of the folder") from None
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


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Reads a pickle that may hold only dicts, lists, bytes, numbers and numpy arrays.

    Unpickling calls whatever the file names, so a crafted "data" file runs code; a CIFAR-10 batch
    needs nothing but the functions numpy uses to rebuild an array, and every other name is refused.
    """

    ALLOWED = {(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
               for name in ("_reconstruct", "scalar")} | {
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"), ("numpy", "ndarray"),
        ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise _RefusedPickle(f"{module}.{name}")


class _RefusedPickle(Exception):
    """A data pickle named something other than an array; nothing of it ran."""


def _read_cifar10_batch(batch: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """(images N×32×32×3, labels N) of one CIFAR-10 python batch; a UserError if it is corrupt or truncated,
    or if it names anything but numpy arrays (see :class:`_ArraysOnlyUnpickler`)."""
    fix = "download and unpack cifar-10-python.tar.gz again"
    try:
        with open(batch, "rb") as handle:
            content = _ArraysOnlyUnpickler(handle, encoding="bytes").load()
    except _RefusedPickle as exc:
        raise UserError(f"CIFAR-10 batch '{batch}' is not plain data: it would call {exc} when read, which a "
                        f"CIFAR-10 batch never does; nothing of it was run; {fix} (or convert it: npz:FILE)") from None
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
    if data.dtype != np.uint8 or not np.issubdtype(labels.dtype, np.integer):
        raise UserError(f"CIFAR-10 batch '{batch}' holds {data.dtype} data and {labels.dtype} labels, "
                        f"not bytes and integers; {fix}")
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise UserError(f"CIFAR-10 batch '{batch}' holds {data.shape} data for {len(labels)} labels, "
                        f"not N×3072 for N labels; {fix}")
    return data.astype(np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


def _mnist_loader(split: str) -> Callable[[str], tuple]:
    return lambda arg: _load_mnist_split(arg, split)


#: The declared data sources, built-ins first (extensions add theirs with :func:`register_source`).
SOURCES = Registry("data source", DataSource, builtins=(
    DataSource("digits", "scikit-learn's bundled 8x8 digits (1,797 images)", _load_digits, argument=None),
    DataSource("mnist-train", "MNIST's training split (IDX files in DIR)", _mnist_loader("train"), training_split=True),
    DataSource("mnist-test", "MNIST's test split (IDX files in DIR)", _mnist_loader("test")),
    DataSource("mnist", "MNIST's test split, else its training split (IDX files in DIR)", _load_mnist),
    DataSource("npz", "arrays x (N,H,W[,C]) and y (N,) of an .npz file, read per batch", _load_npz, argument="FILE"),
    DataSource("folder", "one sub-folder per class, image files inside, read per batch", _load_folder,
               class_names=_folder_class_names),
    DataSource("cifar10", "CIFAR-10 python batches (test_batch, else data_batch_*)", _load_cifar10),
))
