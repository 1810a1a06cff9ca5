"""Benchmark the compression methods on DeepImportance's LeNet-5 and the 10k MNIST test set.

Measures, in one run: the 10k-image accuracy of each method's ONNX file (run by ONNX Runtime
through ``OnnxClassifier``, which reads the preprocessing from the file) against the PyTorch
original; file sizes; compression time per method (median of ``--repeats`` runs after a warm-up
export, also as a ratio to the fp32 export); and pruning-amount sweeps (in PyTorch, whose fp32
export matches to ~1e-5) to find how far each pruning method can go within 1 accuracy point.
int8-static is calibrated on the first ``--calib`` MNIST test images (the training split is
not available), which are also part of the 10k evaluation set. Writes a markdown section into
benchmarks/RESULTS.md between ``<!-- bench_compress -->`` markers (only that section is replaced).

    .venv/bin/python -m benchmarks.bench_compress [--shared ../shared] [--repeats 3] [--calib 500]
"""
from __future__ import annotations

import argparse
import gzip
import os
import pathlib
import statistics
import tempfile
import time

from benchmarks.results import write_section
import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import torch

from mlflow_di.compression import METHODS, compress, prune_l1, prune_structured
from mlflow_di.data import load_images

REPO = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_compress -->", "<!-- /bench_compress -->"
PAPER_ACCURACY = 0.9879  # DeepImportance LeNet-5 on the 10k test set (shared/README.md)
MAX_DROP = 0.01  # every method must stay within 1 accuracy point
AMOUNT = 0.3
STRUCTURED_SWEEP = (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
L1_SWEEP = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_shared = os.environ.get("MLFLOW_DI_SHARED", str(REPO.parent / "shared"))
    parser.add_argument("--shared", type=pathlib.Path, default=pathlib.Path(default_shared))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    parser.add_argument("--calib", type=int, default=500, help="calibration images for int8-static")
    parser.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime threads")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not touch RESULTS.md")
    return parser.parse_args()


def accuracy(classifier, images, labels) -> tuple[float, float]:
    """(top-1 accuracy, seconds) of a Classifier on raw images."""
    start = time.perf_counter()
    predicted = classifier.predict(images, batch_size=1000)
    return float((predicted == labels).mean()), time.perf_counter() - start


def module_accuracy(module, inputs: torch.Tensor, labels: np.ndarray) -> float:
    with torch.no_grad():
        return float((module(inputs).argmax(1).numpy() == labels).mean())


def time_method(model, method, out_dir, calib, repeats):
    """The last CompressionResult and the median seconds over ``repeats`` runs."""
    seconds, result = [], None
    for _ in range(repeats):
        result = compress(model.module, model.preprocessing, method, out_dir, calib_inputs=calib, amount=AMOUNT)
        seconds.append(result.seconds)
    return result, statistics.median(seconds)


def largest_amount_within(sweep: dict[float, float], reference: float) -> float | None:
    """The largest swept amount whose accuracy and every smaller amount's stay within MAX_DROP."""
    best = None
    for amount in sorted(sweep):
        if reference - sweep[amount] > MAX_DROP:
            break
        best = amount
    return best


def main():
    args = parse_args()
    os.environ["MLFLOW_DI_THREADS"] = str(args.threads)  # OnnxClassifier's ONNX Runtime threads
    torch.set_num_threads(args.threads)
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.models.keras_import import import_keras

    weights = args.shared / "models" / "deepimportance" / "LeNet5.h5"
    model = import_keras("lenet5", weights)
    data = load_images(f"mnist:{args.shared / 'data' / 'mnist'}")
    calib = data.images[:args.calib]
    reference, reference_seconds = accuracy(model.classifier(), data.images, data.labels)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compress-") as work:
        compress(model.module, model.preprocessing, "fp32", pathlib.Path(work) / "warmup")  # imports, caches
        for method in METHODS:
            result, seconds = time_method(model, method, pathlib.Path(work) / method, calib, args.repeats)
            acc, eval_seconds = accuracy(OnnxClassifier(result.path), data.images, data.labels)
            gzip_bytes = len(gzip.compress(pathlib.Path(result.path).read_bytes()))
            rows.append((method, result, seconds, acc, eval_seconds, gzip_bytes))
            print(f"{method}: accuracy {acc:.4f}, {seconds:.2f} s, {result.size_bytes} bytes", flush=True)
    inputs = model.to_tensor(data.images)
    structured = {a: module_accuracy(prune_structured(model.module, a).module, inputs, data.labels) for a in STRUCTURED_SWEEP}
    l1 = {a: module_accuracy(prune_l1(model.module, a).module, inputs, data.labels) for a in L1_SWEEP}
    section = render(args, model, reference, reference_seconds, rows, structured, l1, weights)
    print(section)
    if not args.no_write:
        write_section(section, BEGIN, END)


