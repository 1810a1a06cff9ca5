"""One original against several exports: three separate campaigns vs one call that shares the original.

The DeepImportance LeNet-5 (PyTorch) against its int8-static, int8-dynamic and prune-l1 (0.3) ONNX
exports; MNIST test seeds [0:N], DFlare, ``--max-queries`` per seed, batch 64, one thread per model.
Measured in one run: images the original evaluated, seconds inside the original's calls, wall
seconds, and whether every per-seed record equals the separate campaign's. Also prints the
classes whose triggers took the most queries and the triggers' median L-inf / SSIM of each export, and what the
``--max-linf`` / ``--min-ssim`` constraints cost against the int8-static export (``--min-ssim`` bounds the
paper's and the whole-image SSIM; both medians are reported). Writes its section
of benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks.bench_fuzz_shared [--shared ../shared] [--seeds 100] [--max-queries 2000]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.results import write_section
from mlflow_di.compression import compress
from mlflow_di.data import load_images
from mlflow_di.fuzz.campaign import run_campaign, run_campaigns
from mlflow_di.fuzz.per_class import class_rows
from mlflow_di.fuzz.dflare import DFlare
from mlflow_di.fuzz.realism import Constraint, distance_summary
from mlflow_di.fuzz.results import comparable_records
from mlflow_di.models.classifier import OnnxClassifier

BEGIN, END = "<!-- bench_fuzz_shared -->", "<!-- /bench_fuzz_shared -->"
METHODS = ("int8-static", "int8-dynamic", "prune-l1")
#: constrained searches stall where x_max sits at the constraint's edge (every mutant redrawn), so they
#: run on fewer seeds, with a per-seed timeout
CONSTRAINED_SEEDS, CONSTRAINED_TIMEOUT = 100, 20.0
CONSTRAINTS = {"none": None, "--max-linf 64": Constraint(max_linf=64), "--min-ssim 0.6": Constraint(min_ssim=0.6),
               "--max-linf 64 --min-ssim 0.6": Constraint(max_linf=64, min_ssim=0.6)}


class Timed:
    """A classifier wrapper that counts the images and seconds of its ``predict_proba`` calls."""

    def __init__(self, model):
        self.model, self.name = model, getattr(model, "name", "original")
        self.images, self.seconds, self.calls = 0, 0.0, 0

    def predict_proba(self, images):
        self.calls += 1
        began = time.perf_counter()
        probabilities = self.model.predict_proba(images)
        self.seconds += time.perf_counter() - began
        self.images += len(images)
        return probabilities


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--max-queries", type=int, default=2000)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DI_THREADS", "1")
    shared = pathlib.Path(args.shared)
    mnist = shared / "data" / "mnist"
    source = mlflow_di.load_torch_model(f"keras:lenet5:{shared / 'models' / 'deepimportance' / 'LeNet5.h5'}")
    seeds = source.preprocessing.prepare(load_images(f"mnist-test:{mnist}[0:{args.seeds}]"))
    calib = load_images(f"mnist-train:{mnist}[0:500]").images
    settings = dict(strategy="dflare", max_queries=args.max_queries, batch=64, seed=0, timeout=600, progress=False)
    with tempfile.TemporaryDirectory() as folder:
        exports = [OnnxClassifier(compress(source.module, source.preprocessing, method, f"{folder}/{method}",
                                           calib_inputs=calib, amount=0.3).path, name=method) for method in METHODS]
        separate, separate_original, separate_wall = [], Timed(source.classifier()), 0.0
        for export in exports:
            began = time.perf_counter()
            separate.append(run_campaign(separate_original, export, seeds, **settings))
            separate_wall += time.perf_counter() - began
        shared_original = Timed(source.classifier())
        began = time.perf_counter()
        together = run_campaigns(shared_original, exports, seeds, **settings)
        shared_wall = time.perf_counter() - began
        few = seeds.subset(slice(0, CONSTRAINED_SEEDS), f"{seeds.name} [0:{CONSTRAINED_SEEDS}]")
        constrained = {label: run_campaign(source.classifier(), exports[0], few, **{
            **settings, "timeout": CONSTRAINED_TIMEOUT, "strategy": DFlare(constraint=constraint)})
            for label, constraint in CONSTRAINTS.items()}
    same = all(comparable_records(a) == comparable_records(b) for a, b in zip(separate, together))
    lines = [BEGIN, "## One original against several exports (fuzz --compressed A --compressed B ...)", "",
             f"Command: `.venv/bin/python -m benchmarks.bench_fuzz_shared --seeds {args.seeds} --max-queries "
             f"{args.max_queries}`  ",
             f"Original: DeepImportance LeNet-5 (PyTorch, 1 thread); exports {', '.join(METHODS)} (ONNX Runtime; "
             f"int8-static calibrated on mnist-train[0:500], prune-l1 amount 0.3); seeds mnist-test[0:{args.seeds}], "
             f"dflare, max {args.max_queries:,} queries per seed, batch 64. Same run for both modes.", "",
             "| | three separate campaigns | one shared call | ratio |", "|---|---:|---:|---:|",
             f"| images the original evaluated | {separate_original.images:,} | {shared_original.images:,} | "
             f"{shared_original.images / separate_original.images:.3f} |",
             f"| calls of the original | {separate_original.calls:,} | {shared_original.calls:,} | "
             f"{shared_original.calls / separate_original.calls:.3f} |",
             f"| seconds inside the original's calls | {separate_original.seconds:.2f} | {shared_original.seconds:.2f} | "
             f"{shared_original.seconds / separate_original.seconds:.3f} |",
             f"| wall seconds (all three campaigns) | {separate_wall:.2f} | {shared_wall:.2f} | "
             f"{shared_wall / separate_wall:.3f} |", "",
             f"Every per-seed record equal to the separate campaign's (probabilities to 5 places): "
             f"**{'yes' if same else 'NO'}**.", "",
             "| export | success rate | triggers | mean queries | median trigger L-inf | median trigger SSIM | "
             "classes needing the most queries per trigger |", "|---|---:|---:|---:|---:|---:|---|"]
    for method, result in zip(METHODS, together):
        s, realism = result.summary, distance_summary(result.records)
        rows = [r for r in class_rows(result.records) if r["mean_queries"] is not None]
        hardest = sorted(rows, key=lambda r: (-r["mean_queries"], r["class"]))[:3]
        mean = f"{s.mean_queries:.1f}" if s.mean_queries is not None else "-"
        linf = realism.get("trigger_linf_median")
        ssim = realism.get("trigger_ssim_median")
        lines.append(f"| {method} | {s.success_rate:.1%} | {s.triggers} | {mean} | "
                     f"{'-' if linf is None else f'{linf:.0f}'} | {'-' if ssim is None else f'{ssim:.3f}'} | "
                     + ", ".join(f"{r['class']} ({r['mean_queries']:.1f}, {r['success_rate']:.0%} of {r['fuzzed']})"
                                 for r in hardest) + " |")
    lines += ["", f"Constraints against the int8-static export (seeds [0:{CONSTRAINED_SEEDS}], same query budget, "
              f"timeout {CONSTRAINED_TIMEOUT:g} s per seed):", "",
              "| constraint | success rate | mean queries | median trigger L-inf | median trigger SSIM | median trigger "
              "whole-image SSIM | mutants rejected unqueried per seed |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, result in constrained.items():
        s, realism = result.summary, distance_summary(result.records)
        mean = f"{s.mean_queries:.1f}" if s.mean_queries is not None else "-"
        linf = realism.get("trigger_linf_median")
        ssim, whole = (realism.get(f"trigger_{key}_median") for key in ("ssim", "ssim_whole"))
        rejected = sum(r.constraint_rejections for r in result.records) / max(1, len(result.records))
        lines.append(f"| {label} | {s.success_rate:.1%} | {mean} | {'-' if linf is None else f'{linf:.0f}'} | "
                     f"{'-' if ssim is None else f'{ssim:.3f}'} | {'-' if whole is None else f'{whole:.3f}'} | "
                     f"{rejected:.1f} |")
    section = "\n".join(lines + [END])
    print(section)
    write_section(section, BEGIN, END)


if __name__ == "__main__":
    main()
