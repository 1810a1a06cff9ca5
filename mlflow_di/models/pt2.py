"""White-box PyTorch models from MLflow's default pt2 format (``torch.export``), with the original layer names.

``mlflow.pytorch.log_model`` saves a model with ``torch.export`` unless told otherwise. The
exported program is read weights-only (:func:`load_pt2`: no code from the file runs), but it is one flat graph of ATen operators:
no modules to hook, so no layer activations and no LRP. It still records, for every operator, the
module that called it (``nn_module_stack``: qualified name and type). :func:`rebuild` turns it back
into an ``nn.Module`` tree with the names ``named_modules()`` gave before export:

1. ``torch.export.unflatten`` restores the module tree (one sub-module per original module whose
   graph calls its children);
2. every leaf whose type is a ``torch.nn`` layer listed in :data:`_LEAVES` (convolutions,
   linear, batch norm, activations, pools, dropout, flatten, softmax) becomes that layer again,
   holding the exported weights, so LRP's rules and canonizers find the types they match on;
3. every other module becomes a :class:`RebuiltModule` (a ``torch.fx.GraphModule``) running its
   own graph: containers (``Sequential``, a ResNet block: their residual additions are ATen
   operators in that graph, which :mod:`mlflow_di.coverage.canonizers` rewrites for LRP) and
   leaves of types not listed, which keep their operators and say what they were
   (:attr:`RebuiltModule.original_type`);
4. in those graphs, in-place operators become out-of-place ones (an in-place add would overwrite
   a recorded layer output) and a shape that repeats the exported batch size takes the batch size
   of its input instead, so a model exported with one example image runs on batches of any size;
5. the result is checked against the exported program itself on a probe input (same outputs),
   unless the program was exported in training mode (batch statistics, live dropout): then the
   rebuilt model is the same model in eval mode, which is what analysis and inference mean.

Parameters and buffers are the exported tensors; nothing is re-initialised.
"""
from __future__ import annotations

import contextlib
import math
import operator
import pathlib

import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.input_files import amount, check_allocation, check_memory

__all__ = ["RebuiltModule", "holding", "load_pt2", "pool_layer", "rebuild"]

aten = torch.ops.aten


class RebuiltModule(torch.fx.GraphModule):
    """A module of an exported model that is not one of the known ``torch.nn`` layers: it runs its
    exported graph, calling its children by their original names. ``original_type`` is the
    qualified type name the module had before export (``torchvision.models.resnet.BasicBlock``)."""

    original_type: str = ""

    def __repr__(self) -> str:
        children = ", ".join(name for name, _ in self.named_children())
        return f"RebuiltModule({self.original_type or 'module'}: {children})"


def load_pt2(path, name: str = "model", code_may_run: bool = False, trust_hint: str = "") -> nn.Module:
    """Read a pt2 file (``torch.export.save``) and :func:`rebuild` its module tree.

    The archive is read weights-only (:mod:`mlflow_di.models.weights_only`): a member that would run
    code when unpickled is refused with a one-line :class:`UserError` ending in ``trust_hint``, unless
    ``code_may_run`` (its model is trusted like a pickled one): then it is read as torch reads it.
    """
    from mlflow_di.models.weights_only import CodeInArchive, weights_only_loading

    _check_unpacked_size(path, name)
    try:
        with _quiet_torch_loader(), weights_only_loading():
            program = torch.export.load(str(pathlib.Path(path)))
    except CodeInArchive as refused:
        if not code_may_run:
            raise UserError(f"'{name}' is a pt2 archive that holds more than weights ({refused}); loading it would run "
                            f"code from the file, so mlflow-di refuses it{trust_hint}") from None
        program = _read_pt2(path, name)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged archive
        raise UserError(f"cannot read the pt2 (torch.export) model '{name}': {_first_line(exc)}") from None
    try:
        return rebuild(program, name)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - an exported graph torch itself cannot unflatten or run
        raise UserError(f"cannot rebuild the layers of the pt2 (torch.export) model '{name}': {_first_line(exc)}; "
                        "export it again with torch.export (or log it as ONNX: mlflow.onnx.log_model)") from None


