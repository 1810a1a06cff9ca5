"""Lockstep vs one seed at a time, for a PyTorch original against each compressed backend.

The DFlare LeNet-5 ('same' padding, imported to PyTorch) against: its TFLite 8-bit version,
its ONNX Runtime int8-static export, and its PyTorch prune-l1 (0.3) copy. The same 50 MNIST
seeds, max 3,000 queries per seed; batch 64 (lockstep) vs batch 1; ratio within one run.
Writes its section of benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks.bench_lockstep_backends [--shared ../shared]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.results import write_section
from mlflow_di.compression import compress, prune_l1
from mlflow_di.data import load_images
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.models.classifier import OnnxClassifier, TorchClassifier

BEGIN, END = "<!-- bench_lockstep_backends -->", "<!-- /bench_lockstep_backends -->"
SEEDS, MAX_QUERIES = 50, 3000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DI_THREADS", "1")
    shared = pathlib.Path(args.shared)
    mnist = f"mnist:{shared / 'data' / 'mnist'}"
    source = mlflow_di.load_torch_model(f"keras:lenet5-same:{shared / 'models' / 'dflare' / 'lenet5.h5'}")
    seeds = load_images(f"{mnist}[0:{SEEDS}]")
    with tempfile.TemporaryDirectory() as folder:
        export = compress(source.module, source.preprocessing, "int8-static", folder,
                          calib_inputs=load_images(f"{mnist}[0:500]").images)
        pruned, _ = prune_l1(source.module, 0.3)
        backends = {
            "TFLite (lenet5-quan.lite)": mlflow_di.load_classifier(str(shared / "models" / "dflare" / "lenet5-quan.lite")),
            "ONNX Runtime (int8-static export)": OnnxClassifier(export.path),
            "PyTorch (prune-l1 0.3 copy)": TorchClassifier(pruned, source.preprocessing, "pruned"),
        }
        rows = [measure(name, source.classifier(), compressed, seeds) for name, compressed in backends.items()]
    lines = [BEGIN, "## Lockstep vs one seed at a time, per compressed backend", "",
             "Command: `.venv/bin/python -m benchmarks.bench_lockstep_backends`  ",
             f"Original: DFlare LeNet-5 imported to PyTorch; seeds MNIST [0:{SEEDS}], DFlare, max {MAX_QUERIES:,} "
             "queries per seed, 1 thread per model. Same run for both modes.", "",
             "| compressed backend | lockstep (batch 64) q/s | one seed at a time q/s | speed-up | same per-seed queries |",
             "|---|---:|---:|---:|---|"]
    lines += [f"| {r[0]} | {r[1]:,.0f} | {r[2]:,.0f} | {r[3]:.2f}x | {'yes' if r[4] else 'NO'} |" for r in rows]
    section = "\n".join(lines + [END])
    print(section)
    write_section(section, BEGIN, END)


def measure(name, original, compressed, seeds):
    results = {}
    for batch in (64, 1):
        start = time.perf_counter()
        result = run_campaign(original, compressed, seeds, batch=batch, max_queries=MAX_QUERIES, progress=False)
        results[batch] = (time.perf_counter() - start, result.summary.total_queries, [r.queries for r in result.records])
    (fast, queries, per_seed), (slow, queries_alone, per_seed_alone) = results[64], results[1]
    return name, queries / fast, queries_alone / slow, slow / fast, per_seed == per_seed_alone


if __name__ == "__main__":
    main()
