"""Where a compressed model's figures were measured: the runtime, its settings and precision, and the CPU.

An int8 export's answers depend on the CPU's int8 instructions (see
:mod:`mlflow_di.compression.recipes`), so every figure on a compressed model carries an
:class:`ExecutionContext`. Two semantics run the same ONNX file:

- ``host``: ONNX Runtime's default session, every graph optimization on: QDQ pairs fused into
  int8 kernels chosen for this CPU. What a service running the file here would answer.
- ``reference``: graph optimizations off: each DequantizeLinear / QuantizeLinear runs as written
  and the operators between them in float. The export's own arithmetic, the same on every CPU
  (up to float rounding), and what a CPU whose int8 kernels do not saturate answers.
"""
from __future__ import annotations

import dataclasses
import os
import platform

from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip

SEMANTICS = ("host", "reference")
#: /proc/cpuinfo flags that change int8 arithmetic or its speed (x86 names; ARM's dot product is asimddp)
INT8_FEATURES = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")


def check_semantics(semantics: str) -> str:
    if semantics not in SEMANTICS:
        raise UserError(f"unknown semantics '{semantics}'; known: {', '.join(SEMANTICS)} (host: this CPU's ONNX "
                        "Runtime kernels; reference: the QDQ graph as written, the same on every CPU)")
    return semantics


def session_options(semantics: str = "host", threads: int | None = None):
    """``onnxruntime.SessionOptions`` for ``semantics`` with ``threads`` intra-op threads (None: ORT's default)."""
    import onnxruntime as ort

    # ONNX Runtime's own error lines (in colour, on stderr) would come before the command's one line, which
    # carries the same message: only its fatal ones are shown
    ort.set_default_logger_severity(4)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    # ONNX Runtime's intra-op threads spin while they wait, as OpenMP's do (see mlflow_di/__init__.py)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        options.intra_op_num_threads = int(threads)
    if check_semantics(semantics) == "reference":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return options


