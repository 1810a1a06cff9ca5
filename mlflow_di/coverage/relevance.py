"""Layer-wise relevance propagation (LRP) with zennit: how much each neuron contributed to a decision.

For each input the start relevance is the pre-softmax value (logit) of the decided class: the
gradient fed into the logits is that one-hot logit, and zennit's rule hooks turn the backward pass
into relevance propagation, so the "gradient" arriving at any tensor is its relevance. The
relevance of a layer's neuron is what arrives at the layer's output (a conv channel's relevance is
the sum over its positions). Activations of the same layers come from the same forward pass.

Rules (applied to every Linear and Conv layer): ``epsilon`` (default, zennit's epsilon 1e-6 unless
given), ``z`` (the plain z-rule, epsilon 1e-9, close to the reference code's 1e-16 z-rule in
float32), ``zplus`` and ``alpha1beta0`` (the same rule in zennit). Activations pass relevance
through unchanged, average pools redistribute it in proportion to their inputs (zennit's ``Norm``),
and max pools send it to the winning input (their plain gradient). Batch norms that directly follow
a Linear/Conv are merged into it first (zennit's ``SequentialMergeBatchNorm``); a batch norm with
nothing to merge into (pre-activation residual nets) passes relevance through, as in zennit's own
composites. Residual additions of the zoo's ResNet-20 blocks are rewritten as a zennit ``Sum`` so
that relevance splits between the two branches instead of being counted twice.

Model code that adds tensors in a custom ``forward`` (other than the zoo's residual blocks) is not
detected: LRP would count the relevance of both operands in full there.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn
from mlflow_di.progress import progress_bar as tqdm
from zennit.core import Composite
from zennit.layer import Sum
from zennit.rules import AlphaBeta, Epsilon, Norm, Pass, ZPlus
from zennit.types import Activation, AvgPool, BatchNorm, Linear as LinearOrConv, MaxPool

from mlflow_di.errors import UserError
from mlflow_di.models.device import module_device
from mlflow_di.coverage.canonizers import (Mean, Negation, canonizers, forward_canonizers, out_of_place, traced_once,
                                          unhandled_tensor_arithmetic)
from mlflow_di.coverage.activations import (
    LayerRecorder, RowBuffer, check_layers, eval_mode, iter_batches, neuron_values,
)

RULES = ("epsilon", "z", "zplus", "alpha1beta0")
DEFAULT_EPSILON = 1e-6
Z_RULE_EPSILON = 1e-9

#: Leaf modules whose plain gradient already is the right relevance routing (identity-like or
#: winner-take-all), so they need no rule.
_GRADIENT_LEAVES = (
    Negation, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Flatten, nn.Unflatten,
    nn.Identity, nn.ZeroPad1d, nn.ZeroPad2d, nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d,
)
_RULED_LEAVES = (LinearOrConv, Activation, AvgPool, MaxPool, BatchNorm, Sum, Mean)
_SOFTMAX = (nn.Softmax, nn.LogSoftmax, nn.Softmin)


def _identity_in_eval() -> tuple[type, ...]:
    """Leaves that are the identity in eval mode (where relevance is computed) beyond dropout."""
    from torchvision.ops import StochasticDepth

    return (StochasticDepth,)


def _layer_rule(rule: str, epsilon: float | None):
    if rule not in RULES:
        raise UserError(f"unknown LRP rule '{rule}'; choose one of {', '.join(RULES)}")
    if rule == "epsilon":
        return Epsilon(epsilon=DEFAULT_EPSILON if epsilon is None else float(epsilon))
    if rule == "z":
        return Epsilon(epsilon=Z_RULE_EPSILON if epsilon is None else float(epsilon))
    stabilizer = DEFAULT_EPSILON if epsilon is None else float(epsilon)
    return ZPlus(stabilizer=stabilizer) if rule == "zplus" else AlphaBeta(alpha=1.0, beta=0.0, stabilizer=stabilizer)


def lrp_composite(rule: str = "epsilon", epsilon: float | None = None) -> Composite:
    """The zennit composite for ``rule``: the rule on Linear/Conv, Pass on activations, Norm on sums and avg-pools.

    Out-of-place ReLUs get no hook: their gradient is already Pass here, because every offered rule
    hands a neuron relevance in proportion to its activation, so relevance arriving where a ReLU
    output is zero is zero. Skipping the hook saves zennit's input copy per ReLU.
    """
    layer_map = [
        (Activation, Pass()),
        (Sum, Norm()),
        (AvgPool, Norm()),
        (Mean, Norm()),
        (BatchNorm, Pass()),  # only reached by batch norms the canonizer could not merge
        (LinearOrConv, _layer_rule(rule, epsilon)),
    ]

    def module_map(_ctx, _name, module):
        if type(module) is nn.ReLU and not module.inplace:
            return None
        return next((hook for types, hook in layer_map if isinstance(module, types)), None)

    return Composite(module_map=module_map, canonizers=canonizers())


def check_supported(module: nn.Module) -> None:
    """Raise a :class:`UserError` naming the first leaf module LRP has no rule for.

    A softmax that ends the model is allowed (:func:`logits_of` removes it while relevance is
    computed); one anywhere else is refused.
    """
    final = _final_softmax(module)
    passed = _GRADIENT_LEAVES + _identity_in_eval()
    for name, leaf in module.named_modules():
        if any(True for _ in leaf.children()) or leaf is final:
            continue
        if isinstance(leaf, _SOFTMAX):
            raise UserError(
                f"layer '{name or type(module).__name__}' ({type(leaf).__name__}) turns values into probabilities "
                "inside the model; relevance analysis supports a softmax only as the model's last layer"
            )
        if not isinstance(leaf, _RULED_LEAVES + passed):
            raise UserError(
                f"layer '{name or type(module).__name__}' of type {type(leaf).__name__} is not supported by "
                "relevance propagation (supported: Linear, Conv, activations, max/avg pooling, batch norm, "
                "dropout, stochastic depth, flatten, padding); IDC cannot analyse this model, but the classic "
                f"criteria can ({_classic_only()})"
            )


def _classic_only() -> str:
    """The ``--criteria`` value that measures every classic criterion and not IDC."""
    from mlflow_di.coverage.criteria import CRITERIA

    return f"--criteria {','.join(CRITERIA)}"


def _final_softmax(module: nn.Module) -> nn.Module | None:
    """The softmax module that ends ``module`` (last child of nested Sequentials), or None."""
    last = module
    while isinstance(last, nn.Sequential) and len(last):
        last = last[-1]
    return last if isinstance(last, _SOFTMAX) and last is not module else None


@contextlib.contextmanager
def logits_of(module: nn.Module):
    """``module`` with a final softmax made the identity for the duration (LRP starts from logits)."""
    final = _final_softmax(module)
    if final is None:
        yield module
        return
    hook = final.register_forward_hook(_return_input)
    try:
        yield module
    finally:
        hook.remove()


def _return_input(_module, inputs, _output):
    return inputs[0]


def _check_canonized(module: nn.Module, example: torch.Tensor) -> None:
    """Refuse a model whose forward code still adds/multiplies tensors after canonizing (see canonizers).

    Only the forward rewrites are applied: merging batch norms changes weights, not arithmetic.
    """
    handles = [handle for canonizer in forward_canonizers() for handle in canonizer.apply(module)]
    try:
        with torch.no_grad():
            problem = unhandled_tensor_arithmetic(module, example)
    finally:
        for handle in reversed(handles):
            handle.remove()
    if problem:
        raise UserError(
            f"{problem} in a way relevance propagation cannot split (see docs/how-to/your-own-models.md for what it "
            "can: sums, differences, sigmoid gates, concatenations, means); IDC cannot analyse this model, but the "
            f"classic criteria can ({_classic_only()})"
        )


@dataclasses.dataclass
class LayerRelevance:
    """Relevance and activation of each neuron of some layers, for each input (float32 (N, neurons) arrays).

    ``targets`` is the explained class of each input (by default the predicted one),
    ``predictions`` the predicted class and ``start_relevance`` the explained class's logit, which
    LRP distributes over every layer.
    """

    relevance: dict[str, np.ndarray]
    activations: dict[str, np.ndarray]
    predictions: np.ndarray
    targets: np.ndarray
    start_relevance: np.ndarray

    def subset(self, index) -> "LayerRelevance":
        """The rows of the inputs at ``index`` (slice, int array or bool mask): relevance is per input,
        so this equals the pass over those inputs alone."""
        return LayerRelevance(
            relevance={layer: values[index] for layer, values in self.relevance.items()},
            activations={layer: values[index] for layer, values in self.activations.items()},
            predictions=self.predictions[index], targets=self.targets[index],
            start_relevance=self.start_relevance[index],
        )


def _batched_relevance(module, inputs, layers, include_input, rule, epsilon, targets, batch_size, progress
                       ) -> Iterator[dict]:
    """Per batch: relevance at each layer's output (and the input), activations, predictions, start relevance."""
    check_supported(module)
    composite = lrp_composite(rule, epsilon)
    # traced_once: the check's fx trace also gives the batch-norm pairs the composite's canonizer merges
    with eval_mode(module), logits_of(module), out_of_place(module), traced_once():
        _check_canonized(module, next(iter_batches(inputs[0:1], 1, module_device(module))))
        yield from _hooked_batches(module, composite, inputs, layers=layers, include_input=include_input, rule=rule,
                                   targets=targets, batch_size=batch_size, progress=progress)


