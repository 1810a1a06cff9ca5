"""Neuron activations of named layers of a PyTorch module, and which layers count as "hidden".

A *layer* is a module named as in ``module.named_modules()`` (e.g. ``fc2`` or ``conv1``); its
*neurons* are the features of its output: the units of a 2-D output (N, units), the channels of a
conv output (N, C, H, W). A conv channel's activation for one input is the spatial mean of its
feature map, as in the IDC paper's reference code.

A layer's output is taken *after the elementwise steps that follow it* (batch norm, ReLU and the
other activations, eval-mode dropout), whatever form those steps take: an ``nn.ReLU`` module, a
``torch.relu`` call in ``forward``, an ATen operator in a rebuilt pt2 graph, a Relu node of an ONNX
graph, or a batch norm an ONNX exporter folded into the convolution. :class:`LayerRecorder` follows
the layer's output through them while the model runs (a ``TorchFunctionMode``), so ``conv1`` means
the same values for one network logged as pickle, pt2 or ONNX, written with ``nn.ReLU`` modules or
with ``torch.relu`` (before, a functional ReLU was left out while a module one was not, and one
network gave NC 0.30 as pt2 and 0.16 as ONNX).

The coverage criteria all need the same thing: one forward pass over many inputs, recording a few
layers' outputs, reduced per batch so that memory stays at (N, neurons). The per-batch values go
straight into arrays allocated once for all N inputs (:class:`RowBuffer`), never into a list of
per-batch arrays: see :class:`RowBuffer` for why that matters beyond the copy.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mlflow_di.progress import progress_bar as tqdm

from mlflow_di.errors import UserError
from mlflow_di.models.device import module_device
from mlflow_di.models.preprocessing import Preprocessing

#: Leaf module types that only transform a layer's values elementwise (or normalise them): the
#: output a user means by "layer conv1" is the one after them, not before.
_FOLLOWERS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Sigmoid,
    nn.Tanh, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Mish, nn.PReLU,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
)


#: The functions (by name, whether ``torch.*``, ``Tensor.*``, ``torch.nn.functional.*`` or an ATen
#: operator; in-place forms included) whose result stands for the layer they are applied to:
#: elementwise activations, normalisation, and dropout (the identity in eval mode).
_FOLLOWER_FUNCTIONS = frozenset({
    "relu", "relu6", "hardtanh", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "sigmoid", "tanh",
    "softplus", "hardswish", "hardsigmoid", "mish", "prelu", "_prelu_kernel", "rrelu",
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "cudnn_batch_norm", "miopen_batch_norm",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
})


def _function_name(func) -> str:
    """``aten.relu_.default`` -> ``relu``; ``torch.nn.functional.relu`` -> ``relu``; ``Tensor.relu_`` -> ``relu``."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet if packet is not None else func, "__name__", "") or ""
    name = name.split(".")[0]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


class _FollowerTracker(TorchFunctionMode):
    """While a :class:`LayerRecorder` is open: each follower function applied to a recorded output
    moves the recording to its result (see the module docstring)."""

    def __init__(self, recorder: "LayerRecorder"):
        super().__init__()
        self._recorder = weakref.proxy(recorder)
        self._follows: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        try:
            follows = self._follows[func]
        except KeyError:
            follows = self._follows[func] = _function_name(func) in _FOLLOWER_FUNCTIONS
        except TypeError:  # an unhashable callable: not one of ours
            follows = False
        if follows and args and isinstance(args[0], torch.Tensor):
            self._recorder._followed(args[0], result[0] if isinstance(result, (tuple, list)) else result)
        return result


def _tensor_key(tensor: torch.Tensor) -> tuple:
    """What identifies a tensor's values through in-place steps and views of the same memory (a
    hook's wrapper, e.g. zennit's identity on a module's input, is a new object on the same memory)."""
    try:
        return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device
    except RuntimeError:  # a tensor without storage (functorch wrappers)
        return id(tensor), tuple(tensor.shape)


