"""A white-box PyTorch view of an ONNX classifier: its graph as ``torch.nn`` layers in nested modules.

Coverage and LRP need named layers to hook and a backward pass; an ONNX graph (``mlflow.onnx.log_model``
or a ``.onnx`` file) has neither. :func:`onnx_to_torch` converts the common CNN operators:

* layers become the ``torch.nn`` layer they came from, holding the graph's initializers: Conv
  (1-3 d), Gemm and MatMul(+Add) with constant weights -> Linear, BatchNormalization, Relu,
  LeakyRelu, Clip(0, 6) -> ReLU6, Sigmoid, HardSigmoid, HardSwish, Tanh, Elu, Softmax, MaxPool,
  AveragePool, GlobalAveragePool, spatial ReduceMean -> AdaptiveAvgPool2d (and Flatten without keepdims),
  Flatten, Dropout;
* arithmetic and shape operators (Add, Sub, Mul, Div, Concat, Reshape, Transpose, Pad, Identity and
  the Shape/Gather/Unsqueeze/Squeeze/Slice/Cast chains exporters write for ``x.view(x.size(0), -1)``)
  run as functions inside the module that held them, Add and Mul as the ATen operators
  :mod:`mlflow_di.coverage.canonizers` rewrites for LRP (residual sums, gates).

Layer names are the PyTorch module names when the graph remembers them: a weight initializer
called ``layer1.0.conv1.weight`` names its layer ``layer1.0.conv1``; torch's exporters record the
module scope of every node (``pkg.torch.onnx.name_scopes``, or node names like
``/layer1/layer1.0/relu/Relu``). Nodes are grouped into nested :class:`~mlflow_di.models.pt2.RebuiltModule`
containers by that scope, so ``layer1`` and ``layer1.0`` are modules that run, with hooks, as in
the model the graph was exported from. Other graphs get names from their node names. Exporters fold
batch norms into the convolutions before them: the view then has no ``bn`` layers, and a
convolution's activations are the folded (post-batch-norm) ones.

An operator with no conversion is a one-line :class:`UserError` naming it; the black-box commands
(fuzz, robustness, gate) still work on that model. The result is checked against ONNX Runtime on
a probe input.
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import math
import operator
import re

import numpy as np
import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.input_files import check_allocation
from mlflow_di.models.pt2 import RebuiltModule, holding

__all__ = ["onnx_to_torch"]

aten = torch.ops.aten
_PATH = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")


# ---------------------------------------------------------------------------------------------- functions
# Operators that run inside a container's graph. Each is recorded as one call when torch.fx traces
# a converted model (the canonizers do), instead of being traced into (torch.fx.wrap only reaches
# calls written in a module's own source, not the code torch.fx generates for a graph).
def _traceable(function):
    @functools.wraps(function)
    def call(*args):
        for arg in args:
            for value in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                if isinstance(value, torch.fx.Proxy):
                    return value.tracer.create_proxy("call_function", call, args, {})
        return function(*args)
    return call


@_traceable
def onnx_shape(x):
    return torch.tensor(x.shape, dtype=torch.int64)


@_traceable
def onnx_gather(data, indices, axis: int):
    indices = torch.as_tensor(indices, dtype=torch.int64)
    if data.dim() == 1 and indices.dim() == 0 and axis == 0:
        return data[int(indices)]
    return torch.index_select(data, axis, indices.reshape(-1).long()).reshape(
        *data.shape[:axis], *indices.shape, *data.shape[axis + 1:])


@_traceable
def onnx_unsqueeze(x, axes):
    for axis in sorted(int(a) % (x.dim() + len(axes)) for a in _ints(axes)):
        x = x.unsqueeze(axis)
    return x


@_traceable
def onnx_squeeze(x, axes):
    axes = sorted((int(a) % x.dim() for a in _ints(axes)), reverse=True) if axes is not None else None
    if axes is None:
        return x.squeeze()
    for axis in axes:
        x = x.squeeze(axis)
    return x


@_traceable
def onnx_slice(x, starts, ends, axes=None, steps=None):
    starts, ends = _ints(starts), _ints(ends)
    axes = _ints(axes) if axes is not None else list(range(len(starts)))
    steps = _ints(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps):
        size = x.shape[axis]
        index[axis] = slice(max(min(start, size), -size), max(min(end, size), -size - 1), step)
    return x[tuple(index)]


@_traceable
def onnx_reshape(x, shape):
    target = [x.shape[i] if value == 0 else value for i, value in enumerate(_ints(shape))]
    return x.reshape(target)


@_traceable
def onnx_concat(tensors, axis: int):
    tensors = [torch.as_tensor(t) for t in tensors]
    if all(t.dtype == torch.int64 for t in tensors):  # shape arithmetic
        return torch.cat([t.reshape(-1) if t.dim() == 0 else t for t in tensors], axis)
    return torch.cat(tensors, axis)


@_traceable
def onnx_cast(x, dtype):
    return x.to(dtype)


@_traceable
def onnx_pad(x, pads, value: float = 0.0):
    pads = _ints(pads)
    half = len(pads) // 2
    torch_pads = []
    for axis in reversed(range(half)):  # torch pads the last axis first, (begin, end) pairs
        torch_pads += [pads[axis], pads[axis + half]]
    return nn.functional.pad(x, torch_pads, value=value)


@_traceable
def onnx_gemm(a, b, c, alpha: float, beta: float, trans_a: int, trans_b: int):
    a = a.t() if trans_a else a
    b = b.t() if trans_b else b
    out = alpha * (a @ b)
    return out + beta * c if c is not None else out


@_traceable
def onnx_constant_of_shape(shape, value: float):
    return torch.full(_ints(shape), value, dtype=torch.int64 if float(value).is_integer() else torch.float32)


def _ints(values) -> list[int]:
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.reshape(-1).tolist()]
    return [int(v) for v in values]



_DTYPES = {1: torch.float32, 6: torch.int32, 7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64}


# ---------------------------------------------------------------------------------------------- conversion
@dataclasses.dataclass
class _Node:
    """One ONNX node with where it lives: ``path`` the module it belongs to ('' = the root)."""

    proto: object
    path: str
    attrs: dict

    @property
    def op(self) -> str:
        return self.proto.op_type


def onnx_to_torch(model, name: str = "model") -> nn.Module:
    """The white-box module of an ONNX ``model`` (a ``ModelProto`` or a path), in eval mode."""
    import onnx
    from onnx import numpy_helper

    if not isinstance(model, onnx.ModelProto):
        try:
            model = onnx.load(str(model))
        except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError for a damaged file
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"cannot read the ONNX model '{name}': {detail}; is it an .onnx file?") from None
    graph = model.graph
    constants = {init.name: torch.from_numpy(numpy_helper.to_array(init).copy()) for init in graph.initializer}
    inputs = [value for value in graph.input if value.name not in constants]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise UserError(f"'{name}' has {len(inputs)} inputs and {len(graph.output)} outputs; the white-box view "
                        "covers classifiers with one image input and one output")
    nodes = []
    for proto in graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in proto.attribute}
        if proto.op_type == "Constant":
            constants[proto.output[0]] = _constant(attrs, numpy_helper)
            continue
        if proto.op_type == "Identity" and proto.input[0] in constants:  # exporters alias shared weights so
            constants[proto.output[0]] = constants[proto.input[0]]
            continue
        if proto.domain not in ("", "ai.onnx"):
            raise _unsupported(name, proto)
        nodes.append(_Node(proto, "", attrs))
    nodes = _fused_linear(nodes, constants)
    for node in nodes:
        node.path = _path_of(node, constants)
    converter = _Converter(constants, name, nodes)
    root = converter.module("", nodes, [inputs[0].name], [graph.output[0].name])
    root.eval()
    _check_against_onnxruntime(model, root, inputs[0], name)
    root.onnx_layer_names = dict(converter.layer_of)
    return root


def onnx_layer_names(module) -> dict[str, str]:
    """{ONNX node name: the view's name of the layer it became} of a module :func:`onnx_to_torch` built ({} for
    any other module): the one mapping by which every command names an ONNX model's layers as coverage does."""
    return dict(getattr(module, "onnx_layer_names", None) or {})


