"""Train a small classifier in seconds (the demo's digits-cnn): Adam, cross-entropy, seeded.

Batches are shuffled by an explicit ``torch.Generator`` seeded with ``seed`` and nothing else is
random, so the same module, data and seed give the same weights and losses. Training runs on one
CPU thread by default: float sums depend on the thread count, so this keeps results the same on
any machine, and a model this small trains faster without thread synchronisation, which costs
most on a busy machine.
Interrupting (Ctrl-C, or SIGTERM where the caller made it one) raises on to the caller with the
module back in eval mode: a half-trained model is not what anyone asked for, and a harness that
trains many models must stop rather than go on with the next one.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from mlflow_di.progress import progress_bar as tqdm

from mlflow_di.errors import UserError
from mlflow_di.models.device import module_device


def train_classifier(
    module: nn.Module,
    images: np.ndarray | torch.Tensor,
    labels: np.ndarray | torch.Tensor,
    epochs: int = 20,
    lr: float = 1e-2,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = True,
    num_threads: int | None = 1,
    optimizer: str = "adam",
) -> list[float]:
    """Train ``module`` in place on preprocessed float images (N, C, H, W); return the mean loss per epoch.

    Training runs where the module's parameters are (move it first, e.g. ``module.to("cuda")``);
    the data stay on the CPU and go to that device one batch at a time.
    The module is left in eval mode. Images must already be the model's input (e.g. from
    ``Preprocessing.apply``); labels are class indices. ``num_threads`` sets torch's CPU threads
    while training (restored afterwards); ``None`` keeps the current setting. ``optimizer``:
    ``adam``, or ``adadelta`` with Keras 2's defaults (rho 0.95, epsilon 1e-7; the IDC site's
    recipe is adadelta with lr 1.0).
    """
    inputs = torch.as_tensor(np.asarray(images, dtype=np.float32) if isinstance(images, np.ndarray) else images).float()
    targets = torch.as_tensor(np.asarray(labels) if isinstance(labels, np.ndarray) else labels).long().reshape(-1)
    _check_training_data(inputs, targets, epochs, batch_size)
    generator = torch.Generator().manual_seed(seed)
    optimizer = _optimizer(optimizer, module, lr)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    module.train()
    bar = tqdm(range(epochs), desc="training", unit="epoch", disable=not progress)
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        for _ in bar:
            losses.append(_train_one_epoch(module, inputs, targets, batch_size=batch_size, optimizer=optimizer,
                                           loss_fn=loss_fn, generator=generator))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    finally:  # interrupted (Ctrl-C, SIGTERM): the interrupt goes on to the caller; a half-trained model is not one
        torch.set_num_threads(previous_threads)
        bar.close()
        module.eval()
    return losses


OPTIMIZERS = ("adam", "adadelta")


def _optimizer(name: str, module: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(module.parameters(), lr=lr)
    if name == "adadelta":
        return torch.optim.Adadelta(module.parameters(), lr=lr, rho=0.95, eps=1e-7)
    raise UserError(f"unknown optimizer '{name}'; choose one of {', '.join(OPTIMIZERS)}")


def keras_initialise(module: nn.Module, seed: int) -> nn.Module:
    """Initialise every Linear/Conv as Keras 2 does by default (Glorot-uniform weights, zero biases),
    from ``seed`` (the global torch RNG is left untouched); returns ``module``."""
    generator = torch.Generator().manual_seed(seed)
    for layer in module.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d)):
            fan_out, fan_in = layer.weight.shape[0], layer.weight[0].numel()
            if isinstance(layer, nn.Conv2d):
                fan_out *= layer.weight[0, 0].numel()
            bound = (6.0 / (fan_in + fan_out)) ** 0.5
            with torch.no_grad():
                layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 * bound - bound)
                if layer.bias is not None:
                    layer.bias.zero_()
    return module


def _train_one_epoch(module, inputs, targets, batch_size, optimizer, loss_fn, generator) -> float:
    """One pass over the data in a seeded random order; each batch goes to the module's device."""
    device = module_device(module)
    order = torch.randperm(len(inputs), generator=generator)
    total = 0.0
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        optimizer.zero_grad()
        loss = loss_fn(module(inputs[batch].to(device)), targets[batch].to(device))
        loss.backward()
        optimizer.step()
        total += loss.item() * len(batch)
    return total / len(order)


def _check_training_data(inputs: torch.Tensor, targets: torch.Tensor, epochs: int, batch_size: int) -> None:
    if inputs.ndim != 4:
        raise UserError(f"training images must be a float batch (N, C, H, W), got shape {tuple(inputs.shape)}")
    if len(inputs) != len(targets):
        raise UserError(f"{len(inputs)} training images but {len(targets)} labels")
    if len(inputs) == 0:
        raise UserError("no training images given")
    if epochs < 1 or batch_size < 1:
        raise UserError(f"epochs and batch_size must be positive, got epochs={epochs}, batch_size={batch_size}")


def train_zoo_model(arch: str, data, epochs: int, seed: int = 0, name: str | None = None, progress: bool = False):
    """A :class:`~mlflow_di.models.torch_model.TorchModel` of zoo architecture ``arch`` (built with
    ``seed``) trained on ``data`` (an ImageSet of raw images) for ``epochs``."""
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    model = TorchModel(zoo.build(arch, seed=seed), zoo.architecture(arch).preprocessing, name=name or arch,
                       metadata={"arch": arch})
    train_classifier(model.module, model.to_tensor(np.asarray(data.images)), torch.from_numpy(data.labels),
                     epochs=epochs, seed=seed, progress=progress)
    return model