def _check_unpacked_size(path, name: str) -> None:
    """Refuse, before torch reads it, an archive whose members unpack to more than memory can hold (a pt2 is
    a zip: a deflated member of zeros declares gigabytes in a few kilobytes)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return  # not a zip torch can read either: torch's own error says so below
    largest = max(members, key=lambda member: member.file_size, default=None)
    if largest is not None:
        check_memory(f"the pt2 (torch.export) model '{name}' (its largest member '{largest.filename}' unpacks to "
                     f"{amount(largest.file_size)})", sum(member.file_size for member in members),
                     "check that this is the model you meant; a pt2 holds the weights and the graph, no more")


def _read_pt2(path, name: str):
    """The archive read as torch reads it (its pickled members unrestricted): for trusted models only."""
    try:
        with _quiet_torch_loader():
            return torch.export.load(str(pathlib.Path(path)))
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged archive
        raise UserError(f"cannot read the pt2 (torch.export) model '{name}': {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "check the warnings above" in line:  # torch's own warnings were kept quiet: say what they would have said
        line = (f"{line.split(' Please check')[0]} (a damaged archive, or one written by another torch version than "
                f"{torch.__version__.split('+')[0]})")
    return line


@contextlib.contextmanager
def _quiet_torch_loader():
    """torch logs a damaged or refused member with its traceback; the command's one line says it instead."""
    import logging
    import warnings

    loggers = [logging.getLogger(name) for name in ("torch._export.serde.serialize", "torch.export.pt2_archive._package",
                                                    "torch._export", "torch.export")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def rebuild(program, name: str = "model") -> nn.Module:
    """The module tree of ``program`` (a ``torch.export.ExportedProgram``), white-box, in eval mode."""
    import warnings

    types = module_types(program)
    example = _probe_input(program, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation notes while unflattening
        tree = torch.export.unflatten(program)
    batch = example.shape[0] if example is not None else None
    root = _rebuilt(tree, "", types, batch)
    _return_one_tensor(root, name)
    root.eval()
    if example is not None and not _trains(program):
        _check_same(program, root, example, name)
    return root


def module_types(program) -> dict[str, str]:
    """Qualified module name -> qualified type name, for every module that called an operator."""
    types: dict[str, str] = {}
    for node in program.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            types.setdefault(path, kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}")
    return types


def _rebuilt(module: nn.Module, path: str, types: dict[str, str], batch: int | None) -> nn.Module:
    for child_name, child in list(module.named_children()):
        child_path = f"{path}.{child_name}" if path else child_name
        setattr(module, child_name, _rebuilt(child, child_path, types, batch))
    kind = types.get(path, "")
    if path and not any(True for _ in module.children()):
        layer = _leaf_layer(module, kind)
        if layer is not None:
            return layer
    graph = getattr(module, "graph", None)
    if graph is None:  # a module that holds called modules but was not called itself (nothing to run)
        return module
    _out_of_place(graph)
    if batch is not None:
        _batch_free_shapes(graph, batch)
    short = kind.rsplit(".", 1)[-1] or "Module"
    if kind in _LEAVES:  # a torch.nn layer whose graph is not its one operator (e.g. padding_mode='reflect')
        short = f"{short} (as exported)"
    rebuilt = RebuiltModule(module, graph, class_name=short)
    rebuilt.original_type = kind
    return rebuilt


# ---------------------------------------------------------------------------------------------- leaves
def _principal_call(module: nn.Module):
    """The one operator a leaf layer's graph calls (with its arguments normalised to keywords), or None.

    ``getitem`` (tuple outputs) and the batch-norm counter a training-mode export updates are not counted.
    """
    from torch.fx.operator_schemas import normalize_function

    calls = [node for node in module.graph.nodes if node.op == "call_function" and node.target is not operator.getitem
             and not _counts_batches(node)]
    if len(calls) != 1 or not isinstance(calls[0].target, torch._ops.OpOverload):
        return None
    call = calls[0]
    normalised = normalize_function(call.target, call.args, call.kwargs, normalize_to_only_use_kwargs=True)
    if normalised is None:
        return None
    values = {key: _value(module, value) for key, value in normalised.kwargs.items()}
    return call.target, values


def _counts_batches(node) -> bool:
    return node.target in (aten.add_.Tensor, aten.add.Tensor) and any(
        getattr(arg, "op", None) == "get_attr" and str(arg.target).endswith("num_batches_tracked") for arg in node.args)


def _value(module: nn.Module, value):
    """A graph argument as a value: a get_attr node becomes its tensor; other nodes stay nodes."""
    if isinstance(value, torch.fx.Node) and value.op == "get_attr":
        return operator.attrgetter(value.target)(module)
    return value


def holding(layer: nn.Module, weight, bias=None) -> nn.Module:
    """``layer`` with copies of ``weight`` (and ``bias``, when given) as its float32 parameters."""
    layer.weight = nn.Parameter(weight.detach().clone().float())
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone().float())
    return layer


def _conv(cls):
    def build(op, a):
        weight, bias = a["weight"], a.get("bias")
        return holding(cls(weight.shape[1] * a.get("groups", 1), weight.shape[0], tuple(weight.shape[2:]),
                           stride=a.get("stride", 1), padding=a.get("padding", 0), dilation=a.get("dilation", 1),
                           groups=a.get("groups", 1), bias=bias is not None), weight, bias)
    return build


def _linear(op, a):
    weight, bias = a["weight"], a.get("bias")
    return holding(nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None), weight, bias)


