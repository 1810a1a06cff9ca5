"""Load Keras HDF5 weights into the PyTorch reference architectures (h5py only, no TensorFlow).

Keras saves each layer's weights under ``model_weights/<layer>/`` and lists the layers in file
order in the ``layer_names`` attribute; Keras itself loads weights by that order. We do the same:
the k-th Keras layer with weights goes to the k-th weighted PyTorch module (Conv2d, Linear,
BatchNorm2d) of the architecture, in registration order (the zoo registers them in Keras order).
Every pairing is checked (layer kind and every shape) and every array in the file must be used,
so a file that does not fit the architecture fails with one line naming the layer and both shapes.

Layout conversions: conv kernels HWIO -> OIHW; dense kernels (in, out) -> (out, in); the first
dense layer after a flatten of a (C, H, W) map has its rows reordered from Keras' (h, w, c)
flatten order to PyTorch's (c, h, w); BatchNorm takes gamma/beta/moving mean/variance and the
epsilon from the Keras config (the model config inside the file, or a sibling ``.json``).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import pathlib

import numpy as np
import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.models import zoo
from mlflow_di.models.torch_model import TorchModel

KERAS_BN_EPSILON = 1e-3  # Keras' default, used when the file carries no config
_WEIGHTED_MODULES = (nn.Conv2d, nn.Linear, nn.BatchNorm2d)
_KIND_OF_MODULE = {nn.Conv2d: "Conv2D", nn.Linear: "Dense", nn.BatchNorm2d: "BatchNormalization"}


@dataclasses.dataclass
class KerasLayer:
    """The weights of one Keras layer: ``arrays`` by short name (kernel, bias, gamma, ...)."""

    name: str
    kind: str
    arrays: dict[str, np.ndarray]
    config: dict

    def take(self, key: str) -> np.ndarray:
        """Remove and return one array; a missing one is a file/architecture mismatch."""
        if key not in self.arrays:
            raise UserError(f"Keras layer '{self.name}' has no '{key}' weight (it has {sorted(self.arrays)})")
        return self.arrays.pop(key)


def read_keras_layers(weights_path) -> list[KerasLayer]:
    """The layers with weights of a Keras HDF5 file (full model or ``save_weights``), in file order."""
    import h5py

    path = pathlib.Path(weights_path)
    if not path.is_file():
        raise UserError(f"Keras weights file '{weights_path}' does not exist")
    try:
        handle = h5py.File(path, "r")
    except OSError:
        raise UserError(f"'{weights_path}' is not a Keras HDF5 file (h5py cannot open it)") from None
    with handle:
        group = handle["model_weights"] if "model_weights" in handle else handle
        if "layer_names" not in group.attrs:
            raise UserError(f"'{weights_path}' is HDF5 but not a Keras weights file (no 'layer_names' attribute)")
        configs = _layer_configs(handle, path)
        layers = []
        for raw_name in group.attrs["layer_names"]:
            name = _text(raw_name)
            weight_names = [_text(w) for w in group[name].attrs.get("weight_names", [])]
            if not weight_names:
                continue
            arrays = {_short_name(w): np.asarray(group[name][w], dtype=np.float32) for w in weight_names}
            kind, config = configs.get(name, (_infer_kind(arrays), {}))
            layers.append(KerasLayer(name, kind, arrays, config))
    return layers


def _text(value) -> str:
    return value.decode("utf8") if isinstance(value, bytes) else str(value)


def _short_name(weight_name: str) -> str:
    """'fc1_1/kernel:0' -> 'kernel'."""
    return weight_name.rsplit("/", 1)[-1].split(":", 1)[0]


def _layer_configs(handle, path: pathlib.Path) -> dict[str, tuple[str, dict]]:
    """Layer name -> (class name, config) from the model config in the file or a sibling .json."""
    text = handle.attrs.get("model_config")
    sibling = path.with_suffix(".json")
    if text is None and sibling.is_file():
        text = sibling.read_text()
    if text is None:
        return {}
    config = json.loads(_text(text))["config"]
    layers = config["layers"] if isinstance(config, dict) else config  # Model vs old Sequential
    return {layer["config"]["name"]: (layer["class_name"], layer["config"]) for layer in layers}


def _infer_kind(arrays: dict[str, np.ndarray]) -> str:
    if "moving_mean" in arrays:
        return "BatchNormalization"
    kernel = arrays.get("kernel")
    if kernel is not None and kernel.ndim == 4:
        return "Conv2D"
    if kernel is not None and kernel.ndim == 2:
        return "Dense"
    return "unknown"


def weighted_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold Keras-style weights, in registration order, with their dotted names."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, _WEIGHTED_MODULES)]


def flatten_shapes(module: nn.Module, input_shape: tuple[int, int, int]) -> dict[nn.Module, tuple[int, int, int]]:
    """For each Linear fed by an ``nn.Flatten`` of a (C, H, W) map: that map's shape.

    Found by running one blank input and watching the call order, so it works for any topology.
    """
    calls: list[tuple[nn.Module, tuple[int, ...]]] = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: calls.append((mod, tuple(args[0].shape))))
        for m in module.modules()
        if isinstance(m, (nn.Flatten, nn.Linear))
    ]
    height, width, channels = input_shape
    try:
        with torch.no_grad():
            module(torch.zeros(1, channels, height, width))
    finally:
        for hook in hooks:
            hook.remove()
    shapes, pending = {}, None
    for mod, shape in calls:
        if isinstance(mod, nn.Flatten):
            pending = shape[1:] if len(shape) == 4 else None
        elif pending is not None:
            shapes[mod] = pending
            pending = None
    return shapes


def load_keras_weights(arch: str, weights_path) -> nn.Module:
    """A ``zoo`` model of architecture ``arch`` holding the weights of a Keras HDF5 file, in eval mode."""
    spec = zoo.architecture(arch)
    module = zoo.build(arch)
    layers = read_keras_layers(weights_path)
    targets = weighted_modules(module)
    if len(layers) != len(targets):
        raise UserError(
            f"'{weights_path}' has {len(layers)} layers with weights ({_kinds(layer.kind for layer in layers)}) but "
            f"architecture '{arch}' has {len(targets)} ({_kinds(_KIND_OF_MODULE[type(m)] for _, m in targets)}); "
            f"{_fitting_hint(layers)}"
        )
    flattened = flatten_shapes(module, spec.input_shape)
    for layer, (torch_name, target) in zip(layers, targets):
        _load_layer(layer, torch_name, target, flattened.get(target), arch, layers)
    return module.eval()


def import_keras(arch: str, weights_path, name: str | None = None) -> TorchModel:
    """A :class:`~mlflow_di.models.torch_model.TorchModel` of ``arch`` with Keras weights and the arch's preprocessing."""
    module = load_keras_weights(arch, weights_path)
    return TorchModel(
        module,
        zoo.architecture(arch).preprocessing,
        name or pathlib.Path(weights_path).stem,
        metadata={"arch": arch, "keras_weights": str(weights_path)},
    )