class PreprocessedImages:
    """Raw uint8 images that become float model input one slice at a time (so big sets stay uint8 in memory).

    ``device``: where a slice is preprocessed (:meth:`Preprocessing.tensor_on`). On a GPU the uint8
    slice travels and torch does the arithmetic there: on a GPU host NumPy's arithmetic cost more than
    the relevance pass itself (benchmarks/RESULTS.md, "Realistic size on cuda:0"). On the CPU (None or
    ``cpu``) the table lookup does it, cheaper there than torch's arithmetic (benchmarks/RESULTS.md,
    "Preprocessing"). :func:`iter_batches` moves the preprocessing to the device its batches go to.
    """

    def __init__(self, images: np.ndarray, preprocessing: Preprocessing, device=None):
        preprocessing.check_images(images)
        self.images = images
        self.preprocessing = preprocessing
        self.device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index) -> torch.Tensor:
        return self.preprocessing.tensor_on(self.images[index], self.device)

    def on(self, device) -> "PreprocessedImages":
        """The same images, preprocessed on ``device``."""
        return PreprocessedImages(self.images, self.preprocessing, device)


class RowBuffer:
    """Per-batch (b, ...) arrays written, in input order, into (N, ...) arrays allocated once per key.

    The alternative, a list of per-batch arrays concatenated at the end, holds every value twice
    at the end and, worse, makes resident memory grow with N far beyond the values kept: each
    batch's small kept arrays land in the holes that the batch's large temporaries (images,
    feature maps, LRP buffers) leave in glibc's heap, so the next batch's temporaries no longer
    fit there and the heap grows by about one batch of temporaries per batch. Measured on a small
    CNN at 224x224, ~27 KB of peak resident memory per input for ~0.5 KB of kept values; with
    this buffer, peak memory no longer depends on N.

    A tensor on an accelerator (a GPU) is not copied batch by batch: each copy to the host waits
    for the device to finish the batch, so the host could not queue the next one. Such values are
    staged on the device and copied in one transfer per key when :attr:`arrays` is read, or
    earlier when the staged values reach :data:`STAGE_BYTES`. The arrays hold the same values.
    """

    #: device bytes staged before they are copied to the host (bounds the device memory they take)
    STAGE_BYTES = 2**28

    def __init__(self, total: int):
        self.total = total
        self._arrays: dict[str, np.ndarray] = {}
        self._staged: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._staged_bytes = 0

    @property
    def arrays(self) -> dict[str, np.ndarray]:
        """{key: (N, ...) array}, every staged value included."""
        self._flush()
        return self._arrays

    def write(self, start: int, values: Mapping[str, object]) -> None:
        """Rows ``start:start + b`` of each key (the array is created on the key's first batch)."""
        on_host = {}
        for key, value in values.items():
            if self._stays(value):
                self._stage(start, key, value)
            else:
                on_host[key] = value
        self._write_host(start, on_host)

    @staticmethod
    def _stays(value) -> bool:
        """Whether ``value`` waits on its device (a tensor on an accelerator) instead of being copied now."""
        return isinstance(value, torch.Tensor) and value.device.type != "cpu"

    def _stage(self, start: int, key: str, value: torch.Tensor) -> None:
        self._staged.setdefault(key, []).append((start, value.detach().clone()))  # a model may reuse its memory
        self._staged_bytes += value.numel() * value.element_size()
        if self._staged_bytes >= self.STAGE_BYTES:
            self._flush()

    def _flush(self) -> None:
        """The staged device values copied to the host: one transfer per key for consecutive batches."""
        staged, self._staged, self._staged_bytes = self._staged, {}, 0
        for key, parts in staged.items():
            starts = [start for start, _ in parts]
            ends = [start + len(value) for start, value in parts]
            if starts[1:] == ends[:-1]:  # consecutive rows: one copy
                self._write_host(starts[0], {key: torch.cat([value for _, value in parts]).cpu()})
            else:
                for start, value in parts:
                    self._write_host(start, {key: value.cpu()})

    def _write_host(self, start: int, values: Mapping[str, object]) -> None:
        for key, value in values.items():
            value = np.asarray(value)
            out = self._arrays.get(key)
            if out is None:
                out = self._arrays[key] = np.empty((self.total, *value.shape[1:]), dtype=value.dtype)
            out[start:start + len(value)] = value


def neuron_values(output: torch.Tensor) -> torch.Tensor:
    """A layer output -> one value per neuron and input: (N, C, ...) spatial mean -> (N, C); (N, C) unchanged."""
    if output.ndim <= 2:
        return output.reshape(output.shape[0], -1) if output.ndim == 1 else output
    return output.flatten(2).mean(dim=2)


