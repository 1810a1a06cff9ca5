"""The runtimes an export can be judged on, one declaration each: what each opens, which precisions it
offers, whether it is installed, and how it runs a model file.

A verdict on a compressed model is only as true as the runtime its answers came from: the same ONNX file
answers differently on ONNX Runtime and on OpenVINO (whose CPU plugin computes in bfloat16 by default on
CPUs that have it). Every command that runs an export takes ``--runtime NAME[:PRECISION]``; the runtime
opens the file as a :class:`~mlflow_di.models.classifier.Classifier` whose ``execution_context`` names the
runtime, its version, the device and the precision it actually computed in.

:data:`RUNTIMES` maps a name to a :class:`Runtime`; ``onnxruntime`` (ONNX Runtime's CPU or CUDA provider,
the default) and ``openvino`` (OpenVINO's CPU plugin, the ``openvino`` extra) ship.
:func:`register_runtime` adds another (TensorRT, ExecuTorch, an ORT execution provider): one module and
its declaration, no edit in ``commands/``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Callable

from mlflow_di.errors import UserError
from mlflow_di.registry import Registry

if TYPE_CHECKING:
    from mlflow_di.models.classifier import Classifier
    from mlflow_di.models.preprocessing import Preprocessing

__all__ = ["DEFAULT", "RUNTIMES", "Runtime", "RuntimeChoice", "register_runtime", "unregister_runtime"]

#: the runtime every command uses unless told otherwise (what ``mlflow.onnx`` serves with)
DEFAULT = "onnxruntime"
#: the precision a runtime picks itself on this host (OpenVINO's ``INFERENCE_PRECISION_HINT`` default)
HOST_DEFAULT = "default"


@dataclasses.dataclass(frozen=True)
class Runtime:
    """One runtime: what it opens and how.

    ``opens``: the model formats (:data:`mlflow_di.models.formats.FORMATS` names) whose files it runs.
    ``precisions``: what ``NAME:PRECISION`` may pin besides ``default`` (the runtime's own choice on this
    host, recorded as what it actually used). ``devices``: the ``--device`` values it serves.
    ``module``: the Python module it needs (None: always there); ``extra``: the mlflow-di extra that
    installs it, named in the one-line refusal when it is missing.
    ``open(path, preprocessing, name, device, precision)`` -> a Classifier with ``execution_context``.
    """

    name: str
    title: str
    opens: tuple[str, ...]
    open: Callable[..., Classifier]
    precisions: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    module: str | None = None
    extra: str = ""

    def missing(self) -> str:
        """Why this runtime cannot run here ("" when it can): its module is not installed."""
        if self.module is None or importlib.util.find_spec(self.module) is not None:
            return ""
        install = f"pip install 'mlflow-di[{self.extra}]'" if self.extra else f"pip install {self.module}"
        return f"the runtime '{self.name}' ({self.title}) is not installed: {install}"


@dataclasses.dataclass(frozen=True)
class RuntimeChoice:
    """A runtime as a user names it: ``openvino`` or ``openvino:f32`` (``precision`` ``default``: the runtime's
    own choice on this host)."""

    name: str = DEFAULT
    precision: str = HOST_DEFAULT

    @classmethod
    def parse(cls, text: str | RuntimeChoice | None) -> RuntimeChoice:
        """``NAME[:PRECISION]`` checked against the declarations (a one-line UserError naming what exists)."""
        if isinstance(text, RuntimeChoice):
            return text
        if text is None or not str(text).strip():
            return cls()
        name, _, precision = str(text).strip().partition(":")
        runtime = RUNTIMES.require(name, "known runtimes")
        precision = precision or HOST_DEFAULT
        if precision != HOST_DEFAULT and precision not in runtime.precisions:
            offered = ", ".join((HOST_DEFAULT, *runtime.precisions))
            raise UserError(f"the runtime '{name}' offers the precisions {offered}, not '{precision}'")
        return cls(name, precision)

    @property
    def runtime(self) -> Runtime:
        return RUNTIMES[self.name]

    @property
    def label(self) -> str:
        """How it is written: ``openvino`` or ``openvino:f32``."""
        return self.name if self.precision == HOST_DEFAULT else f"{self.name}:{self.precision}"

    @property
    def slug(self) -> str:
        """The label in metric and tag names: ``openvino`` or ``openvino-f32``."""
        return self.label.replace(":", "-")

    def require_installed(self) -> RuntimeChoice:
        """Itself, or a one-line UserError naming the extra that installs it."""
        why = self.runtime.missing()
        if why:
            raise UserError(why)
        return self

    def open(self, path, preprocessing: Preprocessing | None, name: str | None, device=None,
             model_format: str = "onnx") -> Classifier:
        """``path`` (a file of ``model_format``) as this runtime runs it."""
        runtime = self.require_installed().runtime
        if model_format not in runtime.opens:
            raise UserError(f"the runtime '{self.name}' opens {', '.join(runtime.opens)} models, not {model_format} "
                            f"ones ('{name or path}'); run that model without --runtime")
        if device not in (None, "auto") and str(device).split(":")[0] not in runtime.devices:
            raise UserError(f"the runtime '{self.name}' runs on {', '.join(runtime.devices)}, not on '{device}'")
        return runtime.open(path, preprocessing, name, device, self.precision)


def parse_runtimes(text: str | None) -> tuple[RuntimeChoice, ...]:
    """A comma-separated list of ``NAME[:PRECISION]`` (each once); empty: the default runtime alone."""
    names = [part.strip() for part in (text or "").split(",") if part.strip()]
    choices = tuple(RuntimeChoice.parse(name) for name in names) or (RuntimeChoice(),)
    labels = [choice.label for choice in choices]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise UserError(f"--runtime names {twice[0]} twice; name each runtime once")
    return choices


def named_runtime(text: str | None) -> RuntimeChoice | None:
    """``gate --runtime``'s value: a declared runtime, installed or not (None when blank: an MLproject's unset
    parameter)."""
    return RuntimeChoice.parse(text) if text and str(text).strip() else None


def installed_runtime(text: str | None) -> RuntimeChoice | None:
    """``--runtime``'s value: declared, with a precision it offers, and installed here (None when blank)."""
    choice = named_runtime(text)
    return None if choice is None else choice.require_installed()


