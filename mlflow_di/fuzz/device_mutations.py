"""DFlare's seven mutation operators on a torch device: the GPU the models already run on.

At 224x224x3 the noise operators (150,528 normal draws per call) and the median blur cost the CPU
several times what a GPU spends running both models on one input (benchmarks/RESULTS.md, bench_scale),
so a campaign on a GPU would wait on its host. :func:`on_device` swaps the operators for
versions that do the per-value work on the device, and a campaign's population
(:mod:`~mlflow_di.fuzz.population`) makes all mutants of one operator in a step with one batched call
(:meth:`DeviceOperator.make_many`): the step's x_max images go to the device together, the mutants and
whether each changed its source come back together, instead of a round trip per image.

What stays the same: each operator's name (operator statistics and Metropolis-Hastings selection are keyed
by it), its parameter draws (mean, variance, kernel size, positions, levels) from the seed's generator,
rounding to the nearest level and saturation at 0 and 255, and the result: uint8 NumPy images. Salt and
pepper, pixel change, the median and the Gaussian blur give the CPU operators' bytes (the Gaussian blur
computes OpenCV's 8-bit fixed-point kernel exactly; tests compare them), and so does the box blur with an
odd kernel. What changes:

- the noise values come from a torch generator seeded by one 63-bit draw of the seed's generator instead
  of from the seed's generator itself, so the noise operators draw from the same distributions but not
  the same values as on the CPU;
- the box blur with an even kernel (2 or 4) rounds the window's mean half up, where OpenCV's own
  fixed-point arithmetic differs by one level on some values.

So a campaign's records on the device differ from its records on the CPU (each is reproducible, and
independent of ``--batch`` and of which seeds share a step, on its own device). The operators' ``repr``
names the device, so a campaign folder refuses to resume on the other kind of operators.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence, runtime_checkable

import cv2
import numpy as np

from mlflow_di.fuzz.distributed import searches_share_the_models_gpu
from mlflow_di.fuzz.mutations import (AverageBlur, GaussianBlur, GaussianNoise, MedianBlur, MultiplicativeNoise,
                                      Operator, PixelChange, SaltAndPepper, writes_into)

#: Largest seed a torch generator takes from one draw of the seed's generator.
_KEY_LIMIT = 2**63 - 1
#: Fractional bits of OpenCV's fixed-point Gaussian kernel for 8-bit images.
_GAUSSIAN_FRACTION_BITS = 8


class DeviceOperator:
    """A two-step operator whose mutants are made on ``device``, many at once.

    :meth:`make_many` gathers the sources on the device as one batch and :meth:`mutants` makes every mutant
    there (a subclass's per-value work); :meth:`apply_many` also copies them back with whether each equals
    its source. Calling the operator, or :meth:`apply`, is :meth:`apply_many` on one image.
    """

    device: str

    def mutants(self, images, drawn: Sequence):
        """The mutants of ``images`` (a uint8 (N, H, W, C) tensor on the device) from their ``drawn``
        values: a uint8 tensor of the same shape (never ``images`` itself, which is compared with it)."""
        raise NotImplementedError

    def make_many(self, sources: Sequence, drawn: Sequence):
        """The mutants of ``sources`` (NumPy images, or tensors already there) from their ``drawn`` values, made
        on the device in one batch, and whether each equals its source: two tensors there, nothing copied
        back (a population's step brings every operator's mutants back in one copy, see
        :func:`~mlflow_di.fuzz.population.apply_mutations`)."""
        import torch

        images = torch.stack([torch.as_tensor(source).to(self.device) for source in sources])
        made = self.mutants(images, drawn)
        return made, (made == images).flatten(1).all(dim=1)

    def apply_many(self, sources: Sequence, drawn: Sequence, rows: np.ndarray):
        """:meth:`~mlflow_di.fuzz.mutations.TwoStep.apply_many` on the device: :meth:`make_many`, the mutants
        copied into ``rows``."""
        import torch

        made, unchanged = self.make_many(sources, drawn)
        torch.from_numpy(rows).copy_(made)
        return unchanged.cpu().numpy()

    def apply(self, image: np.ndarray, drawn, out: np.ndarray | None = None) -> np.ndarray:
        rows = np.empty((1, *image.shape), np.uint8) if out is None else out[None]
        self.apply_many([image], [drawn], rows)
        return rows[0] if out is None else out


def _draw_key(rng: np.random.Generator) -> int:
    """One 63-bit draw of the seed's generator: the seed of the torch generator of one mutant's noise."""
    return int(rng.integers(0, _KEY_LIMIT))


def _noise(like, keys: Sequence[int]):
    """Standard normal values shaped as ``like`` (N, ...), image i's from a torch generator seeded with ``keys[i]``
    (so an image's noise does not depend on the other images of the step)."""
    import torch

    noise = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    for i, key in enumerate(keys):
        generator = torch.Generator(device=like.device).manual_seed(key)
        torch.randn(like.shape[1:], generator=generator, out=noise[i])
    return noise


def _saturated(values):
    """Float values -> uint8, rounded half to even and clipped (as on the CPU)."""
    import torch

    return values.round_().clamp_(0, 255).to(torch.uint8)


def _per_image(values: Sequence[float], like):
    """One float32 value per image of ``like``, shaped to broadcast over its pixels."""
    import torch

    return torch.tensor(values, dtype=torch.float32, device=like.device).view(-1, *([1] * (like.dim() - 1)))


def _planes(images):
    """uint8 (N, H, W, C) -> float32 (N, C, H, W), exact for 0..255."""
    import torch

    return images.permute(0, 3, 1, 2).to(torch.float32)


def _images(planes):
    """float32 (N, C, H, W) holding levels 0..255 -> uint8 (N, H, W, C)."""
    import torch

    return planes.to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _by_kernel(images, kernels: Sequence[int], filtered, on_host=None):
    """The images each filtered with its own kernel size: ``filtered(planes, k)`` once per size drawn. An
    image too small for a reflected border of k // 2 (under 4 pixels wide for k = 7) is filtered by
    ``on_host(image, k)``, the CPU operator, as OpenCV does it."""
    import torch

    made = images.clone()
    for k in sorted(set(kernels)):
        if k == 1:
            continue  # the identity
        chosen = [i for i, size in enumerate(kernels) if size == k]
        if on_host is not None and k // 2 >= min(images.shape[1:3]):
            host = [on_host(image, k) for image in images[chosen].cpu().numpy()]
            made[chosen] = torch.from_numpy(np.stack(host)).to(images.device)
            continue
        made[chosen] = _images(filtered(_planes(images[chosen]), k))
    return made


@dataclasses.dataclass(frozen=True)
class DeviceGaussianNoise(DeviceOperator, GaussianNoise):
    """:class:`~mlflow_di.fuzz.mutations.GaussianNoise` with its noise drawn and added on ``device``."""

    device: str = "cpu"

    def draw(self, shape: tuple, rng: np.random.Generator) -> int:
        return _draw_key(rng)

    def mutants(self, images, drawn: Sequence):
        return _saturated(_noise(images, drawn).mul_(self.sigma).add_(images))


@dataclasses.dataclass(frozen=True)
class DeviceMultiplicativeNoise(DeviceOperator, MultiplicativeNoise):
    """:class:`~mlflow_di.fuzz.mutations.MultiplicativeNoise` on ``device``: mean and variance drawn
    from the seed's generator as on the CPU, the per-value factors on the device."""

    device: str = "cpu"

    def draw(self, shape: tuple, rng: np.random.Generator) -> tuple[float, float, int]:
        mean, sigma = self.draw_factor(rng)
        return mean, sigma, _draw_key(rng)

    def mutants(self, images, drawn: Sequence):
        means, sigmas, keys = zip(*drawn)
        factors = _noise(images, keys).mul_(_per_image(sigmas, images))
        factors.add_(_per_image([1.0 + mean for mean in means], images))
        return _saturated(factors.mul_(images))


@dataclasses.dataclass(frozen=True)
class DeviceSaltAndPepper(DeviceOperator, SaltAndPepper):
    """:class:`~mlflow_di.fuzz.mutations.SaltAndPepper` on ``device``: the same coordinates, the same bytes."""

    device: str = "cpu"

    def mutants(self, images, drawn: Sequence):
        import torch

        made = images.clone()
        salt = self.counts(tuple(images.shape[1:]))[0]
        coords = torch.as_tensor(np.stack(drawn), device=images.device)  # (N, values, 3)
        rows = torch.arange(len(images), device=images.device)[:, None].expand(coords.shape[:2])
        for part, level in ((slice(None, salt), 255), (slice(salt, None), 0)):  # pepper last, as on the CPU
            made[rows[:, part], coords[:, part, 0], coords[:, part, 1], coords[:, part, 2]] = level
        return made


@dataclasses.dataclass(frozen=True)
class DevicePixelChange(DeviceOperator, PixelChange):
    """:class:`~mlflow_di.fuzz.mutations.PixelChange` on ``device``: the same positions and levels, the same bytes."""

    device: str = "cpu"

    def mutants(self, images, drawn: Sequence):
        import torch

        made = images.clone()
        flat = made.view(len(images), -1)
        rows, positions, levels = [], [], []
        for i, (where, level) in enumerate(drawn):
            # a position drawn twice takes its last level, as NumPy's assignment does (the device's may not)
            last = len(where) - 1 - np.unique(where[::-1], return_index=True)[1]
            rows.extend([i] * len(last))
            positions.extend(where[last].tolist())
            levels.extend(level[last].tolist())
        if rows:
            device = images.device
            flat[torch.tensor(rows, device=device), torch.tensor(positions, device=device)] = torch.tensor(
                levels, dtype=torch.uint8, device=device)
        return made


@dataclasses.dataclass(frozen=True)
class DeviceAverageBlur(DeviceOperator, AverageBlur):
    """:class:`~mlflow_di.fuzz.mutations.AverageBlur` on ``device``: OpenCV's window (anchored at k // 2) and
    reflected border; the mean rounded half up (OpenCV's bytes for odd kernels, see the module docstring)."""

    device: str = "cpu"

    def mutants(self, images, drawn: Sequence):
        return _by_kernel(images, drawn, _box_mean, lambda image, k: AverageBlur.apply(self, image, k))


def _box_mean(planes, k: int):
    import torch
    import torch.nn.functional as F

    before, after = k // 2, k - 1 - k // 2
    padded = F.pad(planes, (before, after, before, after), mode="reflect")
    sums = F.avg_pool2d(padded, k, stride=1, divisor_override=1)
    return torch.floor(sums.div_(k * k).add_(0.5))


@dataclasses.dataclass(frozen=True)
class DeviceGaussianBlur(DeviceOperator, GaussianBlur):
    """:class:`~mlflow_di.fuzz.mutations.GaussianBlur` on ``device``, OpenCV's bytes: its kernel for k (sigma
    from k) in 8-bit fixed point, a row pass and a column pass in exact integers, the result rounded half up."""

    device: str = "cpu"

    def mutants(self, images, drawn: Sequence):
        return _by_kernel(images, drawn, _gaussian, lambda image, k: GaussianBlur.apply(self, image, k))


def _fixed_point_gaussian(k: int) -> np.ndarray:
    """OpenCV's Gaussian kernel of size ``k`` for 8-bit images: its weights times 256, rounded, summing to 256."""
    scale = 1 << _GAUSSIAN_FRACTION_BITS
    weights = np.round(cv2.getGaussianKernel(k, 0).ravel() * scale)
    weights[k // 2] += scale - weights.sum()
    return weights.astype(np.float32)


def _gaussian(planes, k: int):
    import torch
    import torch.nn.functional as F

    count, channels, height, width = planes.shape
    weights = torch.from_numpy(_fixed_point_gaussian(k)).to(planes.device)
    padded = F.pad(planes, (k // 2,) * 4, mode="reflect").reshape(count * channels, 1, height + k - 1, width + k - 1)
    rows = F.conv2d(padded, weights.view(1, 1, 1, k))  # integers below 2**16: exact in float32
    both = F.conv2d(rows, weights.view(1, 1, k, 1))  # below 2**24: still exact
    half = 1 << (2 * _GAUSSIAN_FRACTION_BITS - 1)
    return torch.floor(both.add_(half).div_(2 * half)).reshape(count, channels, height, width)


@dataclasses.dataclass(frozen=True)
class DeviceMedianBlur(DeviceOperator, MedianBlur):
    """:class:`~mlflow_di.fuzz.mutations.MedianBlur` on ``device``: the same kernel draw and the same
    bytes (the median of an odd number of integers is one of them; borders replicated as OpenCV does)."""

    device: str = "cpu"

    def mutants(self, images, drawn: Sequence):
        return _by_kernel(images, drawn, _median)


#: Most bytes of k x k windows the median unfolds at once (49 floats per value for k = 7: 29 MB per
#: 224x224x3 image); larger groups go through in chunks.
_MEDIAN_WINDOW_BYTES = 2**29


def _median(planes, k: int):
    import torch
    import torch.nn.functional as F

    count, channels, height, width = planes.shape
    chunk = max(1, _MEDIAN_WINDOW_BYTES // (k * k * channels * height * width * 4))
    medians = []
    for start in range(0, count, chunk):
        padded = F.pad(planes[start:start + chunk], (k // 2,) * 4, mode="replicate")
        windows = padded.unfold(2, k, 1).unfold(3, k, 1).reshape(len(padded), channels, height, width, k * k)
        medians.append(windows.median(dim=-1).values)
    return medians[0] if len(medians) == 1 else torch.cat(medians)


writes_into(DeviceGaussianNoise, DeviceMultiplicativeNoise, DeviceSaltAndPepper, DevicePixelChange,
            DeviceAverageBlur, DeviceGaussianBlur, DeviceMedianBlur)

#: CPU operator type -> its device version (a subclass with a ``device`` field).
_ON_DEVICE = {GaussianNoise: DeviceGaussianNoise, MultiplicativeNoise: DeviceMultiplicativeNoise,
              SaltAndPepper: DeviceSaltAndPepper, PixelChange: DevicePixelChange, AverageBlur: DeviceAverageBlur,
              GaussianBlur: DeviceGaussianBlur, MedianBlur: DeviceMedianBlur}


def on_device(operators: Sequence[Operator], device) -> tuple[Operator, ...]:
    """``operators`` with DFlare's seven operators (default settings or not) moved to ``device``; any other
    operator, and every operator when ``device`` is None, is kept as it is."""
    if device is None:
        return tuple(operators)
    moved = []
    for op in operators:
        device_type = _ON_DEVICE.get(type(op))  # exact types: a subclass may compute something else
        if device_type is not None:
            settings = {field.name: getattr(op, field.name) for field in dataclasses.fields(op)}
            op = device_type(**settings, device=str(device))
        moved.append(op)
    return tuple(moved)


def mutation_device(original, executor=None):
    """Where a campaign's operators should run: the CUDA device of a PyTorch original when the searches run
    where that model does, else None (the CPU operators: a CPU gains nothing from torch here).

    That is in this process (``executor`` None), or on Ray workers that each get a share of a GPU
    (``gpus_per_worker`` > 0): they load the original with the same device, and Ray makes the GPU it
    gave a worker that worker's ``cuda:0``. Workers without a GPU share keep the CPU operators.
    """
    device = getattr(original, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    return device if searches_share_the_models_gpu(executor) else None


@runtime_checkable
class OperatorStrategy(Protocol):
    """A strategy that mutates with a tuple of :class:`~mlflow_di.fuzz.mutations.Operator` (DFlare and
    its variants): the one kind whose operators can move to a device."""

    operators: tuple


def with_operators_on(strategy, device):
    """``strategy`` with its operators moved by :func:`on_device` (a strategy that has no
    :class:`OperatorStrategy` operators, and a None device, are returned unchanged)."""
    if device is None or not isinstance(strategy, OperatorStrategy):
        return strategy
    return dataclasses.replace(strategy, operators=on_device(strategy.operators, device))
