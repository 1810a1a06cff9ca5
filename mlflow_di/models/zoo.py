"""PyTorch reference architectures: the papers' LeNets, the DFlare ResNet-20 and a tiny digits CNN.

Every model is an ``nn.Sequential`` whose top-level named children are the layers users name on
the command line (``conv1``, ``pool1``, ``fc2``, ``before_softmax``, ...). Convolution and dense
blocks are ``nn.Sequential(layer, ReLU)`` so that a block's output is the post-activation value,
as in Keras where the activation is part of the layer. Models return logits (no softmax).

The topologies reproduce the Keras originals exactly (so :mod:`mlflow_di.models.keras_import` can
load their weights): the DeepImportance LeNets use 5x5 'valid' convolutions, the DFlare LeNets
5x5 'same' ones, and the DFlare ResNet-20 is a pre-activation residual net (BN -> ReLU -> conv),
whose stride-2 'same' convolutions pad like TensorFlow (one extra row/column at the bottom/right).

Only standard modules and the classes defined here are used, so models pickle by import path
(``mlflow.pytorch`` stores them that way).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.models.preprocessing import Preprocessing

MNIST_PREPROCESSING = Preprocessing(scale=1.0 / 255.0, layout="NCHW", output="logits", input_shape=(28, 28, 1))
CIFAR10_PREPROCESSING = Preprocessing(
    scale=1.0,
    mean=(125.307, 122.95, 113.865),
    std=(62.9932, 62.0887, 66.7048),
    layout="NCHW",
    output="logits",
    input_shape=(32, 32, 3),
)
DIGITS_PREPROCESSING = Preprocessing(scale=1.0 / 255.0, layout="NCHW", output="logits", input_shape=(8, 8, 1))


@dataclasses.dataclass(frozen=True)
class ArchitectureSpec:
    """How to build one architecture and what raw input it expects.

    ``input_shape`` is (H, W, C) of one raw image; ``preprocessing`` is the default that turns
    raw uint8 images into the model's input (the Keras originals' own preprocessing).
    """

    name: str
    builder: Callable[[], nn.Module]
    input_shape: tuple[int, int, int]
    preprocessing: Preprocessing
    description: str


def conv_relu(in_channels: int, out_channels: int, kernel_size: int, padding: int = 0) -> nn.Sequential:
    """A convolution followed by ReLU, one named layer (like a Keras Conv2D with activation='relu')."""
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding), nn.ReLU())


def dense_relu(in_features: int, out_features: int) -> nn.Sequential:
    """A dense layer followed by ReLU, one named layer (like a Keras Dense with activation='relu')."""
    return nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU())


def lenet(channels: tuple[int, int], hidden: tuple[int, ...], padding: int, image_size: int = 28) -> nn.Sequential:
    """A LeNet: two 5x5 conv-ReLU + 2x2 max-pool stages, flatten, dense-ReLU layers, logits.

    ``padding`` is 0 for Keras 'valid' and 2 for 'same' (stride 1, so symmetric padding is exact).
    Dense layers are named fc1, fc2, ... and the logits layer ``before_softmax``.
    """
    size = image_size
    for _ in range(2):
        size = (size + 2 * padding - 4) // 2
    layers: dict[str, nn.Module] = {
        "conv1": conv_relu(1, channels[0], 5, padding),
        "pool1": nn.MaxPool2d(2),
        "conv2": conv_relu(channels[0], channels[1], 5, padding),
        "pool2": nn.MaxPool2d(2),
        "flatten": nn.Flatten(),
    }
    features = channels[1] * size * size
    for index, units in enumerate(hidden, start=1):
        layers[f"fc{index}"] = dense_relu(features, units)
        features = units
    layers["before_softmax"] = nn.Linear(features, 10)
    return nn.Sequential(collections.OrderedDict(layers))


class PreActResidualBlock(nn.Module):
    """One pre-activation residual block of the DFlare ResNet-20 (Keras resnet_v2-style layout).

    out = x + conv_b(relu(bn_b(conv_a(relu(bn_a(x)))))) when the shape is kept; when it changes
    (``stride`` 2), the identity is replaced by a 1x1 stride-2 convolution of the *raw* input x,
    exactly as in the Keras graph. Submodules are registered in the order Keras stores the layers
    (bn_a, conv_a, bn_b, conv_b, shortcut) so weights load by position.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.bn_a = nn.BatchNorm2d(in_channels)
        self.relu_a = nn.ReLU()
        # TF 'same' with stride 2 on an even size pads 0 before and 1 after; stride 1 pads 1 each side.
        pad = (0, 1, 0, 1) if stride == 2 else (1, 1, 1, 1)
        self.conv_a = nn.Sequential(nn.ZeroPad2d(pad), nn.Conv2d(in_channels, out_channels, 3, stride=stride))
        self.bn_b = nn.BatchNorm2d(out_channels)
        self.relu_b = nn.ReLU()
        self.conv_b = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        # A 1x1 stride-2 'same' convolution needs no padding at all on an even size.
        self.shortcut = (
            nn.Conv2d(in_channels, out_channels, 1, stride=stride)
            if stride != 1 or in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.conv_a(self.relu_a(self.bn_a(x)))
        residual = self.conv_b(self.relu_b(self.bn_b(residual)))
        return self.shortcut(x) + residual


def resnet20(num_classes: int = 10) -> nn.Sequential:
    """The DFlare ResNet-20 for 32x32x3 CIFAR-10: conv, 3 stages x 3 blocks (16/32/64), BN-ReLU, GAP, dense.

    Layers: conv1 (stem, no activation: its raw output is the first residual stream),
    stage{1,2,3}_block{1,2,3}, post_bn (BN + ReLU), pool (global average), flatten, before_softmax.
    """
    layers: dict[str, nn.Module] = {"conv1": nn.Conv2d(3, 16, 3, padding=1)}
    in_channels = 16
    for stage, channels in enumerate((16, 32, 64), start=1):
        for block in range(1, 4):
            stride = 2 if stage > 1 and block == 1 else 1
            layers[f"stage{stage}_block{block}"] = PreActResidualBlock(in_channels, channels, stride)
            in_channels = channels
    layers["post_bn"] = nn.Sequential(nn.BatchNorm2d(in_channels), nn.ReLU())
    layers["pool"] = nn.AdaptiveAvgPool2d(1)
    layers["flatten"] = nn.Flatten()
    layers["before_softmax"] = nn.Linear(in_channels, num_classes)
    return nn.Sequential(collections.OrderedDict(layers))


def digits_cnn() -> nn.Sequential:
    """A small CNN for scikit-learn's 8x8 digits: trains to >95% in seconds on a CPU."""
    layers: dict[str, nn.Module] = {
        "conv1": conv_relu(1, 8, 3, padding=1),
        "pool1": nn.MaxPool2d(2),
        "conv2": conv_relu(8, 16, 3, padding=1),
        "pool2": nn.MaxPool2d(2),
        "flatten": nn.Flatten(),
        "fc1": dense_relu(16 * 2 * 2, 32),
        "before_softmax": nn.Linear(32, 10),
    }
    return nn.Sequential(collections.OrderedDict(layers))


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    spec.name: spec
    for spec in (
        ArchitectureSpec("lenet1", lambda: lenet((4, 12), (), padding=0), (28, 28, 1), MNIST_PREPROCESSING,
                         "DeepImportance LeNet-1 (5x5 valid convs, flatten 192)"),
        ArchitectureSpec("lenet4", lambda: lenet((6, 16), (84,), padding=0), (28, 28, 1), MNIST_PREPROCESSING,
                         "DeepImportance LeNet-4 (5x5 valid convs, flatten 256, fc1 84)"),
        ArchitectureSpec("lenet5", lambda: lenet((6, 16), (120, 84), padding=0), (28, 28, 1), MNIST_PREPROCESSING,
                         "DeepImportance LeNet-5 (5x5 valid convs, flatten 256, fc1 120, fc2 84)"),
        ArchitectureSpec("lenet1-same", lambda: lenet((4, 12), (), padding=2), (28, 28, 1), MNIST_PREPROCESSING,
                         "DFlare LeNet-1 (5x5 same convs, flatten 588)"),
        ArchitectureSpec("lenet5-same", lambda: lenet((6, 16), (120, 84), padding=2), (28, 28, 1),
                         MNIST_PREPROCESSING, "DFlare LeNet-5 (5x5 same convs, flatten 784, fc1 120, fc2 84)"),
        ArchitectureSpec("resnet20", resnet20, (32, 32, 3), CIFAR10_PREPROCESSING,
                         "DFlare ResNet-20 for CIFAR-10 (pre-activation blocks, BN, 1x1 stride-2 shortcuts)"),
        ArchitectureSpec("digits-cnn", digits_cnn, (8, 8, 1), DIGITS_PREPROCESSING,
                         "small CNN for scikit-learn's 8x8 digits (conv8, conv16, fc1 32)"),
    )
}


def architecture(arch: str) -> ArchitectureSpec:
    """The spec of a known architecture; a :class:`UserError` listing the known ones otherwise."""
    try:
        return ARCHITECTURES[arch]
    except (KeyError, TypeError):
        raise UserError(f"unknown architecture '{arch}'; known: {', '.join(ARCHITECTURES)}") from None


def build(arch: str, seed: int | None = 0) -> nn.Module:
    """A freshly initialised model of architecture ``arch``, in eval mode.

    Weights are initialised from ``torch.manual_seed(seed)`` inside a forked RNG (the global torch
    RNG is left untouched), so the same seed gives the same weights; ``seed=None`` uses the
    global RNG as it stands.
    """
    spec = architecture(arch)
    if seed is None:
        module = spec.builder()
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = spec.builder()
    return module.eval()