def _fused_linear(nodes: list[_Node], constants: dict) -> list[_Node]:
    """MatMul by a constant matrix whose only user adds a constant vector: one Gemm (a Linear with bias),
    as a dense layer is (an added bias would otherwise absorb no relevance)."""
    import onnx

    users: dict[str, list[_Node]] = {}
    for node in nodes:
        for value in node.proto.input:
            users.setdefault(value, []).append(node)
    dropped, fused = set(), {}
    for node in nodes:
        weight = constants.get(node.proto.input[1]) if node.op == "MatMul" and len(node.proto.input) > 1 else None
        following = users.get(node.proto.output[0], [])
        if weight is None or weight.dim() != 2 or len(following) != 1 or following[0].op != "Add":
            continue
        add = following[0]
        other = [v for v in add.proto.input if v != node.proto.output[0]]
        bias = constants.get(other[0]) if len(other) == 1 else None
        if bias is None or bias.numel() != weight.shape[1]:
            continue
        gemm = onnx.helper.make_node("Gemm", [node.proto.input[0], node.proto.input[1], other[0]],
                                     [add.proto.output[0]], name=node.proto.name)
        gemm.metadata_props.extend(node.proto.metadata_props)
        fused[id(node)] = _Node(gemm, "", {})
        dropped.add(id(add))
    return [fused.get(id(node), node) for node in nodes if id(node) not in dropped]


