"""DeepXplore (white-box gradient ascent) against DFlare (black-box search) on LeNet-5 and two PyTorch copies.

Subject: the DeepImportance LeNet-5 (PyTorch port of the .h5) against (a) its prune-l1 copy (30% of
all weights, the ``compress`` default) and (b) its fake-quantized copy
(``compression.fake_quant.fake_quantize``, calibrated on mnist-train[0:500]). Seeds: mnist-test[0:N].
Per pair and search: success rate, queries per trigger (DeepXplore: gradient steps, one forward and
backward pass of both models; DFlare: inputs through both models), seconds per trigger, NC reached
(thresholds 0 and 0.5, the neurons DeepXplore counts, over the seeds plus the triggers, for the original), and
the triggers' median L-inf / SSIM to their seeds. DeepXplore runs the paper's defaults (20 steps,
lambda1 1, lambda2 0.1) under each of its three constraints, with ``--dx-step`` 10 (8-bit levels) and
with 2550 (the MNIST script's step of 10 on 0..1 pixels); DFlare runs with an equal budget of 20
queries per seed and with 2,000. One thread per model; all rows in one run.

    .venv/bin/python -m benchmarks.bench_deepxplore [--shared ../shared] [--seeds 200]
"""
from __future__ import annotations

import argparse
import os
import pathlib

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.results import write_section
from mlflow_di.compression.fake_quant import fake_quantize
from mlflow_di.compression.prune import prune_l1
from mlflow_di.data import load_images
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.deepxplore import DeepXplore, neuron_coverage, run_deepxplore
from mlflow_di.fuzz.realism import distance_summary
from mlflow_di.models.torch_model import TorchModel

BEGIN, END = "<!-- bench_deepxplore -->", "<!-- /bench_deepxplore -->"


def row(pair: str, search: str, result, models, seeds) -> str:
    s = result.summary
    batches = [seeds.images[:], result.triggers]
    covered, total = neuron_coverage(models[:1], batches, 0.0)[0]
    half = neuron_coverage(models[:1], batches, 0.5)[0][0]
    realism = distance_summary(result.records)
    linf, ssim = realism.get("trigger_linf_median"), realism.get("trigger_ssim_median")
    mean = "-" if s.mean_queries is None else f"{s.mean_queries:.1f}"
    seconds = "-" if s.mean_seconds is None else f"{s.mean_seconds:.3f}"
    return (f"| {pair} | {search} | {s.fuzzed} | {s.success_rate:.1%} | {mean} | {seconds} | "
            f"{covered / total:.1%} | {half / total:.1%} | {'-' if linf is None else f'{linf:.0f}'} | "
            f"{'-' if ssim is None else f'{ssim:.3f}'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--seeds", type=int, default=200)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DI_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    shared = pathlib.Path(args.shared)
    mnist = shared / "data" / "mnist"
    source = mlflow_di.load_torch_model(f"keras:lenet5:{shared / 'models' / 'deepimportance' / 'LeNet5.h5'}")
    source.name = "lenet5"
    seeds = source.preprocessing.prepare(load_images(f"mnist-test:{mnist}[0:{args.seeds}]"))
    calib = source.to_tensor(load_images(f"mnist-train:{mnist}[0:500]").images)
    copies = {
        "prune-l1 (0.3)": TorchModel(prune_l1(source.module, 0.3).module, source.preprocessing, "lenet5-prune-l1"),
        "fake-quantized int8": TorchModel(fake_quantize(source.module, calib), source.preprocessing, "lenet5-fq"),
    }
    lines = [BEGIN, "## DeepXplore vs DFlare (fuzz --strategy deepxplore)", "",
             f"Command: `.venv/bin/python -m benchmarks.bench_deepxplore --seeds {args.seeds}`  ",
             "Original: DeepImportance LeNet-5 (PyTorch); seeds mnist-test[0:"
             f"{args.seeds}]; one thread per model, 2-core CPU. Queries: DeepXplore's are gradient steps (a forward "
             "and backward pass of both models per step), DFlare's are inputs through both models (forward only). "
             f"NC: the original's {len(__import__('mlflow_di.fuzz.deepxplore', fromlist=['x']).neuron_layers(source))} "
             "layers' neurons (conv channels by their spatial mean, min-max scaled per layer) above the threshold "
             "on the seeds plus the triggers (t=0 is DeepXplore's default).", "",
             "| copy | search | fuzzed | success | queries per trigger | seconds per trigger | NC t=0 | NC t=0.5 | "
             "median L-inf | median SSIM |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for pair, copy in copies.items():
        models = [source, copy]
        for constraint in ("lighting", "occlusion", "blackout"):
            for step in (10.0, 2550.0):
                strategy = DeepXplore(constraint=constraint, step=step)
                result = run_deepxplore(models, seeds, strategy, timeout=600, batch=64, seed=0, progress=False)
                lines.append(row(pair, f"deepxplore {constraint}, step {step:g}", result, models, seeds))
        for budget in (20, 2000):
            result = run_campaign(source.classifier(), copy.classifier(), seeds, strategy="dflare", timeout=600,
                                  max_queries=budget, batch=64, seed=0, progress=False)
            lines.append(row(pair, f"dflare, {budget:,} queries", result, models, seeds))
        print("\n".join(lines[-8:]), flush=True)
    section = "\n".join(lines + [END])
    print(section)
    write_section(section, BEGIN, END, pathlib.Path(__file__).resolve().parent / "REPRODUCTION.md")


if __name__ == "__main__":
    main()