def layer_names(module: nn.Module) -> list[str]:
    """Every named sub-module (the names :func:`collect_activations` accepts), in registration order."""
    return [name for name, _ in module.named_modules() if name]


def check_layers(module: nn.Module, layers: Sequence[str]) -> dict[str, nn.Module]:
    """Map each layer name to its module; an unknown name raises a :class:`UserError` listing the known ones."""
    if isinstance(layers, str):
        layers = [layers]
    modules = dict(module.named_modules())
    unknown = [name for name in layers if not name or name not in modules]
    if unknown:
        raise UserError(
            f"unknown layer {', '.join(repr(n) for n in unknown)}; available layers: {', '.join(layer_names(module))}"
        )
    return {name: modules[name] for name in layers}


def _has_parameters(module: nn.Module) -> bool:
    # Any parameters, trainable or not: a model loaded for inference may have requires_grad off.
    return any(True for _ in module.parameters())


def _parameter_children(module: nn.Module) -> list[tuple[str, str]]:
    """Top-level children with trainable parameters, each as (its own name, name of the output that represents it).

    The representing output is the child itself, or the last of the activation/batch-norm siblings
    that directly follow it (so in a flat ``nn.Sequential(Linear, ReLU, ...)`` the neuron values are
    post-activation, as they are for the zoo's ``Sequential(layer, ReLU)`` blocks).
    """
    children = list(module.named_children())
    found = []
    index = 0
    while index < len(children):
        name, child = children[index]
        index += 1
        if not _has_parameters(child) or isinstance(child, _FOLLOWERS):
            continue
        output_name = name
        while index < len(children) and isinstance(children[index][1], _FOLLOWERS):
            output_name = children[index][0]
            index += 1
        found.append((name, output_name))
    return found


def hidden_layers(module: nn.Module) -> list[str]:
    """The top-level layers with trainable parameters except the last (logit) one, in forward order.

    This is the criteria's default "all hidden layers", e.g. LeNet-5 -> conv1, conv2, fc1, fc2;
    torchvision's resnet18 -> conv1, layer1 ... layer4. A layer is named by its weighted module,
    not by the activation module after it (which a functional ``torch.relu`` or an exporter's
    folding may not have): its values are still taken after the activation (:class:`LayerRecorder`).
    """
    children = _parameter_children(module)
    if len(children) < 2:
        raise UserError(
            f"model {type(module).__name__} has no hidden layer with parameters among its top-level children "
            f"({', '.join(n for n, _ in module.named_children()) or 'none'}); name a layer explicitly"
        )
    return [name for name, _ in children[:-1]]


def default_layer(module: nn.Module) -> str:
    """The last hidden layer with trainable parameters before the logit layer (the IDC paper's default).

    LeNet-5 -> ``fc2``, LeNet-1 -> ``conv2``.
    """
    return hidden_layers(module)[-1]


def iter_batches(inputs, batch_size: int, device=None) -> Iterator[torch.Tensor]:
    """Float32 batches of ``inputs`` on ``device`` (default: where they are): a tensor, an array, or
    any sliceable with ``len`` that yields tensors.

    A sliceable lets callers convert raw images batch by batch instead of holding the whole
    preprocessed set in memory (or on the GPU); :class:`PreprocessedImages` are preprocessed on ``device``.
    """
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    if isinstance(inputs, PreprocessedImages) and device is not None:
        inputs = inputs.on(device)
    for start in range(0, len(inputs), batch_size):
        batch = inputs[start:start + batch_size]
        if not isinstance(batch, torch.Tensor):
            batch = torch.as_tensor(np.asarray(batch))
        yield batch.float() if device is None else batch.to(device).float()


