"""Image mutation operators of DFlare, on raw uint8 (H, W, C) images.

Every operator takes one raw image and a seeded ``np.random.Generator`` and returns a new
image of the same shape and dtype (the input is never modified). DFlare's own operators also
write it into ``out=`` when given (:func:`mutate_into`: a campaign passes a row of its batch).
Parameters are sampled from the generator the caller passes, so the same generator state always
gives the same mutant, and a campaign is reproducible from its seed.

Parameter ranges follow the DFlare reference code (``myLib/img_mutations.py``):

=====================  ==================================================================
``gaussian_noise``     add N(0, sigma) per value, sigma = sqrt(0.1) ~ 0.32 on the 0..255 scale
``salt_and_pepper``    ceil(0.004 * size / 2) values set to 255 and as many to 0
``multiplicative``     img + img * N(mean, sqrt(var)), mean ~ U[-0.5, 0.5), var ~ U[0, 0.05)
``pixel_change``       n ~ U{0..9} random values set to random levels 0..255
``average_blur``       box filter, k ~ U{1, 2, 3, 4, 5}
``gaussian_blur``      Gaussian filter, k ~ U{1, 3, 5, 7}, sigma derived from k (OpenCV)
``median_blur``        median filter, k ~ U{1, 3, 5, 7}
=====================  ==================================================================

Arithmetic operators compute in float, round to the nearest level, clip to 0..255 and only
then cast to uint8, so values saturate instead of wrapping around. (The reference casts to
uint8 before clipping and truncates: 300 became 44 and -1 became 255, and its Gaussian noise
darkened about half the pixels by one level. Rounding keeps the noise unbiased.)

The filters call OpenCV directly (the library albumentations' blur functions wrap); the noise
operators are a few lines of NumPy with parameters drawn from the caller's generator, which
albumentations' transforms would draw from their own random state.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import cv2
import numpy as np

from mlflow_di.fuzz._random import draw_index

#: Number of channels OpenCV's median filter accepts in one call.
_MEDIAN_CHANNELS = (1, 3, 4)
#: Kernel sizes OpenCV's median filter also accepts on float32 images.
_FLOAT_MEDIAN_KERNELS = (3, 5)
#: Images with at most this many values take the float32 median (faster on MNIST sizes); larger ones
#: the uint8 one (faster at 224x224x3; benchmarks/RESULTS.md). Both give the same image.
_FLOAT_MEDIAN_MAX_VALUES = 4096


def _saturate(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Float32 pixel values -> uint8, rounded half to even and clipped to 0..255 (never wrapping),
    written into ``out`` when given.

    One OpenCV pass (its saturating cast rounds like ``np.rint``); the same bytes as
    ``np.clip(np.rint(values), 0, 255).astype(np.uint8)`` in a quarter of the time at 224x224x3.
    """
    flat = values.reshape(values.shape[0], -1)  # one channel per cv2 value: any channel count works
    if out is None:
        return cv2.add(flat, 0.0, dtype=cv2.CV_8U).reshape(values.shape)
    return _written(cv2.add(flat, 0.0, dst=out.reshape(flat.shape), dtype=cv2.CV_8U), out)