def _constant(attrs: dict, numpy_helper) -> torch.Tensor:
    if "value" in attrs:
        return torch.from_numpy(numpy_helper.to_array(attrs["value"]).copy())
    for key, dtype in (("value_float", torch.float32), ("value_int", torch.int64), ("value_floats", torch.float32),
                       ("value_ints", torch.int64)):
        if key in attrs:
            return torch.tensor(attrs[key], dtype=dtype)
    raise UserError(f"an ONNX Constant node holds {sorted(attrs)}, which the white-box view does not read")


def _unsupported(name: str, proto) -> UserError:
    operator = f"{proto.domain + '.' if proto.domain else ''}{proto.op_type}"
    black_box = ("the black-box commands (fuzz, robustness, gate) work on it, and so does the PyTorch model it was "
                 "exported from")
    if proto.domain not in ("", "ai.onnx", "ai.onnx.ml", "com.microsoft"):  # a custom operator: ONNX Runtime lacks it too
        black_box = (f"ONNX Runtime cannot run it either without the library that implements {operator}, so the "
                     "black-box commands fail too; analyse the PyTorch model it was exported from")
    return UserError(f"'{name}': ONNX operator {operator} (node '{proto.name}') has no white-box conversion, so coverage "
                     f"and other white-box commands cannot analyse this model; {black_box}")


