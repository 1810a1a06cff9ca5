"""A fake-quantized PyTorch copy of a model: int8 arithmetic simulated in float, with gradients.

An int8 ONNX export is a black box (no gradients), so white-box tools (``fuzz --strategy
deepxplore``) cannot use it. :func:`fake_quantize` makes a PyTorch stand-in that follows the
recipe of mlflow-di's ``int8-static`` method (ONNX Runtime QDQ, MinMax calibration):

- weights of every Conv/Linear: symmetric int8 per output channel (scale = max |w| / 127), rounded
  onto that grid once (what dequantizing the stored int8 weights gives);
- the input of every Conv/Linear: asymmetric int8 per tensor, its range the min/max over the
  calibration images (widened to contain 0, as ONNX Runtime does), applied by
  :class:`ActivationFakeQuant` on every forward pass with a straight-through gradient (the rounding
  counts as the identity for gradients, so gradient ascent sees the float slope).

Known gap: ONNX Runtime also quantizes the outputs of the ops it fuses (e.g. Conv+ReLU outputs,
the final logits) and the operands of residual additions; this copy quantizes layer inputs and
weights only, so its labels can differ from the export's on inputs near a decision boundary
(tests/test_deepxplore.py measures the agreement on digits).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from mlflow_di.compression.prune import prunable_layers
from mlflow_di.errors import UserError

QMIN, QMAX = -128, 127
WEIGHT_MAX = 127


class ActivationFakeQuant(nn.Module):
    """Rounds its input onto an int8 grid (``scale``, ``zero_point``) and back; gradient passes straight through."""

    def __init__(self, scale: float, zero_point: int):
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale), dtype=torch.float64))
        self.register_buffer("zero_point", torch.tensor(int(zero_point), dtype=torch.float64))

    def forward(self, x):
        scale, zero = self.scale.to(x.dtype), self.zero_point.to(x.dtype)
        quantized = (torch.clamp(torch.round(x / scale) + zero, QMIN, QMAX) - zero) * scale
        return x + (quantized - x).detach()


def _activation_grid(low: float, high: float) -> tuple[float, int]:
    """(scale, zero point) of an asymmetric int8 range covering [low, high] and 0."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / (QMAX - QMIN) if high > low else 1.0
    return scale, int(round(QMIN - low / scale))


def fake_quantize(module: nn.Module, calibration: torch.Tensor, only=None, weights: bool = True,
                  activations: bool = True) -> nn.Module:
    """A fake-quantized copy of ``module`` (see the module docstring); ``calibration`` is a batch of
    preprocessed model inputs (e.g. ``TorchModel.to_tensor(images)``) that sets the activation ranges.

    ``only`` (layer names) quantizes those layers alone; ``weights``/``activations`` choose what is
    quantized in them (the sensitivity split of :mod:`~mlflow_di.compression.sensitivity`)."""
    if not isinstance(module, nn.Module):
        raise UserError(f"fake quantization needs a PyTorch nn.Module, got {type(module).__name__}")
    if len(calibration) == 0:
        raise UserError("fake quantization needs calibration images to set the activation ranges")
    quantized = copy.deepcopy(module).eval()
    layers = prunable_layers(quantized)
    if not layers:
        raise UserError(f"{type(module).__name__} has no Conv or Linear layer to quantize")
    if only is not None:
        layers = [(name, layer) for name, layer in layers if name in set(only)]
    ranges: dict[str, list[float]] = {}

    def recorder(name):
        def record(_module, inputs):
            low, high = float(inputs[0].min()), float(inputs[0].max())
            seen = ranges.setdefault(name, [low, high])
            seen[0], seen[1] = min(seen[0], low), max(seen[1], high)
        return record

    hooks = [layer.register_forward_pre_hook(recorder(name)) for name, layer in layers]
    try:
        with torch.no_grad():
            quantized(calibration.to(next(quantized.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for name, layer in layers if weights else ():
            weight = layer.weight
            scale = weight.abs().flatten(1).amax(dim=1).clamp_min(1e-12) / WEIGHT_MAX
            shape = (-1,) + (1,) * (weight.ndim - 1)
            weight.copy_(torch.clamp(torch.round(weight / scale.view(shape)), -WEIGHT_MAX, WEIGHT_MAX)
                         * scale.view(shape))
    for name, layer in layers if activations else ():
        if name not in ranges:  # never reached by a forward pass: left in float
            continue
        parent_name, _, child = name.rpartition(".")
        parent = quantized.get_submodule(parent_name) if parent_name else quantized
        setattr(parent, child, nn.Sequential(ActivationFakeQuant(*_activation_grid(*ranges[name])), layer))
    return quantized