def _written(result: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out``, holding ``result``: OpenCV writes into a destination of the right size and type (then
    ``result`` is that memory); should it allocate a new array instead, its values are copied over."""
    if not np.shares_memory(result, out):
        np.copyto(out, result.reshape(out.shape))
    return out


def copied(image: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """A new copy of ``image``, or ``image`` copied into ``out``."""
    if out is None:
        return image.copy()
    np.copyto(out, image)
    return out


def _with_channel_axis(filtered: np.ndarray, like: np.ndarray) -> np.ndarray:
    """OpenCV drops a trailing channel axis of size 1; put it back."""
    return filtered.reshape(like.shape)


def _opencv_view(out: np.ndarray) -> np.ndarray:
    """``out`` (H, W, C) as OpenCV sees such an image: (H, W) for one channel (its filters return that)."""
    return out.reshape(out.shape[:2]) if out.shape[2] == 1 else out


#: Values compared first when a mutant is tested for being its source unchanged: noise and blurs change
#: some of them, so most mutants are told apart without reading the whole image.
_HEAD_VALUES = 1024


def same_image(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two images are equal value for value: their first :data:`_HEAD_VALUES` values, then all."""
    a, b = a.reshape(-1), b.reshape(-1)
    return a[:_HEAD_VALUES].tobytes() == b[:_HEAD_VALUES].tobytes() and a.tobytes() == b.tobytes()


class TwoStep:
    """An operator in two steps: :meth:`draw` takes every random value a mutant needs from the seed's
    generator (the same draws, in the same order, as one call), :meth:`apply` makes the mutant from them.

    A campaign's population draws each search's mutation in turn (each seed its own generator stream) and
    then applies all mutations of one operator together with :meth:`apply_many`: here one image after
    another, on a device one batched call (:mod:`~mlflow_di.fuzz.device_mutations`). Calling the operator
    is the two steps at once, so both ways give the same bytes.
    """

    #: the torch device that makes the mutants (a device operator's, which also offers ``make_many``: the
    #: mutants left on the device, see :class:`~mlflow_di.fuzz.device_mutations.DeviceOperator`); None: NumPy
    #: on the host
    device = None

    def draw(self, shape: tuple, rng: np.random.Generator):
        raise NotImplementedError

    def apply(self, image: np.ndarray, drawn, out: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, image: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None) -> np.ndarray:
        return self.apply(image, self.draw(image.shape, rng), out)

    def apply_many(self, sources: Sequence[np.ndarray], drawn: Sequence, rows: np.ndarray) -> np.ndarray:
        """The mutant of each ``sources[i]`` from ``drawn[i]``, written into ``rows[i]`` (``rows``: a C-contiguous
        uint8 (N, H, W, C) block); whether each mutant equals its source (a bool array)."""
        unchanged = np.empty(len(sources), bool)
        for i, (source, values) in enumerate(zip(sources, drawn)):
            self.apply(source, values, rows[i])
            unchanged[i] = same_image(rows[i], source)
        return unchanged


class KernelFilter(TwoStep):
    """A filter whose one random value is its kernel size, drawn from its ``kernels``."""

    kernels: tuple[int, ...]

    def draw(self, shape: tuple, rng: np.random.Generator) -> int:
        """This call's kernel size, one of ``kernels``."""
        return self.kernels[draw_index(rng, len(self.kernels))]


@dataclasses.dataclass(frozen=True)
class GaussianNoise(TwoStep):
    """Additive Gaussian noise, N(0, ``sigma``) per pixel value (0..255 scale)."""

    sigma: float = math.sqrt(0.1)
    name: str = "gaussian_noise"

    def draw(self, shape: tuple, rng: np.random.Generator) -> np.ndarray:
        """The standard normal value of each pixel value."""
        return rng.standard_normal(shape, dtype=np.float32)

    def apply(self, image: np.ndarray, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        values *= np.float32(self.sigma)  # the draw is used once: scaled in place
        values += image  # in place: the same float32 sums as image + noise, without temporaries
        return _saturate(values, out)


@dataclasses.dataclass(frozen=True)
class SaltAndPepper(TwoStep):
    """Sets ``ceil(amount * size * salt_ratio)`` random values to 255 and the rest of the amount to 0.

    Coordinates are drawn per axis, channels included, as in the reference.
    """

    amount: float = 0.004
    salt_ratio: float = 0.5
    name: str = "salt_and_pepper"

    def counts(self, shape: tuple) -> tuple[int, int]:
        """How many values turn white (salt) and black (pepper) in an image of ``shape``."""
        size = math.prod(shape)
        return (int(math.ceil(self.amount * size * self.salt_ratio)),
                int(math.ceil(self.amount * size * (1.0 - self.salt_ratio))))

    def draw(self, shape: tuple, rng: np.random.Generator) -> np.ndarray:
        """The coordinates (one row per value, salt first) of the values set."""
        return (rng.random((sum(self.counts(shape)), len(shape))) * shape).astype(np.intp)

    def apply(self, image: np.ndarray, coords: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        salt = self.counts(image.shape)[0]
        out = copied(image, out)
        out[tuple(coords[:salt].T)] = 255
        out[tuple(coords[salt:].T)] = 0
        return out


@dataclasses.dataclass(frozen=True)
class MultiplicativeNoise(TwoStep):
    """``img + img * n`` with n ~ N(mean, sqrt(var)), mean ~ U[mean_low, mean_high), var ~ U[0, var_max)."""

    mean_low: float = -0.5
    mean_high: float = 0.5
    var_max: float = 0.05
    name: str = "multiplicative_noise"

    def draw_factor(self, rng: np.random.Generator) -> tuple[float, float]:
        """This call's mean and standard deviation of the per-value factor n."""
        mean = self.mean_low + (self.mean_high - self.mean_low) * rng.random()
        return mean, math.sqrt(self.var_max * rng.random())

    def draw(self, shape: tuple, rng: np.random.Generator) -> tuple[float, float, np.ndarray]:
        """The factor's mean and standard deviation, and the standard normal value of each pixel value."""
        mean, sigma = self.draw_factor(rng)
        return mean, sigma, rng.standard_normal(shape, dtype=np.float32)

    def apply(self, image: np.ndarray, drawn: tuple, out: np.ndarray | None = None) -> np.ndarray:
        mean, sigma, values = drawn
        values *= np.float32(sigma)  # the draw is used once: turned into the factors in place
        values += np.float32(1.0 + mean)
        values *= image  # in place: the same float32 products as image * factor
        return _saturate(values, out)


@dataclasses.dataclass(frozen=True)
class PixelChange(TwoStep):
    """Sets n ~ U{0..max_values} randomly chosen values (positions with repetition) to random levels 0..255."""

    max_values: int = 9
    name: str = "pixel_change"

    def draw(self, shape: tuple, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The flat positions and the new levels (a later repeat of a position wins)."""
        count = draw_index(rng, self.max_values + 1)
        draws = rng.random(2 * count)
        return (draws[:count] * math.prod(shape)).astype(np.intp), (draws[count:] * 256).astype(np.uint8)

    def apply(self, image: np.ndarray, drawn: tuple, out: np.ndarray | None = None) -> np.ndarray:
        positions, levels = drawn
        out = copied(image, out)
        out.reshape(-1)[positions] = levels
        return out


@dataclasses.dataclass(frozen=True)
class AverageBlur(KernelFilter):
    """Box filter with a k x k kernel, k drawn from ``kernels`` (OpenCV ``blur``, reflected border)."""

    kernels: tuple[int, ...] = (1, 2, 3, 4, 5)
    name: str = "average_blur"

    def apply(self, image: np.ndarray, k: int, out: np.ndarray | None = None) -> np.ndarray:
        if k == 1:  # the identity: a copy gives the same bytes in about half the time at 224x224x3
            return copied(image, out)
        if out is None:
            return _with_channel_axis(cv2.blur(image, (k, k)), image)
        return _written(cv2.blur(image, (k, k), dst=_opencv_view(out)), out)


@dataclasses.dataclass(frozen=True)
class GaussianBlur(KernelFilter):
    """Gaussian filter with a k x k kernel, k drawn from ``kernels``, sigma derived from k by OpenCV."""

    kernels: tuple[int, ...] = (1, 3, 5, 7)
    name: str = "gaussian_blur"

    def apply(self, image: np.ndarray, k: int, out: np.ndarray | None = None) -> np.ndarray:
        if k == 1:  # a 1x1 kernel is [1]: the identity, as for the box filter
            return copied(image, out)
        if out is None:
            return _with_channel_axis(cv2.GaussianBlur(image, (k, k), 0), image)
        return _written(cv2.GaussianBlur(image, (k, k), 0, dst=_opencv_view(out)), out)


@dataclasses.dataclass(frozen=True)
class MedianBlur(KernelFilter):
    """Median filter with a k x k kernel, k drawn from ``kernels`` (k = 1 leaves the image as is)."""

    kernels: tuple[int, ...] = (1, 3, 5, 7)
    name: str = "median_blur"

    def apply(self, image: np.ndarray, k: int, out: np.ndarray | None = None) -> np.ndarray:
        if k == 1:
            return copied(image, out)
        if image.shape[2] in _MEDIAN_CHANNELS:
            if k in _FLOAT_MEDIAN_KERNELS and image.size <= _FLOAT_MEDIAN_MAX_VALUES:
                # Same result (a median of integers is one of them), several times faster on small images.
                result = cv2.medianBlur(image.astype(np.float32), k).astype(np.uint8)
            elif out is not None:
                return _written(cv2.medianBlur(image, k, dst=_opencv_view(out)), out)
            else:
                result = cv2.medianBlur(image, k)
        else:  # OpenCV filters 1, 3 or 4 channels at once; other counts go one channel at a time.
            result = np.stack([cv2.medianBlur(np.ascontiguousarray(image[:, :, c]), k)
                               for c in range(image.shape[2])], axis=2)
        return _with_channel_axis(result, image) if out is None else _written(result, out)


#: A mutation operator: (image uint8 HWC, generator) -> new image uint8 HWC; has a ``name``. DFlare's
#: own operators also take ``out=``, an array of the image's shape to write the mutant into (see
#: :func:`mutate_into`), which spares a campaign the copy of each mutant into its batch.
Operator = Callable[[np.ndarray, np.random.Generator], np.ndarray]

#: The operator types whose ``__call__`` takes ``out=`` (exact types: a subclass may compute otherwise).
_WRITE_INTO: set = set()


def writes_into(*operator_types: type) -> None:
    """Declare that these operator types' ``__call__(image, rng, out=None)`` can write into ``out`` (and,
    for a :class:`TwoStep`, that the call is exactly its draw and then its apply)."""
    _WRITE_INTO.update(operator_types)


def two_step(operator) -> bool:
    """Whether a campaign may draw ``operator``'s mutation first and make it later, with the others of its
    step (:mod:`~mlflow_di.fuzz.population`): a declared :class:`TwoStep` type (exact types: a subclass may
    override the call and compute something else)."""
    return type(operator) in _WRITE_INTO and isinstance(operator, TwoStep)


def mutate_into(operator: Operator, image: np.ndarray, rng: np.random.Generator, out: np.ndarray) -> np.ndarray:
    """``operator``'s mutant of ``image`` in ``out`` (returned): written there by the operators that can
    (when ``out`` is a C-contiguous uint8 array of the image's shape, as a campaign's rows are), copied
    there from the result otherwise. The same bytes and draws either way."""
    if (type(operator) in _WRITE_INTO and out.flags.c_contiguous and out.dtype == np.uint8
            and out.shape == image.shape):
        return operator(image, rng, out=out)
    np.copyto(out, operator(image, rng))
    return out


writes_into(GaussianNoise, SaltAndPepper, MultiplicativeNoise, PixelChange, AverageBlur, GaussianBlur, MedianBlur)


def default_operators() -> tuple[Operator, ...]:
    """DFlare's seven operators, in the reference's order (the order breaks ties in ranking)."""
    return (GaussianNoise(), SaltAndPepper(), MultiplicativeNoise(), PixelChange(),
            AverageBlur(), GaussianBlur(), MedianBlur())


def operators_device(operators: Sequence[Operator]):
    """The device all ``operators`` make their mutants on, when they are :class:`TwoStep` operators of one
    device (a campaign's population then keeps its images and scoring there); else None."""
    devices = {op.device if isinstance(op, TwoStep) else None for op in operators}
    return devices.pop() if len(devices) == 1 else None


def operator_names(operators: Sequence[Operator]) -> list[str]:
    """The operators' names, checked to be distinct (statistics are keyed by name)."""
    names = [op.name for op in operators]
    if len(set(names)) != len(names):
        raise ValueError(f"mutation operators need distinct names, got {names}")
    return names