def _path_of(node: _Node, constants: dict) -> str:
    """The node's module path, from its weight's name, torch's recorded scope, or its node name."""
    proto = node.proto
    if node.op in ("Conv", "Gemm", "MatMul") and len(proto.input) > 1 and proto.input[1] in constants:
        weight = proto.input[1]
        if weight.endswith(".weight") and _PATH.match(weight[:-len(".weight")]):
            return weight[:-len(".weight")]
    scopes = next((p.value for p in proto.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
    if scopes:
        try:
            parts = [part for part in ast.literal_eval(scopes) if part]
        except (ValueError, SyntaxError):
            parts = []
        if len(parts) >= 2 and _PATH.match(parts[-2]):
            return parts[-2]
        return ""
    if proto.name.startswith("/"):
        # torch's TorchScript exporter: one scope per module, a Sequential's child prefixed with the
        # Sequential's own name: /layer1/layer1.0/relu/Relu, /features/features.1/block/block.0/Conv
        names, previous = [], None
        for part in proto.name.strip("/").split("/")[:-1]:
            if not _PATH.match(part):
                return ""
            names.append(part[len(previous) + 1:] if previous and part.startswith(previous + ".") else part)
            previous = part
        return ".".join(names)
    return ""


class _Converter:
    def __init__(self, constants: dict, name: str, nodes: list[_Node]):
        self.constants = constants
        self.name = name
        self.layer_of: dict[str, str] = {}  # ONNX node name -> the layer it became (its module path)
        # a container: a path some node lives below, or one holding several nodes (other than one
        # activation module called more than once)
        self.containers = {node.path.rsplit(".", i)[0] for node in nodes for i in range(1, node.path.count(".") + 1)
                           if node.path} | {""}
        counts = collections.Counter(node.path for node in nodes)
        self.containers |= {path for path, count in counts.items() if count > 1 and not _same_layer(nodes, path)}
        #: (container path, child) -> the signature of the nodes its first call ran, and where its outputs came
        #: from: a later call with the same signature is the same module called again
        self.calls: dict[tuple[str, str], tuple] = {}

    def module(self, path: str, nodes: list[_Node], inputs: list[str], outputs: list[str]) -> nn.Module:
        """The container at ``path`` running ``nodes`` (all under it) from ``inputs`` to ``outputs``."""
        graph = torch.fx.Graph()
        root = nn.Module()
        env = {value: graph.placeholder(_identifier(value, i)) for i, value in enumerate(inputs)}
        index = 0
        while index < len(nodes):
            node = nodes[index]
            child = _child(path, node.path)
            if child is None:  # a node of this container itself
                self._emit(graph, root, env, node, path)
                index += 1
                continue
            run_end = index
            while run_end < len(nodes) and _child(path, nodes[run_end].path) == child:
                run_end += 1
            run = nodes[index:run_end]
            child_path = f"{path}.{child}" if path else child
            if hasattr(root, child) and len(run) == 1 and child_path not in self.containers:
                env[run[0].proto.output[0]] = graph.call_module(child, (env[run[0].proto.input[0]],))
                index = run_end
                continue  # the same layer called again (torch exporters scope both calls alike)
            run_inputs = _external_inputs(run, self.constants)
            later = {v for n in nodes[run_end:] for v in n.proto.input} | set(outputs)
            run_outputs = [out for n in run for out in n.proto.output if out in later]
            signature = (_signature(run, child_path, self.constants), _positions(run, run_outputs))
            if hasattr(root, child):  # a block called again: the same module when it runs the same nodes
                if self.calls.get((path, child)) != signature:
                    raise UserError(f"'{self.name}': the graph calls module '{child_path}' in two places with different "
                                    "operators or weights, which the white-box view of ONNX graphs cannot rebuild as "
                                    "one module; analyse the PyTorch model it was exported from")
                self._call(graph, env, child, run_inputs, run_outputs)
                index = run_end
                continue
            self.calls[(path, child)] = signature
            if child_path in self.containers:
                submodule = self.module(child_path, run, run_inputs, run_outputs)
            else:
                submodule = self.layer(run)
                if not isinstance(submodule, RebuiltModule):  # one node, one torch.nn layer
                    self.layer_of[run[0].proto.name] = child_path
            root.add_module(child, submodule)
            self._call(graph, env, child, run_inputs, run_outputs)
            index = run_end
        returned = [env[value] for value in outputs]
        graph.output(returned[0] if len(returned) == 1 else tuple(returned))
        module = RebuiltModule(root, graph, class_name="OnnxModule")
        module.original_type = f"onnx:{path or 'graph'}"
        return module

    def _call(self, graph, env, child: str, run_inputs: list[str], run_outputs: list[str]) -> None:
        """A call of the module ``child`` (its first, or a later call of a block that ran the same nodes
        before): its inputs in, its outputs out."""
        result = graph.call_module(child, tuple(env[v] for v in run_inputs))
        if len(run_outputs) == 1:
            env[run_outputs[0]] = result
        else:
            for position, value in enumerate(run_outputs):
                env[value] = graph.call_function(operator.getitem, (result, position))

    def built_layer(self, node: _Node) -> nn.Module | None:
        """The torch.nn layer ``node`` is, or None when it has no layer type (then it runs as a function)."""
        build = _LAYERS.get(node.op)
        return build(self, node) if build is not None else None

    def layer(self, run: list[_Node]) -> nn.Module:
        """The torch.nn layer of a leaf module's node(s)."""
        built = self.built_layer(run[0])
        if built is None:  # no layer type for it: a container of its operators
            return self.module(run[0].path, [dataclasses.replace(n, path=run[0].path) for n in run],
                               _external_inputs(run, self.constants), [run[-1].proto.output[0]])
        return built

    def _emit(self, graph, root, env, node: _Node, path: str) -> None:
        """One node as a call in the container's graph (a layer of its own when it is one)."""
        built = self.built_layer(node)
        if built is not None:
            child = _identifier(f"{node.op.lower()}", len(list(root.children())))
            root.add_module(child, built)
            self.layer_of[node.proto.name] = f"{path}.{child}" if path else child
            value = graph.call_module(child, (env[node.proto.input[0]],))
        else:
            function = _FUNCTIONS.get(node.op)
            if function is None:
                raise _unsupported(self.name, node.proto)
            args = [self._value(graph, root, env, value) if value else None for value in node.proto.input]
            value = function(graph, args, node.attrs)
        env[node.proto.output[0]] = value

    def _value(self, graph, root, env, name: str):
        if name in env:
            return env[name]
        tensor = self.constants[name]
        if tensor.dtype == torch.int64 and tensor.numel() <= 8:
            return tensor.tolist()  # shape arithmetic: a constant argument
        attribute = _identifier("constant", len(list(root.buffers())))
        root.register_buffer(attribute, tensor)
        env[name] = graph.get_attr(attribute)
        return env[name]


def _same_layer(nodes: list[_Node], path: str) -> bool:
    """Whether every node at ``path`` is the same layer: one operator with a layer type, the same attributes and
    the same constant inputs (weights), as a pooling or activation module, or a convolution, used twice is."""
    ops = {(n.op, repr(sorted(n.attrs.items())), tuple(n.proto.input[1:])) for n in nodes if n.path == path}
    return len(ops) == 1 and next(iter(ops))[0] in _LAYERS


def _signature(run: list[_Node], child_path: str, constants: dict) -> tuple:
    """What a block's call runs: each node's place below the block, operator, attributes and weights (constant
    inputs by name; computed inputs by their position among the run's)."""
    produced = {out: (i, j) for i, n in enumerate(run) for j, out in enumerate(n.proto.output)}
    external = _external_inputs(run, constants)

    def source(value: str):
        if value in constants:
            return ("weight", value)
        return ("node", produced[value]) if value in produced else ("input", external.index(value) if value in external
                                                                        else value)

    return tuple((n.path[len(child_path):], n.op, repr(sorted(n.attrs.items())),
                  tuple(source(v) for v in n.proto.input if v)) for n in run)


def _positions(run: list[_Node], values: list[str]) -> tuple:
    """Where in ``run`` each of ``values`` is produced: (node index, output index)."""
    produced = {out: (i, j) for i, n in enumerate(run) for j, out in enumerate(n.proto.output)}
    return tuple(produced[value] for value in values)


def _child(path: str, node_path: str) -> str | None:
    """The first component of ``node_path`` below ``path``; None when the node lives at ``path`` itself."""
    if node_path == path:
        return None
    rest = node_path[len(path) + 1:] if path else node_path
    return rest.split(".", 1)[0]


def _external_inputs(run: list[_Node], constants: dict) -> list[str]:
    produced = {out for n in run for out in n.proto.output}
    return list(dict.fromkeys(v for n in run for v in n.proto.input if v and v not in produced and v not in constants))


def _identifier(text: str, number: int) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9_]", "_", text).strip("_") or "value"
    return f"{cleaned}_{number}" if not cleaned[0].isalpha() or number else cleaned


# ---------------------------------------------------------------------------------------------- layers
def _symmetric(pads, dims: int):
    if not pads:
        return (0,) * dims
    begin, end = tuple(pads[:dims]), tuple(pads[dims:])
    return begin if begin == end else None


def _conv(self: _Converter, node: _Node):
    inputs = node.proto.input
    if len(inputs) < 2 or inputs[1] not in self.constants:
        return None
    weight = self.constants[inputs[1]]
    dims = weight.dim() - 2
    padding = _symmetric(node.attrs.get("pads"), dims)
    auto_pad = node.attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    strides = tuple(node.attrs.get("strides", (1,) * dims))
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") and all(s == 1 for s in strides):
        padding = "same"
    elif auto_pad == "VALID":
        padding = (0,) * dims
    elif padding is None and dims == 2:  # uneven padding (Keras' 'same' with stride 2): pad, then convolve
        pads = node.attrs["pads"]
        conv = _conv(self, dataclasses.replace(node, attrs={**node.attrs, "pads": [0] * 4}))
        return nn.Sequential(nn.ZeroPad2d((pads[1], pads[3], pads[0], pads[2])), conv)
    if padding is None or dims not in (1, 2, 3):
        return None
    group = node.attrs.get("group", 1)
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    bias = self.constants.get(inputs[2]) if len(inputs) > 2 and inputs[2] else None
    return holding(cls(weight.shape[1] * group, weight.shape[0], tuple(weight.shape[2:]), stride=strides,
                       padding=padding, dilation=tuple(node.attrs.get("dilations", (1,) * dims)), groups=group,
                       bias=bias is not None), weight, bias)


def _gemm(self: _Converter, node: _Node):
    inputs = node.proto.input
    if node.attrs.get("transA", 0) or len(inputs) < 2 or inputs[1] not in self.constants:
        return None
    weight = self.constants[inputs[1]] * node.attrs.get("alpha", 1.0)
    weight = weight if node.attrs.get("transB", 0) else weight.t()
    bias = self.constants.get(inputs[2]) if len(inputs) > 2 and inputs[2] else None
    if bias is not None:
        bias = (bias * node.attrs.get("beta", 1.0)).reshape(-1)
        if bias.numel() == 1:
            bias = bias.expand(weight.shape[0])
    return holding(nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None), weight, bias)