def _batch_norm(cls):
    def build(op, a):
        mean, var, weight = a.get("running_mean"), a.get("running_var"), a.get("weight")
        if mean is None or var is None:
            return None  # no running statistics: the layer only works in training mode
        layer = cls(mean.shape[0], eps=a.get("eps", 1e-5), momentum=a.get("momentum", 0.1), affine=weight is not None)
        if weight is not None:
            holding(layer, weight, a.get("bias"))
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(var)
        return layer
    return build


_POOL_OPTIONS = ("stride", "padding", "dilation", "ceil_mode", "count_include_pad", "divisor_override")


def pool_layer(cls, arguments: dict) -> nn.Module:
    """The pooling module ``cls`` from an ATen pool call's keyword arguments (its first one, the kernel
    or output size, positional; aten's empty stride is the kernel size, the module's default)."""
    first = "output_size" if "output_size" in arguments else "kernel_size"
    options = {key: arguments[key] for key in _POOL_OPTIONS if key in arguments}
    if not options.get("stride", True):
        options.pop("stride")
    return cls(arguments[first], **options)


def _pool(cls):
    return lambda op, a: pool_layer(cls, a)


def _activation(cls, **fields):
    def build(op, a):
        values = {field: a[key] for field, key in fields.items() if key in a}
        if "inplace" in cls.__init__.__code__.co_varnames:
            values["inplace"] = op._overloadpacket.__name__.endswith("_")
        return cls(**values)
    return build


def _padding(cls, a):
    if a.get("mode", "constant") != "constant":
        return None
    value = a.get("value") or 0.0
    if cls in (nn.ZeroPad1d, nn.ZeroPad2d):
        return cls(tuple(a["pad"])) if value == 0 else None
    return cls(tuple(a["pad"]), value)


_BATCH_NORM_OPS = ("batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional")
_PAD_OPS = ("constant_pad_nd", "pad")