def _kinds(kinds) -> str:
    """'2 conv, 1 dense' from layer kinds, for count-mismatch messages."""
    short = {"Conv2D": "conv", "Dense": "dense", "BatchNormalization": "bn"}
    counts = collections.Counter(short.get(kind, kind) for kind in kinds)
    return ", ".join(f"{count} {kind}" for kind, count in counts.items())


def _load_layer(layer: KerasLayer, torch_name: str, target: nn.Module, flatten_shape, arch, all_layers) -> None:
    expected_kind = _KIND_OF_MODULE[type(target)]
    if layer.config.get("data_format") == "channels_first":
        raise UserError(f"Keras layer '{layer.name}' is channels_first; only channels_last (NHWC) Keras models are supported")
    if layer.kind != expected_kind:
        raise UserError(
            f"Keras layer '{layer.name}' is a {layer.kind} but architecture '{arch}' has a {expected_kind} "
            f"('{torch_name}') at that position; {_fitting_hint(all_layers)}"
        )
    working = dataclasses.replace(layer, arrays=dict(layer.arrays))  # keep `layer` whole for _fitting_hint
    tensors = _converted(working, target, flatten_shape)
    unused = sorted(working.arrays)
    if unused:
        raise UserError(f"Keras layer '{layer.name}' has weights {unused} that '{arch}' layer '{torch_name}' cannot use")
    with torch.no_grad():
        for attribute, value in tensors.items():
            current = getattr(target, attribute)
            if current is None or tuple(current.shape) != value.shape:
                raise UserError(
                    f"Keras layer '{layer.name}' {_keras_key(target, attribute)} "
                    f"has shape {_keras_shape(target, attribute, value.shape)} "
                    f"but '{arch}' layer '{torch_name}' expects "
                    f"{None if current is None else _keras_shape(target, attribute, tuple(current.shape))}; "
                    f"{_fitting_hint(all_layers)}"
                )
            current.copy_(torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(target, nn.BatchNorm2d):
        target.eps = float(layer.config.get("epsilon", KERAS_BN_EPSILON))


def _converted(layer: KerasLayer, target: nn.Module, flatten_shape) -> dict[str, np.ndarray]:
    """PyTorch attribute name -> array in PyTorch layout, consuming the layer's arrays."""
    if isinstance(target, nn.BatchNorm2d):
        channels = target.num_features
        gamma = layer.arrays.pop("gamma", np.ones(channels, np.float32))  # absent when scale=False
        beta = layer.arrays.pop("beta", np.zeros(channels, np.float32))  # absent when center=False
        return {
            "weight": gamma,
            "bias": beta,
            "running_mean": layer.take("moving_mean"),
            "running_var": layer.take("moving_variance"),
        }
    kernel = layer.take("kernel")
    tensors = {}
    if isinstance(target, nn.Conv2d):
        if kernel.ndim != 4:
            raise UserError(f"Keras layer '{layer.name}' kernel has shape {kernel.shape}; a conv kernel is 4-D (H, W, in, out)")
        tensors["weight"] = kernel.transpose(3, 2, 0, 1)  # HWIO -> OIHW
    else:
        if kernel.ndim != 2:
            raise UserError(f"Keras layer '{layer.name}' kernel has shape {kernel.shape}; a dense kernel is 2-D (in, out)")
        if flatten_shape is not None and kernel.shape[0] == int(np.prod(flatten_shape)):
            kernel = _rows_to_channels_first(kernel, flatten_shape)  # a size mismatch is reported below
        tensors["weight"] = kernel.T
    if "bias" in layer.arrays:
        tensors["bias"] = layer.take("bias")
    elif target.bias is not None:
        raise UserError(f"Keras layer '{layer.name}' has no bias but the architecture's layer has one")
    return tensors


def _rows_to_channels_first(kernel: np.ndarray, chw: tuple[int, int, int]) -> np.ndarray:
    """Reorder dense rows from Keras' (h, w, c) flatten order to PyTorch's (c, h, w)."""
    channels, height, width = chw
    units = kernel.shape[1]
    return kernel.reshape(height, width, channels, units).transpose(2, 0, 1, 3).reshape(-1, units)


def _keras_key(target: nn.Module, attribute: str) -> str:
    """The Keras name of a PyTorch weight attribute, for messages."""
    if isinstance(target, nn.BatchNorm2d):
        return {"weight": "gamma", "bias": "beta", "running_mean": "moving_mean", "running_var": "moving_variance"}[attribute]
    return {"weight": "kernel"}.get(attribute, attribute)


def _keras_shape(target: nn.Module, attribute: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A PyTorch weight shape written the Keras way, so both shapes in a message read alike."""
    if attribute != "weight":
        return tuple(shape)
    if isinstance(target, nn.Conv2d):
        out_c, in_c, height, width = shape
        return (height, width, in_c, out_c)
    if isinstance(target, nn.Linear):
        return (shape[1], shape[0])
    return tuple(shape)


def _fitting_hint(layers: list[KerasLayer]) -> str:
    """'this file fits architecture X' or 'no known architecture fits this file', by weight shapes."""
    fitting = [arch for arch in zoo.ARCHITECTURES if _shapes_fit(arch, layers)]
    if fitting:
        return f"this file fits architecture {' or '.join(repr(a) for a in fitting)}"
    return f"no known architecture fits this file (known: {', '.join(zoo.ARCHITECTURES)})"


def _shapes_fit(arch: str, layers: list[KerasLayer]) -> bool:
    targets = weighted_modules(zoo.build(arch))
    if len(targets) != len(layers):
        return False
    for layer, (_, target) in zip(layers, targets):
        if layer.kind != _KIND_OF_MODULE[type(target)]:
            return False
        for attribute, keras_key in (("weight", "kernel"), ("weight", "gamma"), ("bias", "bias")):
            value = layer.arrays.get(keras_key)
            current = getattr(target, attribute, None)
            if value is not None and current is not None:
                if _keras_shape(target, attribute, tuple(current.shape)) != value.shape:
                    return False
    return True