def _matmul(self: _Converter, node: _Node):
    inputs = node.proto.input
    weight = self.constants.get(inputs[1]) if len(inputs) > 1 else None
    if weight is None or weight.dim() != 2:
        return None
    return holding(nn.Linear(weight.shape[0], weight.shape[1], bias=False), weight.t())


def _batch_norm(self: _Converter, node: _Node):
    names = node.proto.input[1:5]
    if len(names) != 4 or not all(n in self.constants for n in names):
        return None
    scale, bias, mean, var = (self.constants[n] for n in names)
    layer = holding(nn.BatchNorm2d(mean.shape[0], eps=node.attrs.get("epsilon", 1e-5)), scale, bias)
    layer.running_mean.copy_(mean)
    layer.running_var.copy_(var)
    return layer


def _pool(cls):
    def build(self: _Converter, node: _Node):
        kernel = tuple(node.attrs["kernel_shape"])
        padding = _symmetric(node.attrs.get("pads"), len(kernel))
        if padding is None or len(kernel) != 2 or node.attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            return None
        options = {"stride": tuple(node.attrs.get("strides", (1, 1))), "padding": padding,
                   "ceil_mode": bool(node.attrs.get("ceil_mode", 0))}
        if cls is nn.MaxPool2d:
            options["dilation"] = tuple(node.attrs.get("dilations", (1, 1)))
        else:
            options["count_include_pad"] = bool(node.attrs.get("count_include_pad", 0))
        return cls(kernel, **options)
    return build


