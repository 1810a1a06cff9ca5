"""What stoppable model calls cost: a DFlare campaign with every ONNX Runtime call made through
:func:`mlflow_di.models.stoppable.run` (its own RunOptions, registered with the watchdog that a signal or
a limit wakes) against the same campaign calling ``session.run`` directly, in one run.

The original is the zoo's digits CNN (PyTorch), the compressed model its fp32 ONNX export, so the two
never disagree and every seed spends its whole query budget: the campaign is all model calls and
search, the worst case for a per-call cost. Runs alternate, ``--repeat`` times, at lockstep batch 1
(one call per query: the most calls) and 64 (the default); the records of both ways are checked equal.

    .venv/bin/python -m benchmarks.bench_stoppable [--seeds 64] [--queries 200] [--repeat 3] [--write]
"""
from __future__ import annotations

import argparse
import platform
import tempfile
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)

BEGIN, END = "<!-- bench_stoppable -->", "<!-- /bench_stoppable -->"


def measure(seeds: int, queries: int, repeat: int) -> dict:
    import torch

    from mlflow_di.data import load_images
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.results import comparable_records
    from mlflow_di.models import zoo
    from mlflow_di.models.classifier import OnnxClassifier, TorchClassifier

    preprocessing = zoo.architecture("digits-cnn").preprocessing
    module = zoo.build("digits-cnn", seed=0).eval()
    original = TorchClassifier(module, preprocessing, name="digits-cnn")
    folder = tempfile.mkdtemp(prefix="bench-stoppable-")
    torch.onnx.export(module, torch.rand(2, 1, 8, 8), f"{folder}/m.onnx", input_names=["x"],
                      dynamic_axes={"x": {0: "n"}}, dynamo=False)
    compressed = OnnxClassifier(f"{folder}/m.onnx", preprocessing, name="fp32 ONNX export")
    stoppable_forward = OnnxClassifier._forward

    def direct_forward(self, batch):
        return self.session.run(None, {self.input_name: batch})[0]

    data = load_images(f"digits[0:{seeds}]")
    rows = []
    for batch in (1, 64):
        seconds = {"direct": [], "stoppable": []}
        records = {}
        for _ in range(repeat):
            for way, forward in (("direct", direct_forward), ("stoppable", stoppable_forward)):
                OnnxClassifier._forward = forward
                try:
                    started = time.perf_counter()
                    result = run_campaign(original, compressed, data, strategy="dflare", max_queries=queries,
                                          timeout=1e9, batch=batch, progress=False, seed=0)
                    seconds[way].append(time.perf_counter() - started)
                finally:
                    OnnxClassifier._forward = stoppable_forward
                records[way] = comparable_records(result)
        if records["direct"] != records["stoppable"]:
            raise AssertionError(f"batch {batch}: the campaign's records differ between the two ways")
        total = sum(r.queries for r in result.records)
        ratios = [s / d for s, d in zip(seconds["stoppable"], seconds["direct"])]
        rows.append({"batch": batch, "queries": total, "direct": float(np.median(seconds["direct"])),
                     "stoppable": float(np.median(seconds["stoppable"])), "ratio": float(np.median(ratios)),
                     "ratios": ratios})
    return {"rows": rows, "seeds": seeds, "queries": queries, "repeat": repeat}


def render(result: dict) -> str:
    import os

    lines = [BEGIN, "## Stoppable model calls (bench_stoppable)", "",
             f"`.venv/bin/python -m benchmarks.bench_stoppable --seeds {result['seeds']} --queries {result['queries']} "
             f"--repeat {result['repeat']} --write`: DFlare, the zoo's digits CNN (PyTorch) against its fp32 ONNX "
             f"export (no trigger, so every seed spends its {result['queries']} queries), every ONNX Runtime call "
             "through `stoppable.run` or straight to `session.run`, alternating; records equal both ways (asserted). "
             f"Machine: {os.cpu_count()} cores ({platform.machine()}), load average {os.getloadavg()[0]:.2f} at the end.",
             "", "| lockstep batch | queries | direct s | stoppable s | stoppable / direct (median of runs) | each run |",
             "|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['batch']} | {row['queries']:,} | {row['direct']:.2f} | {row['stoppable']:.2f} | "
                     f"{row['ratio']:.3f} | {', '.join(f'{r:.3f}' for r in row['ratios'])} |")
    lines += ["", "A call made stoppable creates its own RunOptions and registers it with the watchdog thread (which "
              "sleeps in `select` on the signal wake-up pipe, a tick every 0.25 s); nothing else changes in the call.",
              END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=64)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    from benchmarks.results import publish

    publish(render(measure(args.seeds, args.queries, args.repeat)), BEGIN, END, write=args.write)


if __name__ == "__main__":
    main()