#: Qualified torch.nn type -> (builder(op, keyword arguments) of the same layer holding the exported
#: tensors, the operators it is rebuilt from: a leaf whose one operator is another keeps its graph).
_LEAVES = {
    "torch.nn.modules.conv.Conv1d": (_conv(nn.Conv1d), ("conv1d",)),
    "torch.nn.modules.conv.Conv2d": (_conv(nn.Conv2d), ("conv2d",)),
    "torch.nn.modules.conv.Conv3d": (_conv(nn.Conv3d), ("conv3d",)),
    "torch.nn.modules.linear.Linear": (_linear, ("linear",)),
    "torch.nn.modules.batchnorm.BatchNorm1d": (_batch_norm(nn.BatchNorm1d), _BATCH_NORM_OPS),
    "torch.nn.modules.batchnorm.BatchNorm2d": (_batch_norm(nn.BatchNorm2d), _BATCH_NORM_OPS),
    "torch.nn.modules.batchnorm.BatchNorm3d": (_batch_norm(nn.BatchNorm3d), _BATCH_NORM_OPS),
    "torch.nn.modules.activation.ReLU": (_activation(nn.ReLU), ("relu", "relu_")),
    "torch.nn.modules.activation.ReLU6": (_activation(nn.ReLU6), ("hardtanh", "hardtanh_")),
    "torch.nn.modules.activation.LeakyReLU": (_activation(nn.LeakyReLU, negative_slope="negative_slope"),
                                              ("leaky_relu", "leaky_relu_")),
    "torch.nn.modules.activation.ELU": (_activation(nn.ELU, alpha="alpha"), ("elu", "elu_")),
    "torch.nn.modules.activation.SiLU": (_activation(nn.SiLU), ("silu", "silu_")),
    "torch.nn.modules.activation.GELU": (_activation(nn.GELU, approximate="approximate"), ("gelu",)),
    "torch.nn.modules.activation.Sigmoid": (_activation(nn.Sigmoid), ("sigmoid",)),
    "torch.nn.modules.activation.Tanh": (_activation(nn.Tanh), ("tanh",)),
    "torch.nn.modules.activation.Hardswish": (_activation(nn.Hardswish), ("hardswish", "hardswish_")),
    "torch.nn.modules.activation.Hardsigmoid": (_activation(nn.Hardsigmoid), ("hardsigmoid", "hardsigmoid_")),
    "torch.nn.modules.activation.Softmax": (_activation(nn.Softmax, dim="dim"), ("softmax", "_softmax")),
    "torch.nn.modules.activation.LogSoftmax": (_activation(nn.LogSoftmax, dim="dim"), ("log_softmax", "_log_softmax")),
    "torch.nn.modules.pooling.MaxPool1d": (_pool(nn.MaxPool1d), ("max_pool1d",)),
    "torch.nn.modules.pooling.MaxPool2d": (_pool(nn.MaxPool2d), ("max_pool2d", "max_pool2d_with_indices")),
    "torch.nn.modules.pooling.AvgPool1d": (_pool(nn.AvgPool1d), ("avg_pool1d",)),
    "torch.nn.modules.pooling.AvgPool2d": (_pool(nn.AvgPool2d), ("avg_pool2d",)),
    "torch.nn.modules.pooling.AdaptiveAvgPool1d": (_pool(nn.AdaptiveAvgPool1d), ("adaptive_avg_pool1d",)),
    "torch.nn.modules.pooling.AdaptiveAvgPool2d": (_pool(nn.AdaptiveAvgPool2d),
                                                   ("adaptive_avg_pool2d", "_adaptive_avg_pool2d")),
    "torch.nn.modules.pooling.AdaptiveMaxPool2d": (_pool(nn.AdaptiveMaxPool2d), ("adaptive_max_pool2d",)),
    "torch.nn.modules.dropout.Dropout": (_activation(nn.Dropout, p="p"), ("dropout", "dropout_", "native_dropout")),
    "torch.nn.modules.dropout.Dropout2d": (_activation(nn.Dropout2d, p="p"),
                                           ("feature_dropout", "feature_dropout_", "dropout")),
    # a view/reshape's target shape is not a Flatten's arguments: only aten.flatten rebuilds one
    "torch.nn.modules.flatten.Flatten": (lambda op, a: nn.Flatten(a.get("start_dim", 1), a.get("end_dim", -1)),
                                         ("flatten",)),
    "torch.nn.modules.padding.ZeroPad1d": (lambda op, a: _padding(nn.ZeroPad1d, a), _PAD_OPS),
    "torch.nn.modules.padding.ZeroPad2d": (lambda op, a: _padding(nn.ZeroPad2d, a), _PAD_OPS),
    "torch.nn.modules.padding.ConstantPad1d": (lambda op, a: _padding(nn.ConstantPad1d, a), _PAD_OPS),
    "torch.nn.modules.padding.ConstantPad2d": (lambda op, a: _padding(nn.ConstantPad2d, a), _PAD_OPS),
}