def _clip(self: _Converter, node: _Node):
    inputs = list(node.proto.input) + ["", ""]
    low = float(self.constants[inputs[1]]) if inputs[1] in self.constants else node.attrs.get("min")
    high = float(self.constants[inputs[2]]) if inputs[2] in self.constants else node.attrs.get("max")
    if low == 0 and high == 6:
        return nn.ReLU6()
    if low == 0 and high is None:
        return nn.ReLU()
    return None


def _reduce_mean(self: _Converter, node: _Node):
    axes = node.attrs.get("axes")
    if axes is None and len(node.proto.input) > 1 and node.proto.input[1] in self.constants:
        axes = self.constants[node.proto.input[1]].tolist()
    if sorted(int(a) % 4 for a in axes or []) != [2, 3]:
        return None  # another reduction runs as the ATen mean (its canonizer makes it a pooling module for LRP)
    return nn.AdaptiveAvgPool2d(1) if node.attrs.get("keepdims", 1) else nn.Sequential(nn.AdaptiveAvgPool2d(1),
                                                                                        nn.Flatten(1))


def _hard_sigmoid(self: _Converter, node: _Node):
    alpha, beta = node.attrs.get("alpha", 0.2), node.attrs.get("beta", 0.5)
    return nn.Hardsigmoid() if abs(alpha - 1 / 6) < 1e-6 and abs(beta - 0.5) < 1e-6 else None


