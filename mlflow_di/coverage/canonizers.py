"""Canonizers: rewrite the parts of a model's forward code that LRP cannot see into modules it can.

LRP works module by module, so tensor arithmetic written inside a ``forward`` gets the plain
gradient, which is wrong for relevance in two places that every modern CNN has:

- **residual additions** (``x + block(x)``): the gradient hands the full relevance to *both*
  operands, so relevance is counted twice. The canonizers here rewrite each known residual block to
  stack the two operands and add them with a zennit ``Sum``, whose ``Norm`` rule splits relevance
  in proportion to each operand's contribution (zennit's own ResNet canonizers do this for
  torchvision's ``BasicBlock``/``Bottleneck``; the same is done here for the zoo's ResNet-20 block,
  MobileNetV2/V3's ``InvertedResidual`` and EfficientNet's ``MBConv``/``FusedMBConv``).
- **multiplicative gates** (squeeze-and-excitation, ``gate * x``): the gradient scales the signal's
  relevance by the gate and leaks the rest into the gate branch, which then flows back into the
  input a second time. :class:`Gate` treats the gate as a constant weighting: all relevance goes to
  the signal, none to the gate (the "signal-take-all" rule of LRP for gated units).

Models rebuilt from MLflow's pt2 format (:class:`~mlflow_di.models.pt2.RebuiltModule`) have no
forward code to swap: their blocks run exported graphs of ATen operators. :func:`lrp_graph_attributes`
rewrites such a graph the same way: each addition of two tensors becomes a ``Sum``, each product
of a signal and a sigmoid-like gate a :class:`Gate`, and each functional average pool a pooling
module (so that it gets the proportional rule, as DenseNet's head does below).

Concatenation (DenseNet, SqueezeNet's ``Fire``) needs no canonizer: its gradient already splits
relevance between the parts. Batch norms whose input is a convolution's (or linear layer's) output
are merged into it (:class:`GraphMergeBatchNorm`): the pairs are read off the traced graph, not off
module order, because zennit's ``SequentialMergeBatchNorm`` pairs modules by definition order and
merged DenseNet's last convolution of one dense layer into the next layer's batch norm (which reads
a concatenation), a shape error.

:func:`unhandled_tensor_arithmetic` traces a model (with the canonizers applied) and names the
first module whose forward still adds or multiplies two tensors, so that a model this module does
not know gets a clear error instead of silently double-counted relevance.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator

import torch
from torch import nn
from zennit.canonizers import AttributeCanonizer, MergeBatchNorm, SequentialMergeBatchNorm
from zennit.layer import Sum
from zennit.torchvision import ResNetBasicBlockCanonizer, ResNetBottleneckCanonizer


@contextlib.contextmanager
def out_of_place(module: nn.Module):
    """Switch every in-place activation (``inplace=True``, torchvision's default) off for the duration.

    An in-place activation overwrites its input, the output of the layer before it, which the layer
    recorder keeps and zennit's rules may read. zennit's hooks already hand each hooked module a
    copy of its input, so this is a safeguard rather than a fix: with the switch left out,
    EfficientNet-B0's conservation and ResNet-18's recorded ``bn1`` activations were the same
    (measured). The 0.8-1.3x once put down to in-place activations was the float32 conditioning of
    the bias-free test models (benchmarks/check_lrp_conservation.py).
    """
    switched = [leaf for leaf in module.modules() if getattr(leaf, "inplace", False) is True]
    for leaf in switched:
        leaf.inplace = False
    try:
        yield module
    finally:
        for leaf in switched:
            leaf.inplace = True


class _SignalTakesAll(torch.autograd.Function):
    """``gate * signal`` forward; backward hands all relevance to the signal and none to the gate."""

    @staticmethod
    def forward(ctx, gate, signal):
        return gate * signal

    @staticmethod
    def backward(ctx, relevance):
        return None, relevance


class Gate(nn.Module):
    """``gate * signal`` with LRP's signal-take-all rule (see the module docstring)."""

    def forward(self, gate: torch.Tensor, signal: torch.Tensor) -> torch.Tensor:
        # detached: the gate branch is left out of the backward pass altogether, not fed zeros
        return _SignalTakesAll.apply(gate.detach(), signal)


def _sum_of(self, shortcut: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return self.canonizer_sum(torch.stack([shortcut, branch], dim=-1))


def _preact_residual_forward(self, x):
    """The zoo's pre-activation residual block (ResNet-20)."""
    residual = self.conv_a(self.relu_a(self.bn_a(x)))
    residual = self.conv_b(self.relu_b(self.bn_b(residual)))
    return _sum_of(self, self.shortcut(x), residual)


def _mobilenet_v2_forward(self, x):
    return _sum_of(self, x, self.conv(x))


def _block_residual_forward(self, x):
    """MobileNetV3's InvertedResidual and EfficientNet's MBConv/FusedMBConv (stochastic depth is
    the identity in eval mode, where relevance is computed)."""
    result = self.block(x)
    if hasattr(self, "stochastic_depth"):
        result = self.stochastic_depth(result)
    return _sum_of(self, x, result)


def _densenet_forward(self, x):
    """torchvision's DenseNet with its functional head (relu, global average pool) as modules, so the
    pool gets LRP's proportional rule: the plain gradient spread relevance evenly onto positions
    the ReLU had zeroed, where it was lost (measured: 73-92% of the relevance conserved, 100% after)."""
    features = self.canonizer_relu(self.features(x))
    return self.classifier(torch.flatten(self.canonizer_pool(features), 1))


def _squeeze_excitation_forward(self, x):
    return self.canonizer_gate(self._scale(x), x)


def _residual_blocks() -> dict[type, object]:
    """Block type -> replacement forward, for blocks whose forward adds a shortcut."""
    from torchvision.models import efficientnet, mobilenetv2, mobilenetv3

    from mlflow_di.models.zoo import PreActResidualBlock

    return {
        PreActResidualBlock: _preact_residual_forward,
        mobilenetv2.InvertedResidual: _mobilenet_v2_forward,
        mobilenetv3.InvertedResidual: _block_residual_forward,
        efficientnet.MBConv: _block_residual_forward,
        efficientnet.FusedMBConv: _block_residual_forward,
    }


def _attributes(_name, module):
    """New attributes for one module (zennit's AttributeCanonizer contract), or None to leave it."""
    from torchvision.models import DenseNet
    from torchvision.ops.misc import SqueezeExcitation

    from mlflow_di.models.pt2 import RebuiltModule

    if isinstance(module, RebuiltModule):
        return lrp_graph_attributes(module)
    if isinstance(module, DenseNet):
        return {"forward": _densenet_forward.__get__(module), "canonizer_relu": nn.ReLU(),
                "canonizer_pool": nn.AdaptiveAvgPool2d((1, 1))}
    if isinstance(module, SqueezeExcitation):
        return {"forward": _squeeze_excitation_forward.__get__(module), "canonizer_gate": Gate()}
    forward = _residual_blocks().get(type(module))
    if forward is None:
        return None
    if forward is not _preact_residual_forward and not module.use_res_connect:
        return None  # a block without a shortcut (stride 2 or channel change) is plain sequential code
    return {"forward": forward.__get__(module), "canonizer_sum": Sum()}


class _ExactIdentity:
    """Mixin: after merging, make the batch norm the identity also when its ``eps`` is not tiny.

    zennit resets the merged batch norm to running_var = 1, which computes x / sqrt(1 + eps): with
    torchvision's MobileNetV3/EfficientNet eps = 1e-3 that scaled every merged block by 0.9995 and
    changed the logits of a random-init MobileNetV3-Small by up to 3 units out of 38 (measured);
    running_var = 1 - eps makes it exact.
    """

    @staticmethod
    def merge_batch_norm(modules, batch_norm):
        MergeBatchNorm.merge_batch_norm(modules, batch_norm)
        batch_norm.running_var.data = torch.full_like(batch_norm.running_var.data, 1.0 - batch_norm.eps)


class _SequentialMerge(_ExactIdentity, SequentialMergeBatchNorm):
    """zennit's order-based merge (the fallback for models fx cannot trace), with the exact identity."""


class GraphMergeBatchNorm(_ExactIdentity, MergeBatchNorm):
    """Merge each batch norm into the Linear/Conv whose output is its input and nothing else's.

    The pairs come from an fx trace of the model; when the model cannot be traced, zennit's
    order-based pairing is used instead (right for models written as sequences of modules).
    """

    def apply(self, root_module):
        try:
            pairs = _linear_batch_norm_pairs(root_module)
        except Exception:  # noqa: BLE001 - fx cannot trace every model
            return _SequentialMerge().apply(root_module)
        instances = []
        for linear, batch_norm in pairs:
            instance = self.copy()
            instance.register((linear,), batch_norm)
            instances.append(instance)
        return instances


#: Within :func:`traced_once`, what fx traces told about modules: {(kind, id(module), detail): fact}.
_TRACED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("traced", default=None)


@contextlib.contextmanager
def traced_once(facts: dict | None = None):
    """Within: what an fx trace tells about a module's structure (its batch-norm pairs, its unhandled tensor
    arithmetic) is found once per module and kept in ``facts`` (default: the enclosing scope's, else a new
    one). A relevance pass traces its model once for both; a pass split into batches
    (:class:`~mlflow_di.coverage.partials.FitJob`) keeps one ``facts`` for all of them: each batch traced
    the model twice, 56-67 ms for mobilenet_v3_small on this project's 2-core machine."""
    if facts is None:
        facts = _TRACED.get()
        facts = {} if facts is None else facts
    token = _TRACED.set(facts)
    try:
        yield facts
    finally:
        _TRACED.reset(token)


def _traced_fact(kind: str, module: nn.Module, detail, find):
    """``find()``, or within :func:`traced_once` what it gave for this module before."""
    facts = _TRACED.get()
    if facts is None:
        return find()
    key = (kind, id(module), detail)
    if key not in facts:
        facts[key] = find()
    return facts[key]


def _linear_batch_norm_pairs(module: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    return _traced_fact("batch-norm pairs", module, None, lambda: _pairs_in(module, _Tracer().trace(module)))


def _pairs_in(module: nn.Module, graph: torch.fx.Graph) -> list[tuple[nn.Module, nn.Module]]:
    """The (Linear/Conv, batch norm) pairs of ``module``'s traced ``graph``: a batch norm whose input is the
    output of a Linear/Conv that nothing else reads. The forward canonizers rewrite sums and gates, never
    these edges, so a canonized trace gives the same pairs (checked on 13 torchvision families)."""
    from zennit.types import BatchNorm, Linear as LinearOrConv

    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(module.get_submodule(node.target), BatchNorm):
            continue
        source = node.args[0]
        if (isinstance(source, torch.fx.Node) and source.op == "call_module" and len(source.users) == 1
                and isinstance(module.get_submodule(source.target), LinearOrConv)):
            pairs.append((module.get_submodule(source.target), module.get_submodule(node.target)))
    return pairs


_GATES = (nn.Sigmoid, nn.Hardsigmoid)
_ATEN = torch.ops.aten
_FUNCTIONAL_POOLS = {"adaptive_avg_pool2d": nn.AdaptiveAvgPool2d, "avg_pool2d": nn.AvgPool2d}


def lrp_graph_attributes(module: torch.fx.GraphModule) -> dict | None:
    """The attributes that make a rebuilt module's forward LRP-ready (see the module docstring), or
    None when its graph has nothing to rewrite.

    A copy of the graph is rewritten and compiled into a GraphModule sharing the module's children;
    its ``forward`` replaces the module's for the duration, and the new ``Sum``/``Gate``/pool modules
    become attributes (so zennit's composite finds and hooks them). The rewrite is made once per
    module and kept outside its registered attributes (compiling it on every LRP pass cost
    MobileNetV3-Small 20% of a pass over 64 images).
    """
    cached = module.__dict__.get("_lrp_rewrite")
    if cached is None:
        cached = module.__dict__["_lrp_rewrite"] = _lrp_rewrite(module)
    rewritten, added = cached
    return None if rewritten is None else {"forward": rewritten.forward, **added}


def _lrp_rewrite(module: torch.fx.GraphModule) -> tuple:
    """(the rewritten GraphModule, its new modules by name), or (None, {}) when nothing needs rewriting."""
    from torch.fx.operator_schemas import normalize_function

    from mlflow_di.models.pt2 import pool_layer

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    added: dict[str, nn.Module] = {}

    def replace(node, make, *args):
        name = f"canonizer_{type(make).__name__.lower()}_{len(added)}"
        added[name] = make
        with graph.inserting_before(node):
            new = graph.call_module(name, args)
        node.replace_all_uses_with(new)
        graph.erase_node(node)

    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        tensors = [arg for arg in node.args[:2] if isinstance(arg, torch.fx.Node) and arg.op != "get_attr"]
        if node.target == _ATEN.add.Tensor and len(tensors) == 2 and node.kwargs.get("alpha", 1) == 1:
            with graph.inserting_before(node):
                stacked = graph.call_function(torch.stack, (list(tensors),), {"dim": -1})
            replace(node, Sum(), stacked)
        elif node.target == _ATEN.mul.Tensor and len(tensors) == 2:
            gates = [arg for arg in tensors if _is_gate(module, arg)]
            if len(gates) == 1:
                replace(node, Gate(), gates[0], next(arg for arg in tensors if arg is not gates[0]))
        elif node.target._overloadpacket.__name__ in _FUNCTIONAL_POOLS:
            cls = _FUNCTIONAL_POOLS[node.target._overloadpacket.__name__]
            found = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
            replace(node, pool_layer(cls, found.kwargs), found.kwargs["input"])
    if not added:
        return None, {}
    graph.lint()
    targets = {node.target for node in graph.nodes if node.op in ("call_module", "get_attr")}
    root = {target: added.get(target) or operator.attrgetter(target)(module) for target in targets}
    return torch.fx.GraphModule(root, graph), added


def _is_gate(module: nn.Module, node) -> bool:
    if node.op == "call_module":
        return isinstance(module.get_submodule(node.target), _GATES)
    return node.op == "call_function" and node.target in (_ATEN.sigmoid.default, _ATEN.hardsigmoid.default)


def forward_canonizers() -> list:
    """Fresh instances of the canonizers that rewrite forward code (residual sums, gates, heads)."""
    return [AttributeCanonizer(_attributes), ResNetBasicBlockCanonizer(), ResNetBottleneckCanonizer()]


def canonizers() -> list:
    """Fresh canonizer instances (they hold per-model state) for :func:`lrp_composite`."""
    return [GraphMergeBatchNorm(), *forward_canonizers()]


_TENSOR_ARITHMETIC = {operator.add: "adds", operator.iadd: "adds", torch.add: "adds",
                      operator.mul: "multiplies", operator.imul: "multiplies", torch.mul: "multiplies",
                      operator.sub: "subtracts", torch.sub: "subtracts",
                      _ATEN.add.Tensor: "adds", _ATEN.mul.Tensor: "multiplies", _ATEN.sub.Tensor: "subtracts"}


class _Tracer(torch.fx.Tracer):
    """An fx tracer that keeps the canonizers' own modules whole (their arithmetic is handled)."""

    def is_leaf_module(self, module, qualified_name):
        return isinstance(module, (Sum, Gate)) or super().is_leaf_module(module, qualified_name)


def unhandled_tensor_arithmetic(module: nn.Module, example: torch.Tensor) -> str | None:
    """A sentence naming the first module whose forward adds/multiplies two tensors LRP would
    mis-handle, or None when there is none or the model cannot be traced (then nothing is claimed).

    Call it with the canonizers applied. ``example`` is one input, used to tell tensors from
    Python numbers (shape arithmetic) by propagating shapes through the traced graph.
    """
    return _traced_fact("tensor arithmetic", module, (tuple(example.shape), example.dtype, example.device),
                        lambda: _find_unhandled_tensor_arithmetic(module, example))


def _find_unhandled_tensor_arithmetic(module: nn.Module, example: torch.Tensor) -> str | None:
    try:
        traced = _Tracer().trace(module)
        _traced_fact("batch-norm pairs", module, None, lambda: _pairs_in(module, traced))  # one trace for both
        graph = torch.fx.GraphModule(module, traced)
        torch.fx.passes.shape_prop.ShapeProp(graph).propagate(example)
    except Exception:  # noqa: BLE001 - fx cannot trace every model (data-dependent control flow)
        return None
    for node in graph.graph.nodes:
        verb = _TENSOR_ARITHMETIC.get(node.target) if node.op == "call_function" else None
        tensors = [arg for arg in node.args[:2]  # a constant (get_attr) takes no relevance: it is not counted
                   if isinstance(arg, torch.fx.Node) and "tensor_meta" in arg.meta and arg.op != "get_attr"]
        if verb and len(tensors) == 2:
            return f"{_owner(module, node)} {verb} two tensors"
    return None


def _owner(module: nn.Module, node) -> str:
    """'module NAME (Type)' for the innermost module whose forward made ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "the model's own forward"
    key, value = list(stack.items())[-1]
    path = value[0] if isinstance(value, tuple) else key
    try:
        kind = type(module.get_submodule(path)).__name__
    except AttributeError:
        kind = "module"
    return f"module '{path}' ({kind})"
