"""What an export buys: latency, throughput, file size and peak memory, measured on this host's runtime.

A smaller file is not a faster model: on a CPU whose int8 kernels are slow (or for a model so small
that the added Quantize/DequantizeLinear nodes dominate) an int8 export can run several times slower
than its float source. Each model is measured in a fresh subprocess (``python -m
mlflow_di.models.benefit``) so that its peak memory is its own (the peak resident memory,
``VmHWM``, of a process that imports ONNX Runtime and NumPy, loads this one model and runs it:
the same baseline for every model, so differences are the models') and the parent's state does not
disturb its timings:
ONNX Runtime's default (host) session with a fixed number of intra-op threads, ``warmup`` runs,
then the median of ``runs`` timed runs at batch 1 and at ``batch`` images of random inputs.

Latency is a figure to compare models measured side by side on one machine, never a budget.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip

RUNS = 20
WARMUP = 5
BATCH = 64
THREADS = 1


@dataclasses.dataclass
class Benefit(JsonRoundTrip):
    """One ONNX model's measured cost on this host (milliseconds, images per second, bytes, MiB)."""

    latency_b1_ms: float
    latency_batch_ms: float
    batch: int
    throughput: float  # images per second at ``batch``
    size_bytes: int
    peak_memory_mib: float
    runs: int
    threads: int

    def row(self, label: str) -> dict:
        return {"model": label, "b1 ms": round(self.latency_b1_ms, 3), f"b{self.batch} ms": round(self.latency_batch_ms, 3),
                "images/s": round(self.throughput, 1), "KiB": round(self.size_bytes / 1024, 1),
                "peak MiB": round(self.peak_memory_mib, 1)}


@dataclasses.dataclass
class Comparison(JsonRoundTrip):
    """An export's :class:`Benefit` next to its float source's, measured in one command."""

    source: Benefit
    export: Benefit

    @property
    def speedup(self) -> float:
        """Source latency over export latency at the larger batch (above 1: the export is faster)."""
        return self.source.latency_batch_ms / self.export.latency_batch_ms if self.export.latency_batch_ms else 0.0

    @property
    def speedup_b1(self) -> float:
        return self.source.latency_b1_ms / self.export.latency_b1_ms if self.export.latency_b1_ms else 0.0

    def metrics(self) -> dict:
        batch = self.export.batch
        return {"speedup": self.speedup, "speedup_b1": self.speedup_b1,
                "latency_b1_ms": self.export.latency_b1_ms, f"latency_b{batch}_ms": self.export.latency_batch_ms,
                "source_latency_b1_ms": self.source.latency_b1_ms,
                f"source_latency_b{batch}_ms": self.source.latency_batch_ms,
                "throughput": self.export.throughput, "source_throughput": self.source.throughput,
                "peak_memory_mib": self.export.peak_memory_mib, "source_peak_memory_mib": self.source.peak_memory_mib}

    def rows(self) -> list[dict]:
        return [self.source.row("source (fp32 ONNX)"), self.export.row("export")]

    def warning(self) -> str:
        """One line when the export is slower than its source at either batch size ('' otherwise)."""
        if self.speedup >= 1 and self.speedup_b1 >= 1:
            return ""
        return (f"WARNING: the export is slower than its source on this host: {self.export.latency_b1_ms:.3f} vs "
                f"{self.source.latency_b1_ms:.3f} ms at batch 1, {self.export.latency_batch_ms:.2f} vs "
                f"{self.source.latency_batch_ms:.2f} ms at batch {self.export.batch} (speedup {self.speedup:.2f}x); "
                "gate --min-speedup 1 keeps such an export from being promoted")


def measure(path, runs: int = RUNS, batch: int = BATCH, threads: int = THREADS, warmup: int = WARMUP,
            timeout: float = 900) -> Benefit:
    """The :class:`Benefit` of the ONNX model at ``path``, measured in a fresh subprocess."""
    if runs < 1 or batch < 1 or threads < 1:
        raise UserError(f"benefit measurement needs runs, batch and threads of at least 1 (got {runs}, {batch}, {threads})")
    command = [sys.executable, "-m", "mlflow_di.models.benefit", str(path), str(runs), str(batch), str(threads),
               str(warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"measuring the latency of {pathlib.Path(path).name} took over {timeout:.0f} s; "
                        "pass --no-benefit to skip it") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"measuring the latency of {pathlib.Path(path).name} failed: {last}")
    return Benefit.from_dict(json.loads(done.stdout.strip().splitlines()[-1]))


def compare(source_path, export_path, **options) -> Comparison:
    return Comparison(measure(source_path, **options), measure(export_path, **options))


def _child(path: str, runs: int, batch: int, threads: int, warmup: int) -> dict:
    """Runs in the subprocess: time one model, report the process's peak resident memory."""
    import resource
    import time

    import numpy as np
    import onnxruntime as ort

    from mlflow_di.models.execution import session_options

    session = ort.InferenceSession(path, session_options("host", threads), providers=["CPUExecutionProvider"])
    first = session.get_inputs()[0]
    shape = [d if isinstance(d, int) else 1 for d in first.shape[1:]]
    if isinstance(first.shape[0], int):  # a model exported with a fixed batch size is timed at that size
        if first.shape[0] != 1:
            raise SystemExit(f"the model has a fixed batch size of {first.shape[0]}, so its latency at batch 1 "
                             "cannot be measured; export it with a dynamic batch axis")
        batch = 1
    element = {"tensor(float)": np.float32, "tensor(uint8)": np.uint8}.get(first.type, np.float32)
    rng = np.random.default_rng(0)
    latencies = {}
    for size in dict.fromkeys((1, batch)):
        inputs = {first.name: rng.random((size, *shape)).astype(element)}
        for _ in range(warmup):
            session.run(None, inputs)
        timed = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, inputs)
            timed.append(time.perf_counter() - start)
        latencies[size] = float(np.median(timed)) * 1000
    peak = _peak_resident_kib() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dataclasses.asdict(Benefit(latencies[1], latencies[batch], batch, batch / latencies[batch] * 1000,
                                      pathlib.Path(path).stat().st_size, peak / 1024, runs, threads))


def _peak_resident_kib() -> int:
    """This process's peak resident memory (``VmHWM``, KiB; 0 where /proc cannot tell). Not ``ru_maxrss``:
    Linux carries that over ``exec`` from the parent, so a child of a large process would report the parent's."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


if __name__ == "__main__":
    path_arg, runs_arg, batch_arg, threads_arg, warmup_arg = sys.argv[1:6]
    print(json.dumps(_child(path_arg, int(runs_arg), int(batch_arg), int(threads_arg), int(warmup_arg))))