def installed_runtimes(text: str | None) -> tuple[RuntimeChoice, ...] | None:
    """``--runtime``'s list (compress): each declared, installed and named once (None when blank)."""
    if not text or not str(text).strip():
        return None
    return tuple(choice.require_installed() for choice in parse_runtimes(text))


def runtime_help() -> str:
    """The declared runtimes for an option's help, e.g. ``onnxruntime (default), openvino[:f32|bf16]``."""
    return ", ".join(name + (f"[:{'|'.join(runtime.precisions)}]" if runtime.precisions else "")
                     + (" (default)" if name == DEFAULT else "") for name, runtime in RUNTIMES.items())


def _open_onnxruntime(path, preprocessing, name, device, precision):
    from mlflow_di.models.classifier import OnnxClassifier

    return OnnxClassifier(path, preprocessing, name, device=device)


def _open_openvino(path, preprocessing, name, device, precision):
    from mlflow_di.models.openvino_runtime import OpenVinoClassifier

    return OpenVinoClassifier(path, preprocessing, name, precision=precision)


#: Every runtime by name, the default first (a live registry).
RUNTIMES = Registry("runtime", Runtime, builtins=(
    Runtime("onnxruntime", "ONNX Runtime", opens=("onnx",), open=_open_onnxruntime, devices=("cpu", "cuda")),
    Runtime("openvino", "OpenVINO CPU plugin", opens=("onnx",), open=_open_openvino, precisions=("f32", "bf16"),
            module="openvino", extra="openvino"),
))


def register_runtime(runtime: Runtime) -> Runtime:
    """Add a runtime: ``--runtime NAME`` then opens the formats it declares in every command."""
    from mlflow_di.models.formats import FORMATS

    unknown = [name for name in runtime.opens if name not in FORMATS]
    if unknown:
        raise UserError(f"runtime {runtime.name} opens the unknown model format '{unknown[0]}'; known: "
                        f"{', '.join(FORMATS)}")
    return RUNTIMES.register(runtime)


def unregister_runtime(name: str) -> None:
    """Forget a registered runtime (tests add toy ones); the built-ins stay."""
    RUNTIMES.unregister(name)
