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

The speedup is judged with its spread, never as a point estimate: a machine's load moves every
timing, and two models timed one after the other see different loads. So both models run in one
more process, their timed runs interleaved (source, export, export, source, ...), and each pair gives
one ratio; the speedup is the median ratio and its 95% interval is the distribution-free interval of
a median (order statistics of the sorted ratios, from the binomial distribution), never narrower
than :data:`RESOLUTION` either side: at least :data:`RUNS` pairs, more while they take under
:data:`PAIRED_SECONDS`. An export is *slower* only when the whole interval lies below 1 and *faster*
only when it lies above; otherwise there is no measurable difference. The load average at the time
is recorded beside the figures.

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
#: Timed pairs go on past RUNS while they have taken less than this many seconds (at most MAX_PAIRS):
#: small models get a narrower interval for next to nothing.
PAIRED_SECONDS = 0.25
MAX_PAIRS = 200
CONFIDENCE = 0.95
#: What paired timing can resolve: two sessions of the *same* model, timed so, differ by up to about 2% on
#: this 2-core machine, idle or beside four busy processes (their memory lands differently), so the
#: interval is never narrower than this either side of the median and smaller differences are not called.
RESOLUTION = 0.05


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
class Speedup(JsonRoundTrip):
    """Source latency over export latency at one batch size: the median of paired ratios and its 95% interval."""

    median: float
    low: float
    high: float
    pairs: int
    batch: int

    @property
    def verdict(self) -> str:
        """``faster``, ``slower`` (the whole interval on that side of 1) or ``no measurable difference``."""
        return "faster" if self.low > 1 else "slower" if self.high < 1 else "no measurable difference"

    def describe(self) -> str:
        return (f"{self.median:.2f}x (95% interval {self.low:.2f}-{self.high:.2f}, {self.pairs} pairs) at batch "
                f"{self.batch}: {self.verdict}")

    @classmethod
    def of(cls, ratios, batch: int, confidence: float = CONFIDENCE) -> "Speedup":
        """From paired ratios: the median and the distribution-free interval of the median (order statistics)."""
        from scipy.stats import binom

        values = sorted(float(r) for r in ratios)
        n = len(values)
        rank = max(1, int(binom.ppf((1 - confidence) / 2, n, 0.5)))  # 1-based rank of the lower end
        middle = (values[(n - 1) // 2] + values[n // 2]) / 2
        low, high = min(values[rank - 1], middle / (1 + RESOLUTION)), max(values[n - rank], middle * (1 + RESOLUTION))
        return cls(middle, low, high, n, batch)


@dataclasses.dataclass
class Comparison(JsonRoundTrip):
    """An export's :class:`Benefit` next to its float source's, and the speedups timed side by side."""

    source: Benefit
    export: Benefit
    paired_b1: Speedup | None = None
    paired_batch: Speedup | None = None
    #: the 1-minute load average when the pairs were timed (before, after)
    load: tuple[float, float] | None = None

    @property
    def speedup(self) -> float:
        """Source latency over export latency at the larger batch (above 1: the export is faster)."""
        if self.paired_batch is not None:
            return self.paired_batch.median
        return self.source.latency_batch_ms / self.export.latency_batch_ms if self.export.latency_batch_ms else 0.0

    @property
    def speedup_b1(self) -> float:
        if self.paired_b1 is not None:
            return self.paired_b1.median
        return self.source.latency_b1_ms / self.export.latency_b1_ms if self.export.latency_b1_ms else 0.0

    def metrics(self) -> dict:
        batch = self.export.batch
        metrics = {"speedup": self.speedup, "speedup_b1": self.speedup_b1,
                   "latency_b1_ms": self.export.latency_b1_ms, f"latency_b{batch}_ms": self.export.latency_batch_ms,
                   "source_latency_b1_ms": self.source.latency_b1_ms,
                   f"source_latency_b{batch}_ms": self.source.latency_batch_ms,
                   "throughput": self.export.throughput, "source_throughput": self.source.throughput,
                   "peak_memory_mib": self.export.peak_memory_mib, "source_peak_memory_mib": self.source.peak_memory_mib}
        for name, paired in (("speedup", self.paired_batch), ("speedup_b1", self.paired_b1)):
            if paired is not None:
                metrics.update({f"{name}_low": paired.low, f"{name}_high": paired.high, f"{name}_pairs": paired.pairs})
        if self.load is not None:
            metrics["benefit_load_1min"] = max(self.load)
        return metrics

    def tags(self, prefix: str = "mlflow_di.benefit.") -> dict[str, str]:
        """The export's figures as the tags of its registry version: the speedup with its interval and
        verdict, latency, size and peak memory."""
        export, interval = self.export, self.paired_batch
        return {f"{prefix}speedup": f"{self.speedup:.3f}",
                **({f"{prefix}speedup_interval": f"{interval.low:.3f}-{interval.high:.3f}",
                    f"{prefix}verdict": interval.verdict} if interval is not None else {}),
                f"{prefix}latency_b1_ms": f"{export.latency_b1_ms:.4f}",
                f"{prefix}latency_b{export.batch}_ms": f"{export.latency_batch_ms:.4f}",
                f"{prefix}size_bytes": str(export.size_bytes),
                f"{prefix}peak_memory_mib": f"{export.peak_memory_mib:.1f}"}

    def rows(self) -> list[dict]:
        return [self.source.row("source (fp32 ONNX)"), self.export.row("export")]

    def speed_line(self) -> str:
        """The speedups with their intervals and the load they were timed under."""
        parts = [paired.describe() for paired in (self.paired_b1, self.paired_batch) if paired is not None]
        load = f"; load average {max(self.load):.1f} on {os.cpu_count()} cores" if self.load is not None else ""
        return "speedup " + ("; ".join(parts) if parts else f"{self.speedup:.2f}x") + load

    def warning(self) -> str:
        """One line when the export is measurably slower than its source at either batch size: the whole 95%
        interval of the speedup below 1 ('' otherwise: a spread that reaches 1 is no measurable difference)."""
        slower = [paired for paired in (self.paired_b1, self.paired_batch) if paired is not None and paired.verdict == "slower"]
        if not slower:
            return ""
        return ("WARNING: the export is slower than its source on this host: speedup "
                + "; ".join(paired.describe() for paired in slower)
                + "; gate --min-speedup 1 keeps such an export from being promoted")


def measure(path, runs: int = RUNS, batch: int = BATCH, threads: int = THREADS, warmup: int = WARMUP,
            timeout: float = 900) -> Benefit:
    """The :class:`Benefit` of the ONNX model at ``path``, measured in a fresh subprocess."""
    if runs < 1 or batch < 1 or threads < 1:
        raise UserError(f"benefit measurement needs runs, batch and threads of at least 1 (got {runs}, {batch}, {threads})")
    return Benefit.from_dict(_run_child([str(path), str(runs), str(batch), str(threads), str(warmup)], path, threads,
                                        timeout))


def compare(source_path, export_path, source: Benefit | None = None, runs: int = RUNS, batch: int = BATCH,
            threads: int = THREADS, warmup: int = WARMUP, timeout: float = 900) -> Comparison:
    """The export's :class:`Comparison` with its source: each measured alone (``source``: its measurement, when
    the caller has it), then both timed side by side for the speedups."""
    options = dict(runs=runs, batch=batch, threads=threads, warmup=warmup, timeout=timeout)
    source = source or measure(source_path, **options)
    export = measure(export_path, **options)
    found = _run_child(["paired", str(source_path), str(export_path), str(runs), str(batch), str(threads), str(warmup)],
                       export_path, threads, timeout)
    return Comparison(source, export, Speedup.of(found["ratios"]["1"], 1), Speedup.of(found["ratios"]["batch"],
                                                                                      found["batch"]),
                      tuple(found["load"]))


def _run_child(arguments: list[str], path, threads: int, timeout: float) -> dict:
    command = [sys.executable, "-m", "mlflow_di.models.benefit", *arguments]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"measuring the latency of {pathlib.Path(path).name} took over {timeout:.0f} s; "
                        "pass --no-benefit to skip it") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"measuring the latency of {pathlib.Path(path).name} failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _session(path: str, threads: int, batch: int):
    """(ONNX Runtime host session, its input's name, element type and shape, the batch it can be timed at)."""
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
    return session, first.name, element, shape, batch


def _child(path: str, runs: int, batch: int, threads: int, warmup: int) -> dict:
    """Runs in the subprocess: time one model, report the process's peak resident memory."""
    import resource
    import time

    import numpy as np

    session, name, element, shape, batch = _session(path, threads, batch)
    rng = np.random.default_rng(0)
    latencies = {}
    for size in dict.fromkeys((1, batch)):
        inputs = {name: rng.random((size, *shape)).astype(element)}
        for _ in range(warmup):
            session.run(None, inputs)
        timed = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, inputs)
            timed.append(time.perf_counter() - start)
        latencies[size] = float(np.median(timed)) * 1000
    peak = _peak_resident_kib() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dataclasses.asdict(Benefit(latencies[1], latencies[batch], batch, throughput=batch / latencies[batch] * 1000,
                                      size_bytes=pathlib.Path(path).stat().st_size, peak_memory_mib=peak / 1024,
                                      runs=runs, threads=threads))


