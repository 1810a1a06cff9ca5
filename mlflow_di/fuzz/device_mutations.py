"""DFlare's costly mutation operators on a torch device: the GPU the models already run on.

At 224x224x3 the two noise operators cost ~1.6 ms per call on the CPU (150,528 normal draws) and
the median blur up to 4.5 ms (k = 7), while a GPU runs both models in ~0.17 ms per input
(benchmarks/RESULTS.md, bench_scale). :func:`on_device` swaps those three operators for versions
that do the per-value work on the device; the other four (salt and pepper, pixel change, box and
Gaussian blur) cost 0.01-0.08 ms on the CPU and stay there.

What stays the same: each operator's name (operator statistics and Metropolis-Hastings selection
are keyed by it), its parameter draws (mean, variance, kernel size) from the seed's generator,
rounding to the nearest level and saturation at 0 and 255, and the result: a new uint8 NumPy
image (or one copy from the device into the ``out=`` row a campaign gives, see
:func:`~mlflow_di.fuzz.mutations.mutate_into`). The median is exact, so :class:`DeviceMedianBlur`
returns the bytes :class:`MedianBlur` does. What changes: the noise values come from a torch generator seeded by one
63-bit draw of the
seed's generator instead of from the seed's generator itself, so the noise operators draw from the
same distributions but not the same values as on the CPU, and a campaign's records on the device
differ from its records on the CPU (each is reproducible, and independent of ``--batch``, on its
own device). The operators' ``repr`` names the device, so a campaign folder refuses to resume on
the other kind of operators.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from mlflow_di.fuzz.distributed import searches_share_the_models_gpu
from mlflow_di.fuzz.mutations import GaussianNoise, MedianBlur, MultiplicativeNoise, Operator, copied, writes_into

#: Largest seed a torch generator takes from one draw of the seed's generator.
_KEY_LIMIT = 2**63 - 1


def _noise(shape: tuple, rng: np.random.Generator, device: str):
    """Standard normal values on ``device`` from a torch generator keyed by one draw of ``rng``."""
    import torch

    generator = torch.Generator(device=device).manual_seed(int(rng.integers(0, _KEY_LIMIT)))
    return torch.randn(shape, generator=generator, device=device)


def _to_device(image: np.ndarray, device: str):
    import torch

    return torch.from_numpy(image).to(device)


def _saturated(values, out: np.ndarray | None = None) -> np.ndarray:
    """Float values on the device -> uint8 NumPy image, rounded half to even and clipped (as on the CPU);
    copied from the device straight into ``out`` when given."""
    import torch

    return _to_host(values.round_().clamp_(0, 255).to(torch.uint8), out)


def _to_host(image, out: np.ndarray | None) -> np.ndarray:
    """A uint8 (H, W, C) tensor as a NumPy image: a new one, or written into ``out`` (one copy from the
    device, no second one on the host)."""
    import torch

    if out is None:
        return image.cpu().numpy()
    torch.from_numpy(out).copy_(image)
    return out


@dataclasses.dataclass(frozen=True)
class DeviceGaussianNoise(GaussianNoise):
    """:class:`~mlflow_di.fuzz.mutations.GaussianNoise` with its noise drawn and added on ``device``."""

    device: str = "cpu"

    def __call__(self, image: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None) -> np.ndarray:
        noise = _noise(image.shape, rng, self.device)
        return _saturated(noise.mul_(self.sigma).add_(_to_device(image, self.device)), out)


@dataclasses.dataclass(frozen=True)
class DeviceMultiplicativeNoise(MultiplicativeNoise):
    """:class:`~mlflow_di.fuzz.mutations.MultiplicativeNoise` on ``device``: mean and variance drawn
    from the seed's generator as on the CPU, the per-value factors on the device."""

    device: str = "cpu"

    def __call__(self, image: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None) -> np.ndarray:
        mean, sigma = self.draw_factor(rng)
        factor = _noise(image.shape, rng, self.device).mul_(sigma).add_(1.0 + mean)
        return _saturated(factor.mul_(_to_device(image, self.device)), out)


@dataclasses.dataclass(frozen=True)
class DeviceMedianBlur(MedianBlur):
    """:class:`~mlflow_di.fuzz.mutations.MedianBlur` on ``device``: the same kernel draw and the same
    bytes (the median of an odd number of integers is one of them; borders replicated as OpenCV does)."""

    device: str = "cpu"

    def __call__(self, image: np.ndarray, rng: np.random.Generator, out: np.ndarray | None = None) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        k = self.draw_kernel(rng)
        if k == 1:
            return copied(image, out)
        height, width, channels = image.shape
        planes = _to_device(image, self.device).permute(2, 0, 1)[None].to(torch.float32)  # exact for 0..255
        padded = F.pad(planes, (k // 2,) * 4, mode="replicate")
        windows = padded.unfold(2, k, 1).unfold(3, k, 1).reshape(channels, height, width, k * k)
        return _to_host(windows.median(dim=-1).values.to(torch.uint8).permute(1, 2, 0), out)


writes_into(DeviceGaussianNoise, DeviceMultiplicativeNoise, DeviceMedianBlur)

#: CPU operator type -> its device version (a subclass with a ``device`` field).
_ON_DEVICE = {GaussianNoise: DeviceGaussianNoise, MultiplicativeNoise: DeviceMultiplicativeNoise,
              MedianBlur: DeviceMedianBlur}


def on_device(operators: Sequence[Operator], device) -> tuple[Operator, ...]:
    """``operators`` with DFlare's noise operators and median blur (default settings or not) moved to
    ``device``; any other operator, and every operator when ``device`` is None, is kept as it is."""
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
    """Where a campaign's costly operators should run: the CUDA device of a PyTorch original when the
    searches run where that model does, else None (the CPU operators: a CPU gains nothing from torch here).

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