def _softmax(cls):
    return lambda self, node: cls(dim=node.attrs.get("axis", -1))


_LAYERS = {
    "Conv": _conv, "Gemm": _gemm, "MatMul": _matmul, "BatchNormalization": _batch_norm,
    "Relu": lambda self, node: nn.ReLU(), "Sigmoid": lambda self, node: nn.Sigmoid(),
    "Tanh": lambda self, node: nn.Tanh(), "HardSwish": lambda self, node: nn.Hardswish(),
    "HardSigmoid": _hard_sigmoid, "LeakyRelu": lambda self, node: nn.LeakyReLU(node.attrs.get("alpha", 0.01)),
    "Elu": lambda self, node: nn.ELU(node.attrs.get("alpha", 1.0)), "Clip": _clip,
    "Softmax": _softmax(nn.Softmax), "LogSoftmax": _softmax(nn.LogSoftmax),
    "MaxPool": _pool(nn.MaxPool2d), "AveragePool": _pool(nn.AvgPool2d),
    "GlobalAveragePool": lambda self, node: nn.AdaptiveAvgPool2d(1), "ReduceMean": _reduce_mean,
    "Flatten": lambda self, node: nn.Flatten(1) if node.attrs.get("axis", 1) == 1 else None,
    "Dropout": lambda self, node: nn.Dropout(), "Identity": lambda self, node: nn.Identity(),
    "Reshape": lambda self, node: _flattening(self, node),
}


def _flattening(self: _Converter, node: _Node):
    """A Reshape to two axes, (0 or -1 or the batch, K or -1), as a Flatten: how torch's exporters write
    ``nn.Flatten`` and ``x.view(x.size(0), -1)``. A Reshape that does not keep the batch axis would
    give the probe check in :func:`onnx_to_torch` another output shape, and is refused there."""
    shape = self.constants.get(node.proto.input[1]) if len(node.proto.input) > 1 else None
    return nn.Flatten(1) if shape is not None and shape.numel() == 2 else None


def _call(target):
    return lambda graph, args, attrs: graph.call_function(target, tuple(args))


def _binary(op):
    return lambda graph, args, attrs: graph.call_function(op, tuple(args[:2]))


