"""Say *where* an ONNX export went wrong: which op, called by which module.

The exporters' own errors name an ATen op (``aten.linalg_eig``, ``aten::fft_fft2``) or a
source line, never the ``nn.Module`` a user would recognise. We run the model once eagerly,
recording every torch function it calls and every custom ``autograd.Function`` it applies,
each with the innermost module that was running, and match the exporter's op name against
that record. The same record explains silent failures: the TorchScript tracer freezes values
that pass through Python (``.tolist()``, ``.item()``, NumPy, custom Functions) into constants,
so an export that "worked" but disagrees with the module is traced back to those calls.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: Tensor methods whose result leaves the graph: a tracer records their value as a constant.
VALUE_LEAKING_METHODS = frozenset({"tolist", "item", "numpy", "__array__", "__float__", "__int__", "__bool__"})

_OP_PATTERNS = (
    re.compile(r"No ONNX function found for <OpOverload\(op='([\w.:]+)'"),
    re.compile(r"Exporting the operator '([\w.:]+)' to ONNX"),
    re.compile(r"Couldn't export (?:Python )?operator ([\w.:]+)"),
    re.compile(r"Unsupported FX nodes: \{'call_function': \['([\w.:]+)'"),
    re.compile(r"target=torch\.ops\.([\w.]+)"),
)
_SOURCE_PATTERN = re.compile(r"Caused by: \((.+?)\)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """One call made while a module ran: ``function`` is a torch function name or a custom Function."""

    module_path: str
    module_type: str
    function: str
    custom_function: bool = False

    def describe(self) -> str:
        where = f"module '{self.module_path}' ({self.module_type})" if self.module_path else f"the model ({self.module_type})"
        what = f"custom autograd Function {self.function}" if self.custom_function else f"'{self.function}'"
        return f"{what} in {where}"


def record_calls(module: nn.Module, example: torch.Tensor) -> list[ModuleCall]:
    """Run ``module`` once on ``example`` and list what it calls, attributed to the innermost module."""
    stack: list[tuple[str, nn.Module]] = []
    calls: list[ModuleCall] = []
    claimed: set = set()
    hooks = []
    for path, child in module.named_modules():
        hooks.append(child.register_forward_pre_hook(lambda m, args, path=path: stack.append((path, m))))
        hooks.append(child.register_forward_hook(_custom_function_hook(path, calls, claimed, stack)))
    recorder = _FunctionRecorder(stack, calls)
    try:
        with torch.enable_grad(), recorder:
            module(example.detach().clone().requires_grad_(True))
    except Exception:  # the model may not even run eagerly; the record so far still helps
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return calls


class _FunctionRecorder(TorchFunctionMode):
    """Notes each torch function / tensor method call with the module running at that moment."""

    def __init__(self, stack, calls):
        super().__init__()
        self.stack, self.calls = stack, calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.stack:
            path, running = self.stack[-1]
            self.calls.append(ModuleCall(path, type(running).__name__, _function_name(func)))
        return func(*args, **(kwargs or {}))


def _function_name(func) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return name.rsplit(".", 1)[-1]


def _custom_function_hook(path, calls, claimed, stack):
    """A forward hook that finds custom autograd Functions between a module's inputs and outputs.

    Hooks fire innermost-first, so the first module to see a Function node claims it; the walk
    stops at the module's inputs so that ops done before the module are not blamed on it.
    """

    def hook(module, args, output):
        stack.pop()
        inputs = {a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        pending = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node is None or node in inputs or node in claimed:
                continue
            claimed.add(node)
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                name = type(node).__name__.removesuffix("Backward")
                calls.append(ModuleCall(path, type(module).__name__, name, custom_function=True))
            pending.extend(next_node for next_node, _ in node.next_functions)

    return hook


def failing_op(errors: list[BaseException]) -> str | None:
    """The op an exporter error names, without namespace/overload ('aten.linalg_eig.default' -> 'linalg_eig')."""
    for error in errors:
        text = _ANSI.sub("", str(error))
        for pattern in _OP_PATTERNS:
            match = pattern.search(text)
            if match:
                op = re.sub(r"^(aten|prim|onnx)(::|\.)", "", match.group(1))
                return op.removesuffix(".default")
    return None


def summary(error: BaseException, limit: int = 300) -> str:
    """The informative line of an exporter error (the dynamo exporter puts it under 'Exception summary')."""
    text = _ANSI.sub("", str(error))
    if "## Exception summary" in text:
        text = text.split("## Exception summary", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else type(error).__name__
    source = _SOURCE_PATTERN.search(text)
    if source and source.group(1) not in line:
        line += f" (at {source.group(1)})"
    return line[:limit]


def calls_of_op(calls: list[ModuleCall], op: str) -> list[ModuleCall]:
    """Recorded calls whose function is the failing op or a variant of it (eigvals ~ linalg_eig)."""
    found = [c for c in calls if c.function == op or c.function.startswith(op) or op.startswith(c.function)]
    # Tensor methods like 'abs' would prefix-match many ops; only accept them on exact match.
    exact = [c for c in found if c.function == op]
    return _unique(exact or [c for c in found if len(c.function) >= 4])


def value_leaking_calls(calls: list[ModuleCall]) -> list[ModuleCall]:
    """Calls a tracer cannot follow: custom autograd Functions and tensor -> Python value methods."""
    return _unique([c for c in calls if c.custom_function or c.function in VALUE_LEAKING_METHODS])


def _unique(calls: list[ModuleCall]) -> list[ModuleCall]:
    return list(dict.fromkeys(calls))


def describe_export_failure(module: nn.Module, example: torch.Tensor, errors: list[BaseException]) -> str:
    """One line naming the failing op and the module that calls it, with the exporters' own words."""
    calls = record_calls(module, example)
    op = failing_op(errors)
    culprits = calls_of_op(calls, op) if op else []
    culprits = culprits or value_leaking_calls(calls)
    reasons = "; ".join(summary(e) for e in errors)
    if op and culprits:
        where = ", ".join(c.describe() for c in culprits[:3])
        return f"cannot export the model to ONNX: op '{op}' ({where}) has no ONNX translation ({reasons})"
    if op:
        return f"cannot export the model to ONNX: op '{op}' has no ONNX translation ({reasons})"
    if culprits:
        where = ", ".join(c.describe() for c in culprits[:3])
        return f"cannot export the model to ONNX: {where} cannot be traced ({reasons})"
    return f"cannot export the model to ONNX: {reasons}"


def describe_wrong_export(module: nn.Module, example: torch.Tensor, problem: str) -> str:
    """One line explaining an export that runs wrong (``problem``), usually Python values frozen by a tracer."""
    culprits = value_leaking_calls(record_calls(module, example))
    cause = (
        "; the model computes values outside the torch graph, which the exporter froze as constants: "
        + ", ".join(c.describe() for c in culprits[:3])
        if culprits
        else "; check the model for Python-side computation or data-dependent control flow"
    )
    return f"the exported ONNX model {problem}{cause}; rewrite that part with torch ops"
