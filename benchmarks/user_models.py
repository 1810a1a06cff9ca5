"""CNNs written the way users write them, for the white-box commands to meet as users bring them.

Each is an ``nn.Module`` with the arithmetic in its own ``forward`` (not in torchvision's blocks, whose
canonizers are known by type): a residual addition and one pooling module called twice (the model of
issue #65, at 28x28), a pre-activation residual, two branches concatenated with a difference, a
squeeze-excitation gate through a reshape, a depthwise-separable inverted residual, one block applied
twice, a global-average-pooling head written as ``x.mean((2, 3))``, and a concatenation of two
resolutions through a functional average pool. The others take the digits' 8x8 grey images.

:func:`trained` trains one briefly on the digits (seeded), :func:`log_as_users_do` logs it as users do:
``mlflow.pytorch.log_model`` with MLflow's defaults (pt2), the same with ``serialization_format="pickle"``,
and ``torch.onnx.export`` (its default exporter) + ``mlflow.onnx.log_model``. Used by
``tests/test_user_models.py`` and ``benchmarks/bench_user_models.py``.
"""
from __future__ import annotations

import pathlib

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)
import torch
import torch.nn.functional as F
from torch import nn


class OwnCNN(nn.Module):
    """The model of issue #65, as written there: a residual add in ``forward``, ``self.pool`` used twice (28x28)."""

    size = 28

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 7 * 7, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        r = self.bn2(self.conv2(h))
        h = torch.relu(h + r)                      # residual add
        h = self.pool(h)
        h = self.pool(torch.relu(self.conv3(h)))   # one pool module used twice
        return self.fc2(torch.relu(self.fc1(torch.flatten(h, 1))))


