"""DeepBase-style inspection of the reference LeNet-5: what its units encode, and what sharing and early stopping save.

Two parts, one run (script, not a test):

1. **Evaluation**: every unit of ``fc1`` and ``fc2`` of the DeepImportance LeNet-5 against the
   built-in hypotheses on the MNIST training split, with IDC's important neurons of ``fc2``
   (fitted on ``--importance-inputs`` training images, top-6) as a group and labelled with their
   strongest hypotheses.
2. **Timing** (ratios within this run): the naive plan, one full pass over the data per
   hypothesis (no shared computation, no early stopping), against one shared pass over all the
   data, against one shared pass with early stopping (``--tolerance``). All three with the same
   measures; the early-stopped scores' largest difference from the full-data scores is reported.

Writes its section of benchmarks/RESULTS.md (between the ``bench_inspect`` markers) with ``--write``.
From the repository root::

    .venv/bin/python -m benchmarks.bench_inspect --write
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

import mlflow_di  # noqa: F401  (torchvision guard before anything imports torchvision)
import numpy as np
import torch

from benchmarks.results import write_section
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.data import load_images
from mlflow_di.inspection import Inspection, builtin_hypotheses
from mlflow_di.models.loading import load_torch_model

BEGIN, END = "<!-- bench_inspect -->", "<!-- /bench_inspect -->"
SHARED = pathlib.Path(os.environ.get("MLFLOW_DI_SHARED", pathlib.Path(__file__).resolve().parents[2] / "shared"))
MEASURES = ("pearson", "spearman", "mi", "probe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=60000, help="training images inspected (first N)")
    parser.add_argument("--timing-inputs", type=int, default=20000, help="training images of the timing part")
    parser.add_argument("--importance-inputs", type=int, default=5000)
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--out", default="benchmarks/reproduce/results/bench_inspect.json")
    parser.add_argument("--write", action="store_true", help="write the RESULTS.md section")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_torch_model(f"keras:lenet5:{SHARED / 'models/deepimportance/LeNet5.h5'}")
    data = model.preprocessing.prepare(load_images(f"mnist-train:{SHARED / 'data/mnist'}[0:{args.inputs}]"))
    hypotheses = builtin_hypotheses(range(10))
    analysis = data.subset(slice(0, args.importance_inputs))
    important = ImportanceDrivenCoverage(layers="fc2", top_m=6, seed=0).fit(model, analysis) \
        .fitted_layers_["fc2"].important_neurons.tolist()
    results = {"machine": f"{platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}",
               "inputs": len(data), "tolerance": args.tolerance, "importance_inputs": len(analysis),
               "important_fc2": important, "layers": {}}
    for layer in ("fc1", "fc2"):
        groups = {"important": important} if layer == "fc2" else {}
        start = time.perf_counter()
        result = Inspection(hypotheses, measures=MEASURES, tolerance=args.tolerance).run(model, data, layer,
                                                                                          groups=groups)
        seconds = time.perf_counter() - start
        results["layers"][layer] = {
            "seconds": seconds, "inputs_read": result.n_inputs, "converged": result.converged,
            "top_units": {h: result.top_units(h, 2) for h in result.hypotheses},
            "probe": {g: dict(zip(result.hypotheses, map(_num, result.scores["probe"][i])))
                      for i, g in enumerate(result.groups)},
            "labels": result.unit_labels(important, k=3) if layer == "fc2" else []}
        print(f"{layer}: {result.n_inputs} inputs read, {seconds:.1f} s")
    results["timing"] = timing(model, data.subset(slice(0, args.timing_inputs)), hypotheses, args.tolerance)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    section = render(results)
    print(section)
    if args.write:
        write_section(section, BEGIN, END)


def _num(value) -> float | None:
    return float(value) if np.isfinite(value) else None


def timing(model, data, hypotheses, tolerance) -> dict:
    """Seconds of the naive, shared and shared + early-stopped plans on ``fc2``, and the early scores' error."""
    start = time.perf_counter()
    for hypothesis in hypotheses:
        Inspection([hypothesis], measures=MEASURES, early_stop=False).run(model, data, "fc2")
    naive = time.perf_counter() - start
    start = time.perf_counter()
    full = Inspection(hypotheses, measures=MEASURES, early_stop=False).run(model, data, "fc2")
    shared = time.perf_counter() - start
    start = time.perf_counter()
    early = Inspection(hypotheses, measures=MEASURES, tolerance=tolerance).run(model, data, "fc2")
    early_s = time.perf_counter() - start
    error = max(float(np.nanmax(np.abs(early.scores[m] - full.scores[m]))) for m in MEASURES)
    return {"inputs": len(data), "naive_s": naive, "shared_s": shared, "early_s": early_s,
            "early_inputs": early.n_inputs, "max_abs_error_vs_full": error}


