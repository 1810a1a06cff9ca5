"""White-box access to a PyTorch classifier: its module, layers and preprocessing.

Importance analysis and the classic criteria need hooks on named layers, so they take a
:class:`TorchModel`; everything black-box takes the :class:`~mlflow_di.models.classifier.Classifier`
that :meth:`TorchModel.classifier` gives.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.models.classifier import TorchClassifier
from mlflow_di.models.device import module_device
from mlflow_di.models.preprocessing import Preprocessing


@dataclasses.dataclass
class LayerInfo:
    """One named module: its type, output shape for one input (no batch axis), and neuron count.

    A neuron of a conv layer is a channel, so a (C, H, W) output has C neurons.
    """

    name: str
    type: str
    output_shape: tuple[int, ...]
    neurons: int
    parameters: int


@dataclasses.dataclass
class TorchModel:
    """A PyTorch classifier with the preprocessing that turns raw uint8 NHWC images into its input."""

    module: nn.Module
    preprocessing: Preprocessing
    name: str = "pytorch-model"
    metadata: dict = dataclasses.field(default_factory=dict)
    #: how another process loads the same model (``models.origin.Origin``), set by ``load_torch_model``
    origin: object = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.module, nn.Module):
            raise UserError(f"{self.name} is not a PyTorch nn.Module (got {type(self.module).__name__})")
        if isinstance(self.module, torch.fx.GraphModule) and not any(True for _ in self.module.children()):
            raise UserError(
                f"{self.name} is a flat torch.fx graph without layers to hook; pass the module itself, or load "
                "a pt2 file with mlflow_di.models.pt2.load_pt2, which rebuilds the layers"
            )
        self.module.eval()

    def to(self, device) -> "TorchModel":
        """Move the module to ``device`` (a ``torch.device`` or string); engines follow the module."""
        self.module.to(device)
        return self

    @property
    def device(self) -> torch.device:
        """Where the module's parameters live; every batch is sent there."""
        return module_device(self.module)

    def to_tensor(self, images: np.ndarray) -> torch.Tensor:
        """Raw uint8 NHWC images -> float32 model input tensor (on the CPU)."""
        return torch.from_numpy(self.preprocessing.apply(images))

    def inputs_on_device(self, images: np.ndarray) -> torch.Tensor:
        """Raw uint8 NHWC images -> float32 model input on the model's device (:meth:`Preprocessing.tensor_on`)."""
        return self.preprocessing.tensor_on(images, self.device)

    def classifier(self) -> TorchClassifier:
        """The same model as a black box (probabilities from raw images)."""
        return TorchClassifier(self.module, self.preprocessing, self.name)

    def layer_names(self) -> list[str]:
        """Names of all sub-modules, in definition order (``fc2``, ``fc2.0``, ...)."""
        return [name for name, _ in self.module.named_modules() if name]

    def module_by_name(self, name: str) -> nn.Module:
        """The sub-module called ``name``; a :class:`UserError` listing the layers if there is none."""
        modules = dict(self.module.named_modules())
        if not name or name not in modules:
            raise UserError(f"{self.name} has no layer '{name}'; available layers: {', '.join(self.layer_names())}")
        return modules[name]

    def describe_layers(self) -> list[LayerInfo]:
        """Every named module with its output shape for one input, found by one forward pass."""
        if self.preprocessing.input_shape is None:
            raise UserError(f"{self.name}: input shape unknown; set it with --preprocessing input_shape=H/W/C")
        shapes: dict[str, tuple[int, ...]] = {}
        hooks = [
            module.register_forward_hook(lambda _m, _i, out, name=name: shapes.__setitem__(name, tuple(out.shape[1:])))
            for name, module in self.module.named_modules() if name
        ]
        try:
            with torch.no_grad():
                self.module(self.to_tensor(np.zeros((1, *self.preprocessing.input_shape), np.uint8)).to(self.device))
        except RuntimeError as exc:  # torch's own shape error
            raise self.preprocessing.shape_mismatch(self.name, exc) from None
        finally:
            for hook in hooks:
                hook.remove()
        return [  # definition order: hooks fire children-first, which would list fc2.0 before fc2
            LayerInfo(name, type(module).__name__, shapes[name], shapes[name][0] if shapes[name] else 0,
                      sum(p.numel() for p in module.parameters()))
            for name, module in self.module.named_modules() if name in shapes
        ]