def _paired_child(source: str, export: str, runs: int, batch: int, threads: int, warmup: int) -> dict:
    """Runs in the subprocess: both models timed in turns on the same inputs, one ratio (source / export) per
    pair, alternating which goes first; the load average before and after."""
    import time

    import numpy as np

    models = [_session(source, threads, batch), _session(export, threads, batch)]
    batch = min(model[4] for model in models)
    load = [os.getloadavg()[0]]
    ratios = {}
    for key, size in (("1", 1), ("batch", batch)):
        inputs = np.random.default_rng(0).random((size, *models[0][3]))
        feeds = [{name: inputs.astype(element)} for _, name, element, _, _ in models]
        for (session, *_), feed in zip(models, feeds):
            for _ in range(warmup):
                session.run(None, feed)
        found, started = [], time.perf_counter()
        while len(found) < runs or (time.perf_counter() - started < PAIRED_SECONDS and len(found) < MAX_PAIRS):
            seconds = [0.0, 0.0]
            for number in ((0, 1) if len(found) % 2 == 0 else (1, 0)):
                session, feed = models[number][0], feeds[number]
                begin = time.perf_counter()
                session.run(None, feed)
                seconds[number] = time.perf_counter() - begin
            found.append(seconds[0] / max(seconds[1], 1e-12))
        ratios[key] = found
    load.append(os.getloadavg()[0])
    return {"ratios": ratios, "batch": batch, "load": load}


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
    if sys.argv[1] == "paired":
        source_arg, export_arg, *numbers = sys.argv[2:8]
        print(json.dumps(_paired_child(source_arg, export_arg, *map(int, numbers))))
    else:
        path_arg, *numbers = sys.argv[1:6]
        print(json.dumps(_child(path_arg, *map(int, numbers))))