def _cpuinfo(keys: tuple[str, ...]) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line whose key is one of ``keys`` (None where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() in keys and value.strip():
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` names them (empty where that cannot be read)."""
    return set((_cpuinfo(("flags", "Features")) or "").split())


def default_threads() -> int:
    """Intra-op threads of every model this process runs: ``MLFLOW_DI_THREADS``, else one per core."""
    return int(os.environ.get("MLFLOW_DI_THREADS", os.cpu_count() or 1))


#: NumPy's CPUID names for the /proc/cpuinfo flags both know
_NUMPY_NAMES = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512bw": "AVX512BW", "avx512_vnni": "AVX512VNNI",
                "asimddp": "ASIMDDP", "i8mm": "I8MM"}


def int8_features() -> tuple[str, ...]:
    """The :data:`INT8_FEATURES` this process's CPU offers, as ONNX Runtime sees them.

    NumPy asks the CPU itself (CPUID), as ONNX Runtime does; ``/proc/cpuinfo`` describes the machine,
    which is not always the CPU a process runs on (an emulator, a masked container). Its flags are
    used only for what NumPy does not report (AVX-VNNI, AMX), and only when both agree on what both report.
    """
    flags = cpu_flags()
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as seen
    except ImportError:  # pragma: no cover - an older NumPy layout
        seen = None
    if not seen:
        return tuple(name for name in INT8_FEATURES if name in flags)
    known = {flag: bool(seen.get(name)) for flag, name in _NUMPY_NAMES.items() if name in seen}
    trusted = all((flag in flags) == present for flag, present in known.items())
    return tuple(name for name in INT8_FEATURES if known.get(name, trusted and name in flags))


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    return _cpuinfo(("model name", "Model", "CPU part")) or platform.processor() or platform.machine() or "unknown"


@dataclasses.dataclass(frozen=True)
class ExecutionContext(JsonRoundTrip):
    """The runtime, precision and CPU a figure was measured with.

    ``runtime``: the declared runtime's name (:mod:`mlflow_di.models.runtimes`), ``version`` its version;
    ``provider``: the device or execution provider it ran on; ``precision``: what it actually computed a
    float graph in (``f32``, ``bf16``; OpenVINO picks bf16 by itself on CPUs that have it), with
    ``precision_asked`` what the user pinned (``default``: the runtime's own choice on this host).
    """

    version: str
    provider: str
    graph_optimization: str  # "all" (host semantics) or "disabled" (reference semantics)
    threads: int
    machine: str  # x86_64, aarch64, ...
    cpu: str
    int8_features: tuple[str, ...]
    runtime: str = "onnxruntime"
    precision: str = "f32"
    precision_asked: str = "default"

    JSON_OPTIONAL = {"runtime": "onnxruntime", "precision": "f32", "precision_asked": "default"}

    @property
    def x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64", "i686", "x86")

    @property
    def int8_dot_product(self) -> bool:
        """Whether the CPU accumulates 8-bit products in int32 directly (VNNI, AMX, ARM dot product)."""
        return bool({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"} & set(self.int8_features))

    @property
    def u8s8_saturates(self) -> bool:
        """ONNX Runtime's u8s8 kernels saturate here: an x86 CPU with AVX2 but no VNNI or AMX."""
        return self.runtime == "onnxruntime" and self.x86 and "avx2" in self.int8_features and not self.int8_dot_product

    @property
    def precision_phrase(self) -> str:
        """``f32``, or ``bf16 (the host default)``, or ``f32 (bf16 asked; this CPU has no bf16)``."""
        if self.precision_asked == "default":
            return self.precision + (" (the host default)" if self.runtime != "onnxruntime" else "")
        if self.precision_asked != self.precision:
            return f"{self.precision} ({self.precision_asked} asked; this CPU computes {self.precision})"
        return f"{self.precision} (pinned)"

    def describe(self) -> str:
        """One line, e.g. ``onnxruntime 1.32.0 CPUExecutionProvider (all optimizations, f32, 2 threads) on AMD EPYC,
        x86_64 with avx2, avx512_vnni (int8 dot product: yes)``."""
        features = ", ".join(self.int8_features) or "no int8 extensions"
        return (f"{self.runtime} {self.version} {self.provider} ({self.graph_optimization} optimizations, "
                f"{self.precision_phrase}, {self.threads} thread{'s' if self.threads != 1 else ''}) on {self.cpu}, "
                f"{self.machine} with {features} (int8 dot product: {'yes' if self.int8_dot_product else 'no'}"
                + ("; u8s8 kernels saturate" if self.u8s8_saturates else "") + ")")

    def tags(self, prefix: str = "mlflow_di.runtime.") -> dict[str, str]:
        """The context as run or version tags (``{prefix}{runtime}`` holds the version, so ONNX Runtime's
        ``mlflow_di.runtime.onnxruntime`` reads as it always did)."""
        return {f"{prefix}name": self.runtime, f"{prefix}{self.runtime}": self.version,
                f"{prefix}provider": self.provider, f"{prefix}graph_optimization": self.graph_optimization,
                f"{prefix}precision": self.precision, f"{prefix}precision_asked": self.precision_asked,
                f"{prefix}threads": str(self.threads), f"{prefix}cpu": self.cpu, f"{prefix}machine": self.machine,
                f"{prefix}int8_features": ",".join(self.int8_features) or "none",
                f"{prefix}int8_dot_product": str(self.int8_dot_product).lower(),
                f"{prefix}u8s8_saturates": str(self.u8s8_saturates).lower()}


def execution_context(session=None, semantics: str = "host", threads: int | None = None) -> ExecutionContext:
    """The context of ``session`` (an ``onnxruntime.InferenceSession``; None: a CPU session) run with ``semantics``."""
    import onnxruntime as ort

    provider = session.get_providers()[0] if session is not None else "CPUExecutionProvider"
    return host_context("onnxruntime", ort.__version__, provider, "disabled" if semantics == "reference" else "all",
                        threads)


def host_context(runtime: str, version: str, provider: str, graph_optimization: str = "all",
                 threads: int | None = None, precision: str = "f32", asked: str = "default") -> ExecutionContext:
    """An :class:`ExecutionContext` on this process's CPU (any runtime's: the CPU facts are read once here)."""
    if threads is None:
        threads = default_threads()
    return ExecutionContext(version, provider, graph_optimization, threads=int(threads),
                            machine=platform.machine() or "unknown", cpu=cpu_model(), int8_features=int8_features(),
                            runtime=runtime, precision=precision, precision_asked=asked)


def context_tags(models) -> dict[str, str]:
    """The ``mlflow_di.runtime.*`` tags of the first of ``models`` that runs on a declared runtime (one with an
    ``execution_context``); {} when none does. The exports of one command share the runtime and the CPU."""
    for model in models:
        found = getattr(model, "execution_context", None)
        if found is not None:
            return found.tags()
    return {}