class LayerRecorder(contextlib.AbstractContextManager):
    """Forward hooks that keep the latest output of each named layer (``recorder.outputs[name]``),
    taken after the elementwise steps that follow the layer (the module docstring says which and why).

    The tensors are kept as they are (not detached), so a caller may also differentiate with
    respect to them: they are the model's own tensors, on its autograd graph. The hooks (and the
    tracking of followers) stop on exit.
    """

    def __init__(self, module: nn.Module, layers: Sequence[str]):
        self.root = module
        self.modules = check_layers(module, layers)
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles = []
        self._marks: dict[tuple, set[str]] = {}
        self._alive: list[torch.Tensor] = []  # every tensor marked this forward pass, so no other takes its memory
        self._tracker = _FollowerTracker(self)

    def __enter__(self) -> "LayerRecorder":
        self._handles.append(self.root.register_forward_pre_hook(self._new_pass))
        for name, layer in self.modules.items():
            self._handles.append(layer.register_forward_hook(self._hook(name)))
        self._tracker.__enter__()
        return self

    def _new_pass(self, _module, _inputs):
        self._marks.clear()
        self._alive.clear()

    def _hook(self, name: str) -> Callable:
        def record(_module, _inputs, output):
            if isinstance(output, (tuple, list)):
                output = output[0]
            if not isinstance(output, torch.Tensor):
                raise UserError(f"layer '{name}' does not output a tensor (got {type(output).__name__})")
            self._mark(output, {name})

        return record

    def _mark(self, tensor: torch.Tensor, names: set[str]) -> None:
        for name in names:
            self.outputs[name] = tensor
        self._marks.setdefault(_tensor_key(tensor), set()).update(names)
        self._alive.append(tensor)

    def _followed(self, argument: torch.Tensor, result) -> None:
        """A follower function ran on ``argument``: the layers recorded there now stand at ``result``."""
        names = self._marks.get(_tensor_key(argument))
        if not names or not isinstance(result, torch.Tensor) or result.shape != argument.shape:
            return
        # not onto a result cut from the autograd graph: ``sigmoid`` of a ``detach``ed output shares its memory (so its
        # key) but no relevance flows back through it
        names = {name for name in names if result.requires_grad or not self.outputs[name].requires_grad}
        if names:
            self._mark(result, names)

    def __exit__(self, *exc_info):
        self._tracker.__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._marks.clear()
        self._alive.clear()
        return False


@contextlib.contextmanager
def eval_mode(module: nn.Module):
    """Run ``module`` in eval mode (dropout off, batch-norm running stats) and restore its mode afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def collect_activations(
    module: nn.Module,
    inputs,
    layers: Sequence[str],
    batch_size: int = 256,
    reductions: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    progress: bool = False,
    on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None,
    keep: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """One batched forward pass recording the neuron values of ``layers``: {layer: float32 (N, neurons)}.

    ``inputs`` is the float model input (tensor, array, or sliceable of tensors; already
    preprocessed). The default reduction is :func:`neuron_values` (spatial mean of conv maps).
    ``reductions`` maps a name to a function applied per batch to every layer's raw output tensor;
    its results are returned as well, keyed ``f"{layer}:{name}"``.

    ``on_batch`` is given each batch's values, every key, as tensors on the module's device (e.g. to
    score criteria there, :class:`~mlflow_di.coverage.criteria.DeviceCells`); ``keep`` names the layers
    whose values (reductions included) are returned (default: all), so that the others never leave
    the device. Values on a GPU come to the host in one copy at the end (:class:`RowBuffer`).
    """
    if isinstance(layers, str):
        layers = [layers]
    if len(inputs) == 0:
        raise UserError("no inputs to compute activations for (empty data)")
    reductions = dict(reductions or {})
    kept = set(layers if keep is None else keep)
    rows, start = RowBuffer(len(inputs)), 0
    with eval_mode(module), torch.no_grad(), LayerRecorder(module, layers) as recorder:
        batches = iter_batches(inputs, batch_size, module_device(module))
        for batch in tqdm(batches, total=-(-len(inputs) // batch_size), desc="activations",
                          disable=not progress, leave=False):
            module(batch)
            values, returned = {}, {}
            for layer in layers:
                if layer not in recorder.outputs:
                    raise UserError(f"layer '{layer}' was not run by the model's forward pass; choose another layer")
                output = recorder.outputs[layer]
                of_layer = {layer: neuron_values(output).float(),
                            **{f"{layer}:{name}": reduce(output).float() for name, reduce in reductions.items()}}
                values.update(of_layer)
                if layer in kept:
                    returned.update(of_layer)
            recorder.outputs.clear()
            if on_batch is not None:
                on_batch(values)
            rows.write(start, returned)
            start += len(batch)
    return rows.arrays