_FUNCTIONS = {
    "Add": _binary(aten.add.Tensor), "Sub": _binary(aten.sub.Tensor), "Mul": _binary(aten.mul.Tensor),
    "Div": _binary(aten.div.Tensor), "Relu": _call(aten.relu.default), "Sigmoid": _call(aten.sigmoid.default),
    "Identity": lambda graph, args, attrs: args[0], "Dropout": lambda graph, args, attrs: args[0],
    "Concat": lambda graph, args, attrs: graph.call_function(onnx_concat, (list(args), attrs.get("axis", 0))),
    "Reshape": lambda graph, args, attrs: graph.call_function(onnx_reshape, tuple(args[:2])),
    "Flatten": lambda graph, args, attrs: graph.call_function(torch.flatten, (args[0], attrs.get("axis", 1))),
    "Transpose": lambda graph, args, attrs: graph.call_function(aten.permute.default, (args[0], list(attrs["perm"]))),
    "Shape": lambda graph, args, attrs: graph.call_function(onnx_shape, (args[0],)),
    "Gather": lambda graph, args, attrs: graph.call_function(onnx_gather, (args[0], args[1], attrs.get("axis", 0))),
    "Unsqueeze": lambda graph, args, attrs: graph.call_function(
        onnx_unsqueeze, (args[0], args[1] if len(args) > 1 else attrs["axes"])),
    "Squeeze": lambda graph, args, attrs: graph.call_function(
        onnx_squeeze, (args[0], args[1] if len(args) > 1 else attrs.get("axes"))),
    "Slice": lambda graph, args, attrs: graph.call_function(onnx_slice, tuple(args[:5])),
    "Cast": lambda graph, args, attrs: graph.call_function(
        onnx_cast, (args[0], _DTYPES.get(attrs["to"], torch.float32))),
    "Pad": lambda graph, args, attrs: graph.call_function(
        onnx_pad, (args[0], args[1], float(args[2]) if len(args) > 2 and isinstance(args[2], torch.Tensor) else 0.0)),
    "Gemm": lambda graph, args, attrs: graph.call_function(onnx_gemm, (
        args[0], args[1], args[2] if len(args) > 2 else None, attrs.get("alpha", 1.0), attrs.get("beta", 1.0),
        attrs.get("transA", 0), attrs.get("transB", 0))),
    "MatMul": _binary(torch.matmul),
    "ReduceMean": lambda graph, args, attrs: graph.call_function(aten.mean.dim, (
        args[0], list(args[1]) if len(args) > 1 and args[1] is not None else list(attrs["axes"]),
        bool(attrs.get("keepdims", 1)))),
    "ConstantOfShape": lambda graph, args, attrs: graph.call_function(onnx_constant_of_shape, (
        args[0], float(attrs["value"].float_data[0]) if "value" in attrs and attrs["value"].float_data else 0.0)),
}


# ---------------------------------------------------------------------------------------------- check
def _check_against_onnxruntime(model, root: nn.Module, graph_input, name: str) -> None:
    """The converted module and ONNX Runtime give the same outputs on a random probe input."""
    import onnxruntime

    dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 2
            for d in graph_input.type.tensor_type.shape.dim]
    check_allocation(f"the input '{graph_input.name}' of {name} {tuple(dims)} (float32)", 4 * math.prod(dims),
                     "export the model at the input size it classifies, with a small or dynamic batch")
    probe = np.random.default_rng(0).random(dims, dtype=np.float32)
    from mlflow_di.models import stoppable
    from mlflow_di.models.execution import session_options

    session = onnxruntime.InferenceSession(model.SerializeToString(), session_options(),
                                           providers=["CPUExecutionProvider"])
    expected = stoppable.run(session, {graph_input.name: probe}, name)[0]
    if not np.isfinite(expected).all():  # the model itself answers NaN/Inf: not the view's fault
        from mlflow_di.models.classifier import check_finite

        check_finite(expected.reshape(len(expected), -1), name, "probe images ONNX Runtime ran")
    try:
        with torch.no_grad():
            got = root(torch.from_numpy(probe)).numpy()
    except (RuntimeError, TypeError, IndexError, ValueError) as exc:
        raise UserError(f"'{name}': the white-box view of its ONNX graph does not run ({str(exc).splitlines()[0]}); "
                        "the black-box commands (fuzz, robustness, gate) work on this model") from None
    if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-4, atol=1e-4):
        raise UserError(f"'{name}': the white-box view of its ONNX graph computes other outputs than ONNX Runtime; "
                        "please report the model's operators. The black-box commands work on this model")
