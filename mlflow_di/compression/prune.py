"""Magnitude pruning of a PyTorch model's Conv and Linear weights (``torch.nn.utils.prune``).

Both functions work on a deep copy and make the pruning permanent (``prune.remove``), so the
result is a plain module with zeros in its weights, ready for ONNX export.

- :func:`prune_l1`: unstructured L1 pruning. ``scope="global"`` (default) removes the
  ``amount`` fraction of smallest-magnitude weights over *all* Conv/Linear weights together,
  so layers with many small weights lose more than small, important ones (e.g. the first
  conv); ``scope="layer"`` removes ``amount`` of every layer.
- :func:`prune_structured`: L1 channel pruning (``prune.ln_structured``, n=1, dim=0): in every
  Conv/Linear except the final logit layer, the ``amount`` fraction of output channels with the
  smallest L1 norm is zeroed, bias included, so the channel outputs exactly zero as if it had
  been removed.

Sparsity is the fraction of zero weights over the weight tensors the method prunes.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils import prune

from mlflow_di.errors import UserError

PRUNABLE_TYPES = (nn.modules.conv._ConvNd, nn.Linear)
SCOPES = ("global", "layer")


class PrunedModel(NamedTuple):
    """A pruned copy of a module and the fraction of zero weights over its pruned tensors."""

    module: nn.Module
    sparsity: float


def prunable_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Conv and Linear layers with their dotted names, in registration order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, PRUNABLE_TYPES)]


def weight_sparsity(layers: list[nn.Module]) -> float:
    """Fraction of exactly-zero weights over the ``weight`` tensors of ``layers``."""
    zeros = sum(int((layer.weight == 0).sum()) for layer in layers)
    total = sum(layer.weight.numel() for layer in layers)
    return zeros / total if total else 0.0


def layer_sparsity(module: nn.Module) -> dict[str, float]:
    """Fraction of zero weights of each Conv/Linear layer, by name."""
    return {name: weight_sparsity([layer]) for name, layer in prunable_layers(module)}


def _checked(module, amount: float) -> list[tuple[str, nn.Module]]:
    if not isinstance(module, nn.Module):
        raise UserError(
            f"pruning needs a PyTorch nn.Module, got {type(module).__name__}; prune the PyTorch source model "
            "(ONNX/TFLite models can be quantized but not pruned)"
        )
    if not 0.0 <= float(amount) < 1.0:
        raise UserError(f"pruning amount must be a fraction in [0, 1), got {amount}")
    layers = prunable_layers(module)
    if not layers:
        raise UserError(f"{type(module).__name__} has no Conv or Linear layer to prune")
    return layers


def prune_l1(module: nn.Module, amount: float, scope: str = "global") -> PrunedModel:
    """Unstructured L1 magnitude pruning of all Conv/Linear weights of a copy of ``module``."""
    _checked(module, amount)
    if scope not in SCOPES:
        raise UserError(f"pruning scope must be one of {SCOPES}, got '{scope}'")
    pruned = copy.deepcopy(module)
    layers = [layer for _, layer in prunable_layers(pruned)]
    if scope == "global":
        prune.global_unstructured([(layer, "weight") for layer in layers], prune.L1Unstructured, amount=float(amount))
    else:
        for layer in layers:
            prune.l1_unstructured(layer, "weight", amount=float(amount))
    for layer in layers:
        prune.remove(layer, "weight")
    return PrunedModel(pruned.eval(), weight_sparsity(layers))


def prune_structured(module: nn.Module, amount: float) -> PrunedModel:
    """L1 output-channel pruning of every Conv/Linear of a copy of ``module`` except the final logit layer.

    The final logit layer is the last Conv/Linear in registration order (``before_softmax`` in
    the zoo); removing one of its channels would delete a class.
    """
    _checked(module, amount)
    pruned = copy.deepcopy(module)
    layers = [layer for _, layer in prunable_layers(pruned)][:-1]
    if not layers:
        raise UserError(f"{type(module).__name__} has only its logit layer; channel pruning needs a hidden Conv/Linear")
    for layer in layers:
        prune.ln_structured(layer, "weight", amount=float(amount), n=1, dim=0)
        prune.remove(layer, "weight")
        _zero_bias_of_empty_channels(layer)
    return PrunedModel(pruned.eval(), weight_sparsity(layers))


def _zero_bias_of_empty_channels(layer: nn.Module) -> None:
    """A removed channel outputs nothing: zero the bias where the channel's weights are all zero."""
    if layer.bias is None:
        return
    empty = layer.weight.detach().flatten(1).abs().sum(dim=1) == 0
    with torch.no_grad():
        layer.bias[empty] = 0.0


def zero_channels(layer: nn.Module) -> int:
    """Number of output channels of a Conv/Linear whose weights are all zero."""
    return int((layer.weight.detach().flatten(1).abs().sum(dim=1) == 0).sum())