def _hooked_batches(module, composite, inputs, layers, include_input, rule, targets, batch_size, progress):
    """The LRP pass proper: zennit's hooks on, one forward+backward per batch."""
    offset = 0
    with composite.context(module) as hooked, LayerRecorder(hooked, layers) as recorder:
        for batch in tqdm(iter_batches(inputs, batch_size, module_device(module)), total=-(-len(inputs) // batch_size),
                          desc=f"relevance ({rule})", disable=not progress, leave=False):
            batch_targets = None if targets is None else targets[offset:offset + len(batch)]
            yield _relevance_of_batch(hooked, recorder, batch, layers, include_input, batch_targets)
            recorder.outputs.clear()
            offset += len(batch)


def _relevance_of_batch(hooked, recorder, batch, layers, include_input, targets) -> dict:
    """Forward under the LRP hooks, then backward from the one-hot target logit to the layers' outputs only."""
    # A new leaf on the same storage, no copy (a 224 px batch of 64 is 38 MB): the caller's tensor keeps
    # requires_grad False, and autograd refuses any in-place change of a leaf that requires grad. A
    # tensor made under torch.inference_mode cannot require grad: it is copied.
    batch = (batch.clone() if batch.is_inference() else batch).detach().requires_grad_(True)
    with torch.enable_grad():
        logits = hooked(batch)
    if logits.ndim != 2:
        raise UserError(f"relevance needs a model that outputs (N, classes) logits; got shape {tuple(logits.shape)}")
    predicted = logits.argmax(dim=1)
    target = predicted if targets is None else torch.as_tensor(targets).long().to(logits.device)
    _check_batch(logits.detach(), target)
    missing = [layer for layer in layers if layer not in recorder.outputs]
    if missing:
        raise UserError(f"layer {missing[0]!r} was not run by the model's forward pass; choose another layer")
    start = logits.detach().gather(1, target[:, None])
    wrt = [recorder.outputs[layer] for layer in layers] + ([batch] if include_input else [])
    # Asking only for these tensors' gradients stops the backward pass there: layers below are not visited.
    grads = torch.autograd.grad(logits, wrt, grad_outputs=torch.zeros_like(logits).scatter(1, target[:, None], start),
                                allow_unused=True)
    for layer, grad in zip(layers, grads):
        if grad is None:
            raise UserError(f"layer '{layer}' does not influence the model's output; choose another layer")
    # tensors where the model is: RowBuffer copies a GPU's to the host once, at the end of the pass
    return {
        "relevance": {layer: _neuron_relevance(grad) for layer, grad in zip(layers, grads)},
        "activations": {layer: neuron_values(recorder.outputs[layer].detach()) for layer in layers},
        "input": grads[-1].detach() if include_input else None,
        "predictions": predicted,
        "targets": target,
        "start": start[:, 0],
    }


def _check_batch(logits: torch.Tensor, target: torch.Tensor) -> None:
    """A UserError for a batch whose logits are not finite or look like probabilities, or a target class out
    of range. The facts come to the host in one read (on a GPU each read waits for the batch)."""
    facts = torch.stack([torch.isfinite(logits).all().double(), _probability_rows(logits).double(),
                         target.min().double(), target.max().double()]).tolist()
    finite, probabilities, lowest, highest = bool(facts[0]), bool(facts[1]), int(facts[2]), int(facts[3])
    if not finite:
        from mlflow_di.models.classifier import check_finite

        check_finite(logits.cpu().numpy(), None, "images of a batch")
    if probabilities:
        raise UserError("the model returns probabilities (a softmax inside its forward code); relevance starts from "
                        "logits: drop the softmax, or end the model with an nn.Softmax module, which is skipped")
    if lowest < 0 or highest >= logits.shape[1]:
        raise UserError(f"target classes must be in 0..{logits.shape[1] - 1}; got {lowest}..{highest}")


def _probability_rows(outputs: torch.Tensor) -> torch.Tensor:
    """Whether every row is non-negative and sums to 1 (a softmax output, not logits), as a bool tensor."""
    return (outputs.min() >= 0) & torch.isclose(outputs.sum(dim=1), torch.ones((), device=outputs.device),
                                                rtol=1e-5, atol=1e-4).all()


def _neuron_relevance(grad: torch.Tensor) -> torch.Tensor:
    """Relevance at a layer's output -> one value per neuron: conv channels sum over their positions."""
    grad = grad.detach()
    return grad.flatten(2).sum(dim=2) if grad.ndim > 2 else grad


def _check_targets(targets, n: int):
    if targets is None:
        return None
    targets = np.asarray(targets).reshape(-1)
    if len(targets) != n:
        raise UserError(f"got {len(targets)} target classes for {n} inputs")
    return targets


def layer_relevance(
    module: nn.Module,
    inputs,
    layers: str | Sequence[str],
    rule: str = "epsilon",
    epsilon: float | None = None,
    targets=None,
    batch_size: int = 256,
    progress: bool = True,
) -> LayerRelevance:
    """Relevance and activations of every neuron of ``layers`` for each input, in one forward+LRP pass.

    ``inputs``: float model input (tensor, array or sliceable of tensors, already preprocessed).
    ``targets``: classes to explain (default: each input's predicted class).
    """
    layers = [layers] if isinstance(layers, str) else list(layers)
    check_layers(module, layers)
    if len(inputs) == 0:
        raise UserError("no inputs to compute relevance for (empty data)")
    targets = _check_targets(targets, len(inputs))
    rows = _gathered(_batched_relevance(module, inputs, layers, include_input=False, rule=rule, epsilon=epsilon,
                                        targets=targets, batch_size=batch_size, progress=progress),
                     len(inputs), ("predictions", "targets", "start"), layers)
    return LayerRelevance(
        relevance={layer: rows[f"relevance:{layer}"] for layer in layers},
        activations={layer: rows[f"activations:{layer}"] for layer in layers},
        predictions=rows["predictions"], targets=rows["targets"], start_relevance=rows["start"],
    )


def _gathered(parts: Iterator[dict], total: int, keys: Sequence[str], layers: Sequence[str] = ()) -> dict:
    """The per-batch results of :func:`_batched_relevance` as (N, ...) arrays: ``keys``, and
    ``relevance:<layer>``/``activations:<layer>`` for ``layers`` (written into preallocated arrays,
    see :class:`~mlflow_di.coverage.activations.RowBuffer`)."""
    rows, start = RowBuffer(total), 0
    for part in parts:
        rows.write(start, {key: part[key] for key in keys})
        rows.write(start, {f"{kind}:{layer}": part[kind][layer] for kind in ("relevance", "activations")
                           for layer in layers})
        start += len(part["predictions"])
    return rows.arrays


def input_relevance(
    module: nn.Module,
    inputs,
    rule: str = "epsilon",
    epsilon: float | None = None,
    targets=None,
    batch_size: int = 256,
    progress: bool = True,
) -> np.ndarray:
    """Relevance of every input value (same shape as ``inputs``), e.g. for heatmaps or relevance-guided mutation."""
    if len(inputs) == 0:
        raise UserError("no inputs to compute relevance for (empty data)")
    targets = _check_targets(targets, len(inputs))
    parts = _batched_relevance(module, inputs, [], include_input=True, rule=rule, epsilon=epsilon, targets=targets,
                               batch_size=batch_size, progress=progress)
    return _gathered(parts, len(inputs), ("input",))["input"]