def render(results: dict) -> str:
    t = results["timing"]
    fc2 = results["layers"]["fc2"]
    lines = [BEGIN, "## Inspection (bench_inspect): what the reference LeNet-5's units encode", "",
             "`.venv/bin/python -m benchmarks.bench_inspect --write` (DeepImportance LeNet-5, built-in hypotheses, "
             f"measures {', '.join(MEASURES)}; {results['machine']}).", "",
             f"**Shared computation and early stopping** (layer fc2, first {t['inputs']} training images, ratios "
             "within one run):", "",
             "| plan | seconds | inputs read | vs naive |", "|---|---|---|---|",
             f"| naive: one full pass per hypothesis ({len(fc2['top_units'])} passes) | {t['naive_s']:.1f} | "
             f"{t['inputs']} x {len(fc2['top_units'])} | 1.0x |",
             f"| shared: one pass for all hypotheses | {t['shared_s']:.1f} | {t['inputs']} | "
             f"{t['naive_s'] / t['shared_s']:.1f}x faster |",
             f"| shared + early stopping (tolerance {results['tolerance']}) | {t['early_s']:.1f} | {t['early_inputs']} | "
             f"{t['naive_s'] / t['early_s']:.1f}x faster |", "",
             f"Largest difference between an early-stopped score and the full-data score: "
             f"{t['max_abs_error_vs_full']:.3f} (tolerance {results['tolerance']}).", "",
             f"**Evaluation** on the first {results['inputs']} training images "
             + ", ".join(f"({layer}: {v['inputs_read']} read before every 95% interval was narrower than "
                         f"{results['tolerance']}, {v['seconds']:.0f} s)" for layer, v in results["layers"].items())
             + ". Strongest units per hypothesis (Pearson r):", "",
             "| hypothesis | fc1 units | fc2 units | probe fc1 | probe fc2 | probe fc2 important |", "|---|---|---|---|---|---|"]
    fc1 = results["layers"]["fc1"]
    for h in fc2["top_units"]:
        lines.append(f"| {h} | {_units(fc1['top_units'][h])} | {_units(fc2['top_units'][h])} | "
                     f"{_score(fc1['probe']['layer'][h])} | {_score(fc2['probe']['layer'][h])} | "
                     f"{_score(fc2['probe']['important'][h])} |")
    lines += ["", "Probe: cross-validated balanced accuracy (class indicators, pieces of ink, loops) or R^2 "
                  "(the rest) of a linear probe from the group's units.", "",
              f"IDC's important neurons of fc2 (top-6 on the first {results['importance_inputs']} training images, most "
              "important first) and their strongest hypotheses:", "", "| neuron | strongest hypotheses |", "|---|---|"]
    lines += [f"| {row['neuron']} | {row['strongest']} |" for row in fc2["labels"]]
    lines.append(END)
    return "\n".join(lines)


def _units(pairs) -> str:
    return ", ".join(f"{u} ({s:+.2f})" for u, s in pairs)


def _score(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