class PreActResidual(nn.Module):
    """A pre-activation residual block (batch norm and ReLU before each convolution) in the model's own code."""

    size = 8

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.bn_a, self.conv_a = nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.bn_b, self.conv_b = nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = self.stem(x)
        y = self.conv_a(torch.relu(self.bn_a(x)))
        y = self.conv_b(torch.relu(self.bn_b(y)))
        x = F.max_pool2d(torch.relu(x + y), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class TwoBranches(nn.Module):
    """Inception-like: a 1x1 and a 3x3 branch, concatenated with their difference."""

    size = 8

    def __init__(self):
        super().__init__()
        self.one = nn.Conv2d(1, 6, 1)
        self.three = nn.Conv2d(1, 6, 3, padding=1)
        self.mix = nn.Conv2d(18, 12, 3, padding=1)
        self.fc1 = nn.Linear(12 * 4 * 4, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        a, b = torch.relu(self.one(x)), torch.relu(self.three(x))
        h = torch.relu(self.mix(torch.cat([a, b, b - a], dim=1)))
        h = F.max_pool2d(h, 2)
        return self.fc2(torch.relu(self.fc1(torch.flatten(h, 1))))


class SqueezeExcite(nn.Module):
    """A squeeze-excitation gate written out: a global mean, two dense layers, a sigmoid reshaped onto the channels."""

    size = 8

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 12, 3, padding=1)
        self.squeeze = nn.Linear(12, 4)
        self.excite = nn.Linear(4, 12)
        self.conv2 = nn.Conv2d(12, 12, 3, padding=1)
        self.fc1 = nn.Linear(12 * 4 * 4, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        w = torch.sigmoid(self.excite(torch.relu(self.squeeze(h.mean((2, 3))))))
        h = h * w[:, :, None, None]                # the gate
        h = F.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc2(torch.relu(self.fc1(h.flatten(1))))


class InvertedResidual(nn.Module):
    """MobileNet-like: expand (1x1), depthwise (3x3, groups), project (1x1), added to the block's input."""

    size = 8

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.expand = nn.Conv2d(8, 24, 1)
        self.depthwise = nn.Conv2d(24, 24, 3, padding=1, groups=24)
        self.project = nn.Conv2d(24, 8, 1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 4 * 4, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = self.bn(self.project(F.relu6(self.depthwise(F.relu6(self.expand(x))))))
        x = F.max_pool2d(x + y, 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class SharedBlock(nn.Module):
    """One block (convolution, batch norm, ReLU) applied twice."""

    size = 8

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc1 = nn.Linear(8 * 4 * 4, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        x = self.block(self.block(torch.relu(self.stem(x))))
        return self.fc2(torch.relu(self.fc1(F.max_pool2d(x, 2).flatten(1))))


class MeanHead(nn.Module):
    """A global-average-pooling head written as ``x.mean((2, 3))``."""

    size = 8

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc2(torch.relu(self.fc1(h.mean((2, 3)))))


class TwoResolutions(nn.Module):
    """Features at two resolutions concatenated: the first pooled functionally down to the second's size."""

    size = 8

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2 * 2, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        fine = F.max_pool2d(torch.relu(self.conv1(x)), 2)          # 4x4
        coarse = F.max_pool2d(torch.relu(self.conv2(fine)), 2)    # 2x2
        both = torch.cat([torch.flatten(F.avg_pool2d(fine, 2), 1), torch.flatten(coarse, 1)], dim=1)
        return self.fc2(torch.relu(self.fc1(both)))


#: name -> class, in the order the table lists them
MODELS = {"own-cnn": OwnCNN, "preact-residual": PreActResidual, "two-branches": TwoBranches,
          "squeeze-excite": SqueezeExcite, "inverted-residual": InvertedResidual, "shared-block": SharedBlock,
          "mean-head": MeanHead, "two-resolutions": TwoResolutions}


def inputs(model_class, images: np.ndarray) -> torch.Tensor:
    """uint8 NHWC digits as the model takes them: /255, NCHW, resized to its size (as ``--preprocessing resize``)."""
    x = torch.from_numpy(np.asarray(images, np.float32) / 255.0).permute(0, 3, 1, 2)
    if x.shape[-1] != model_class.size:
        x = F.interpolate(x, size=(model_class.size, model_class.size), mode="bilinear", align_corners=False)
    return x


def trained(name: str, epochs: int = 8, seed: int = 0) -> nn.Module:
    """The model ``name`` trained on digits[0:1300] (Adam, batches of 64, seeded), in eval mode."""
    from mlflow_di.data import load_images

    torch.manual_seed(seed)
    model_class = MODELS[name]
    model = model_class()
    train = load_images("digits[0:1300]")
    x, y = inputs(model_class, train.images), torch.from_numpy(train.labels).long()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), 64):
            batch = order[start:start + 64]
            optimizer.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    return model.eval()


def log_as_users_do(model: nn.Module, name: str, folder: pathlib.Path, onnx_dynamo: bool = True) -> dict[str, str]:
    """``model`` logged and registered three ways (names ``NAME-pt2``, ``NAME-pickle``, ``NAME-onnx``) with an
    input example in 0..1 and no mlflow_di block; {form: models:/ URI}."""
    import mlflow
    import onnx

    example = np.random.default_rng(0).random((2, 1, model.size, model.size), dtype=np.float32)
    path = pathlib.Path(folder) / f"{name}.onnx"
    if onnx_dynamo:
        torch.onnx.export(model, (torch.from_numpy(example),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_shapes={"x": {0: torch.export.Dim("batch")}}, verbose=False)
    else:
        torch.onnx.export(model, (torch.from_numpy(example),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "n"}, "y": {0: "n"}}, dynamo=False)
    with mlflow.start_run():
        mlflow.pytorch.log_model(model, name="pt2", registered_model_name=f"{name}-pt2", input_example=example)
        mlflow.pytorch.log_model(model, name="pickle", registered_model_name=f"{name}-pickle", input_example=example,
                                 serialization_format="pickle")
        mlflow.onnx.log_model(onnx.load(str(path)), name="onnx", registered_model_name=f"{name}-onnx",
                              input_example=example)
    return {form: f"models:/{name}-{form}/1" for form in ("pt2", "pickle", "onnx")}


def forms(model: nn.Module, folder: pathlib.Path) -> dict[str, nn.Module]:
    """``model`` as each format's white-box view sees it, without MLflow: itself (what a pickle loads), rebuilt
    from ``torch.export`` (what a pt2 loads) and converted from ``torch.onnx.export``'s default exporter."""
    from mlflow_di.models.onnx_torch import onnx_to_torch
    from mlflow_di.models.pt2 import rebuild

    example = torch.rand(2, 1, model.size, model.size, generator=torch.Generator().manual_seed(0))
    path = pathlib.Path(folder) / f"{type(model).__name__}.onnx"
    torch.onnx.export(model, (example,), str(path), input_names=["x"], output_names=["y"],
                      dynamic_shapes={"x": {0: torch.export.Dim("batch")}}, verbose=False)
    return {"pickle": model, "pt2": rebuild(torch.export.export(model, (example,))), "onnx": onnx_to_torch(path)}