def render(args, model, reference, reference_seconds, rows, structured, l1, weights) -> str:
    fp32_seconds = next(row[2] for row in rows if row[0] == "fp32")
    lines = [
        BEGIN,
        "## Compression methods (ONNX export, int8 quantization, pruning)",
        "",
        "Command: `.venv/bin/python -m benchmarks.bench_compress`  ",
        f"Model: DeepImportance LeNet-5 ({weights.name}, Keras import), source state dict "
        f"{rows[0][1].source_size_bytes:,} bytes; data: MNIST t10k (all 10,000). PyTorch accuracy "
        f"{reference:.2%} (paper {PAPER_ACCURACY:.2%}), {reference_seconds:.2f} s for 10k. "
        f"int8-static calibrated on the first {args.calib} test images (MinMax; the training split is not "
        f"available, so these are part of the evaluation set). Pruning amount {AMOUNT}; prune-l1 is global. "
        f"Time = median of {args.repeats} `compress()` runs after a warm-up export (export + quantize/prune "
        f"+ ONNX Runtime check); {args.threads} torch/ONNX Runtime thread(s); 2-core machine shared with other jobs.",
        "",
        "| method | accuracy (10k) | vs PyTorch | within 1 pt | file bytes | gzipped bytes | compress s | vs fp32 | "
        "eval 10k s | sparsity / quantized layers |",
        "|---|---:|---:|:---:|---:|---:|---:|---:|---:|---|",
    ]
    for method, result, seconds, acc, eval_seconds, gzip_bytes in rows:
        detail = (
            f"{result.sparsity:.3f}" if result.sparsity is not None
            else f"{len(result.quantized_ops['quantized_layers'])} of "
                 f"{len(result.quantized_ops['quantized_layers']) + len(result.quantized_ops['float_layers'])}"
            if result.quantized_ops else "-"
        )
        within = "yes" if reference - acc <= MAX_DROP else "**no**"
        lines.append(
            f"| {method} | {acc:.2%} | {100 * (acc - reference):+.2f} pt | {within} | {result.size_bytes:,} | {gzip_bytes:,} | "
            f"{seconds:.2f} | {seconds / fp32_seconds:.2f}x | {eval_seconds:.2f} | {detail} |"
        )
    best_structured = largest_amount_within(structured, reference)
    best_l1 = largest_amount_within(l1, reference)
    lines += [
        "",
        "Pruning sweeps (PyTorch accuracy of the pruned copy on the 10k set; the fp32 export matches it):",
        "",
        "| prune-structured amount | " + " | ".join(f"{a:g}" for a in structured) + " |",
        "|---|" + "---:|" * len(structured),
        "| accuracy | " + " | ".join(f"{v:.2%}" for v in structured.values()) + " |",
        "",
        "| prune-l1 (global) amount | " + " | ".join(f"{a:g}" for a in l1) + " |",
        "|---|" + "---:|" * len(l1),
        "| accuracy | " + " | ".join(f"{v:.2%}" for v in l1.values()) + " |",
        "",
        f"Largest swept amount within 1 point of PyTorch (all smaller amounts too): prune-structured "
        f"{best_structured}, prune-l1 {best_l1}. Channel counts are rounded per layer "
        "(`round(amount x channels)`), so LeNet-5's 6-channel conv1 loses its first channel once amount exceeds 1/12. "
        "Pruned files keep the zeros dense (same size as fp32); the gzipped size shows what the sparsity saves. "
        "No fine-tuning after pruning.",
        END,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