def _leaf_layer(module: nn.Module, kind: str) -> nn.Module | None:
    """The torch.nn layer ``kind`` rebuilt from the leaf's one operator, or None to keep the leaf's graph."""
    builder, ops = _LEAVES.get(kind, (None, ()))
    found = _principal_call(module) if builder is not None else None
    if found is None or found[0]._overloadpacket.__name__ not in ops:
        return None
    layer = builder(*found)
    if layer is not None:
        layer.eval()
    return layer


# ---------------------------------------------------------------------------------------------- graphs
def _out_of_place(graph) -> None:
    """Replace in-place ATen operators (``add_``, ``relu_``) by their out-of-place forms."""
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        packet = node.target._overloadpacket.__name__
        if packet.endswith("_") and not packet.startswith("_") and hasattr(aten, packet[:-1]):
            functional = getattr(aten, packet[:-1])
            overload = node.target._overloadname
            if overload in functional.overloads():
                node.target = getattr(functional, overload)
    graph.lint()


def _batch_free_shapes(graph, batch: int) -> None:
    """A view/reshape whose target shape starts with the exported batch size, on an input whose
    first axis had that size, takes the input's own first axis instead (exports with a static
    batch of one wrote that 1 into every flatten ``x.view(x.size(0), -1)``)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target._overloadpacket.__name__ not in ("view", "reshape", "_unsafe_view"):
            continue
        source, shape = node.args[0], node.args[1] if len(node.args) > 1 else None
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(shape, (list, tuple)) or not shape or shape[0] != batch or value is None:
            continue
        if not value.shape or value.shape[0] != batch or not isinstance(shape[0], int):
            continue
        with graph.inserting_before(node):
            size = graph.call_function(aten.sym_size.int, (source, 0))
        node.args = (source, [size, *shape[1:]], *node.args[2:])
    graph.lint()


def _return_one_tensor(root: torch.fx.GraphModule, name: str) -> None:
    """An exported program returns a tuple of its outputs; a classifier returns one tensor."""
    output = next(node for node in root.graph.nodes if node.op == "output")
    returned = output.args[0]
    if isinstance(returned, (tuple, list)):
        if len(returned) != 1:
            raise UserError(f"'{name}' returns {len(returned)} outputs; mlflow-di analyses classifiers that return "
                            "one tensor of logits or probabilities")
        output.args = (returned[0],)
    root.recompile()


# ---------------------------------------------------------------------------------------------- checks
def _probe_input(program, name: str) -> torch.Tensor | None:
    """A random float input of the exported shape (the batch at least 2 when the batch axis is dynamic)."""
    specs = [spec for spec in program.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
    if len(specs) != 1:
        return None
    placeholder = next(node for node in program.graph.nodes
                       if node.op == "placeholder" and node.name == specs[0].arg.name)
    value = placeholder.meta.get("val")
    if value is None or not value.dtype.is_floating_point:
        return None
    shape = [dim if isinstance(dim, int) else max(2, int(getattr(dim.node, "hint", None) or 2)) for dim in value.shape]
    check_allocation(f"the exported input of {name} {tuple(shape)} ({value.dtype})",
                     math.prod(shape) * value.dtype.itemsize, "export the model at the input size it classifies, "
                     "with a small or dynamic batch")
    return torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=value.dtype)


def _trains(program) -> bool:
    """Whether the program was exported in training mode (batch statistics or live dropout)."""
    for node in program.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        packet = node.target._overloadpacket.__name__
        if packet == "_native_batch_norm_legit_functional" or (packet == "batch_norm" and len(node.args) > 5
                                                               and node.args[5]):
            return True
        if packet in ("dropout", "feature_dropout") and node.args[2]:
            return True
    return False


def _check_same(program, root: nn.Module, example: torch.Tensor, name: str) -> None:
    with torch.no_grad():
        expected = program.module()(example)
        got = root(example)
    expected = expected[0] if isinstance(expected, (tuple, list)) else expected
    if expected.shape != got.shape or not torch.allclose(expected, got, rtol=1e-4, atol=1e-5):
        difference = (expected - got).abs().max().item() if expected.shape == got.shape else "shape"
        raise UserError(f"'{name}': the module tree rebuilt from its pt2 graph computes other outputs than the "
                        f"graph itself (max difference {difference}); please report this model's architecture. "
                        "Until then, log it with serialization_format='pickle' or as ONNX")
