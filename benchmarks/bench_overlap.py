"""A campaign beside a device: one shift vs two overlapping shifts (``fuzz --overlap``), in one run.

A GPU computes a batch while the host waits, then the host mutates and scores the next batch
while the GPU waits; overlap runs one shift's model calls in a background thread while the other
shift's searches work. This machine has no GPU, so the device is simulated: each model computes
:class:`~benchmarks.bench_scale.StandIn`'s near-free probabilities (1,000 classes, host work),
then sleeps, which releases Python's lock as a GPU's work does, until its call has taken
``--device-ms`` per input. The default, 0.0845 ms per input per model, is half the two ResNet-18
calls' 0.169 ms per input measured on an H100 at 224 px (RESULTS.md, bench_scale cuda).

The campaign is DFlare at ``--size`` px on the same ``2 x --batch`` generated seeds both ways,
with the operators a GPU runs on the host (on a GPU the two noise operators and the median blur
run on the device: RESULTS.md, bench_scale). Without overlap: one shift of ``--batch`` seeds.
With it: two shifts of ``--batch`` seeds. Both send ``--batch`` inputs per model call. Each ratio
is the campaign's seconds per query over the two models' seconds per input, timed on calls of
``--batch`` inputs. The runs alternate, ``--repeat`` times; the records of both are checked equal.

    .venv/bin/python -m benchmarks.bench_overlap [--size 224] [--batch 64] [--queries 30]
        [--device-ms 0.0845] [--repeat 3] [--write]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.bench_scale import StandIn, host_operators

BEGIN, END = "<!-- bench_overlap -->", "<!-- /bench_overlap -->"


class SimulatedDevice:
    """A black box whose call takes ``seconds_per_input`` per input, most of it off the host: the
    stand-in's probabilities, then a sleep for the rest of the call's time."""

    def __init__(self, name: str, seconds_per_input: float):
        self.name, self.seconds_per_input = name, seconds_per_input
        self.stand_in = StandIn()

    def predict_proba(self, images: np.ndarray) -> np.ndarray:
        began = time.perf_counter()
        probabilities = self.stand_in.predict_proba(images)
        remaining = self.seconds_per_input * len(images) - (time.perf_counter() - began)
        if remaining > 0:
            time.sleep(remaining)
        return probabilities


def measure(size: int, batch: int, queries: int, device_ms: float, repeat: int) -> dict:
    from mlflow_di.data import ImageSet
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.dflare import DFlare
    from mlflow_di.fuzz.results import comparable_records

    images = np.random.default_rng(0).integers(0, 256, (2 * batch, size, size, 3), dtype=np.uint8)
    seeds = ImageSet(images, np.zeros(len(images), np.int64), f"generated {len(images)}x{size}x{size}")
    original = SimulatedDevice("simulated original", device_ms / 1e3)
    compressed = SimulatedDevice("simulated compressed", device_ms / 1e3)
    strategy = host_operators(DFlare())
    calls = []
    for _ in range(3):
        started = time.perf_counter()
        original.predict_proba(images[:batch]), compressed.predict_proba(images[:batch])
        calls.append((time.perf_counter() - started) / batch)
    models = float(np.median(calls))
    per_query = {False: [], True: []}
    records = {}
    for _ in range(repeat):
        for overlap in (False, True):
            started = time.perf_counter()
            result = run_campaign(original, compressed, seeds, strategy=strategy, max_queries=queries, timeout=1e9,
                                  batch=batch, progress=False, overlap=overlap)
            elapsed = time.perf_counter() - started
            per_query[overlap].append(elapsed / sum(r.queries for r in result.records))
            records[overlap] = comparable_records(result)
    if records[False] != records[True]:
        raise SystemExit("the overlapped campaign's records differ from the plain one's")
    plain, overlapped = (float(np.median(per_query[flag])) for flag in (False, True))
    return {"size": size, "batch": batch, "seeds": len(seeds), "queries": queries, "device_ms_per_input": device_ms,
            "models_ms_per_input": round(models * 1e3, 4),
            "plain_ms_per_query": [round(v * 1e3, 4) for v in per_query[False]],
            "overlap_ms_per_query": [round(v * 1e3, 4) for v in per_query[True]],
            "plain_ratio": round(plain / models, 2), "overlap_ratio": round(overlapped / models, 2),
            "speedup": round(plain / overlapped, 2), "records_equal": True}


def section(rows: list[dict], command: str) -> str:
    lines = [BEGIN, "## Overlap beside a (simulated) device (bench_overlap)", "",
             f"Command: `{command}`  ", f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}; no GPU: "
             "each model's call computes a near-free stand-in's probabilities, then sleeps (releasing Python's lock, "
             "as a GPU's work does) until it has taken the device's time per input. Operators: the four a GPU "
             "leaves on the host. Records checked equal both ways.", "",
             "| size | seeds (calls of) | device ms per input per model | campaign / models' inference, one shift "
             "| with overlap (two shifts) | speed-up |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['seeds']} ({r['batch']}) | {r['device_ms_per_input']} | {r['plain_ratio']} | "
                     f"{r['overlap_ratio']} | {r['speedup']}x |")
    lines += ["", "```", *(json.dumps(r) for r in rows), "```", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--device-ms", default="0.0845",
                        help="comma-separated milliseconds per input per model, one row each")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    for device_ms in (float(v) for v in args.device_ms.split(",")):
        row = measure(args.size, args.batch, args.queries, device_ms, args.repeat)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.write:
        from benchmarks.results import write_section

        command = "python -m benchmarks.bench_overlap " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "write")
        write_section(section(rows, command), BEGIN, END)


if __name__ == "__main__":
    main()
