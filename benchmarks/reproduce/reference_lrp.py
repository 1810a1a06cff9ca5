"""DeepImportance's relevance propagation as its released code computes it (benchmarks only).

The reference converts the Keras model into lrp_toolbox modules and, in doing so, drops the ReLU
of every convolution layer (Keras keeps it inside ``Conv2D``; the converter does not carry it
over). Its forward pass, its predicted class and every relevance it propagates come from that
ReLU-less network. The rule is lrp_toolbox's default ("simple") z-rule:

- linear and convolution layers: z_jk = a_j w_jk and R_j = sum_k z_jk / (z_k + eps) R_k with
  z_k = sum_j z_jk + b_k, eps = 1e-16 with the sign of z_k; the bias takes its share, so
  relevance is not conserved;
- max pooling: each window's relevance goes to the inputs equal to its maximum (split between
  ties); ReLU and flatten pass relevance through;
- start: the network's own highest logit, the other logits zero.

This is a reproduction device for the paper-era protocol (:mod:`benchmarks.reproduce.idc_paper_era`),
never used by the product, whose IDC runs a ReLU-correct epsilon-LRP
(:mod:`mlflow_di.coverage.relevance`). REPRODUCTION.md records the check against the relevance
sums the authors stored in their repository's history.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

EPSILON = 1e-16
_LAYERS = (nn.Conv2d, nn.Linear, nn.ReLU, nn.MaxPool2d, nn.Flatten)


def reference_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The leaf layers of a sequential model, each named by its top-level block, without the
    ReLUs that follow a convolution (the reference converter's omission), in float64."""
    leaves: list[tuple[str, nn.Module]] = []
    for name, block in copy.deepcopy(module).double().eval().named_children():
        for leaf in (block.children() if isinstance(block, nn.Sequential) else [block]):
            if not isinstance(leaf, _LAYERS):
                raise ValueError(f"the reference LRP handles {', '.join(t.__name__ for t in _LAYERS)}; "
                                 f"layer '{name}' has {type(leaf).__name__}")
            if isinstance(leaf, nn.ReLU) and leaves and isinstance(leaves[-1][1], nn.Conv2d):
                continue
            leaves.append((name, leaf))
    return leaves


def reference_forward(layers: list[tuple[str, nn.Module]], x: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's input and the final output of the ReLU-less network (float64)."""
    values = [x.double()]
    with torch.no_grad():
        for _, layer in layers:
            values.append(layer(values[-1]))
    return values


def reference_relevance(module: nn.Module, x: torch.Tensor, layer: str, batch_size: int = 512) -> np.ndarray:
    """(N, neurons) reference relevance of the outputs of block ``layer`` (a convolution neuron is
    a channel: its relevance summed over positions), for preprocessed inputs ``x`` (N, C, H, W)."""
    layers = reference_layers(module)
    names = [name for name, _ in layers]
    if layer not in names:
        raise ValueError(f"no layer '{layer}'; layers: {', '.join(dict.fromkeys(names))}")
    last = len(names) - 1 - names[::-1].index(layer)
    parts = []
    for start in range(0, len(x), batch_size):
        for index, relevance in _backward(layers, reference_forward(layers, x[start:start + batch_size])):
            if index == last:
                parts.append(relevance.flatten(2).sum(2) if relevance.dim() == 4 else relevance)
                break
    return torch.cat(parts).numpy()


def summed_relevance(module: nn.Module, x: torch.Tensor, batch_size: int = 512) -> list[np.ndarray]:
    """The relevance of every leaf layer's outputs (:func:`reference_layers` order, the logits
    excepted), summed over the inputs ``x``: what the reference's ``find_relevant_neurons`` stores as ``totalR``."""
    layers = reference_layers(module)
    totals: list = [0.0] * (len(layers) - 1)
    for start in range(0, len(x), batch_size):
        for index, relevance in _backward(layers, reference_forward(layers, x[start:start + batch_size])):
            if index < len(totals):
                totals[index] = totals[index] + relevance.sum(0)
    return [t.numpy() for t in totals]


def _backward(layers, values):
    """(i, relevance of leaf i's outputs) from the last leaf down to the first."""
    relevance = _start_relevance(values[-1])
    for index in range(len(layers) - 1, -1, -1):
        yield index, relevance
        relevance = _propagate(layers[index][1], values[index], relevance)


def _start_relevance(logits: torch.Tensor) -> torch.Tensor:
    mask = F.one_hot(logits.argmax(1), logits.shape[1]).to(logits.dtype)
    return logits * mask


def _propagate(layer: nn.Module, inputs: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """Relevance of ``layer``'s inputs from that of its outputs."""
    if isinstance(layer, (nn.Linear, nn.Conv2d)):
        a = inputs.detach().requires_grad_(True)
        z = layer(a)
        z = z + EPSILON * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)
        (grad,) = torch.autograd.grad(z, a, grad_outputs=(relevance / z).detach())
        return (a * grad).detach()
    if isinstance(layer, nn.MaxPool2d):
        return _maxpool_relevance(layer, inputs, relevance)
    if isinstance(layer, nn.Flatten):
        return relevance.reshape(inputs.shape)
    return relevance  # ReLU


def _maxpool_relevance(layer: nn.MaxPool2d, inputs: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    size = _pair(layer.kernel_size)
    if _pair(layer.stride or layer.kernel_size) != size or _pair(layer.padding) != (0, 0):
        raise ValueError("the reference LRP handles non-overlapping max pooling without padding")
    pooled = F.max_pool2d(inputs, size)
    height, width = pooled.shape[2] * size[0], pooled.shape[3] * size[1]

    def up(t):
        return t.repeat_interleave(size[0], 2).repeat_interleave(size[1], 3)

    winners = (inputs[..., :height, :width] == up(pooled)).to(inputs.dtype)
    ties = F.avg_pool2d(winners, size) * (size[0] * size[1])
    result = torch.zeros_like(inputs)
    result[..., :height, :width] = winners * up(relevance / ties)
    return result


def _pair(value) -> tuple[int, int]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)
