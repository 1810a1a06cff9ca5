"""IDC-guided vs random generation: IDC reached for equal budgets of mutants.

Script, not a test. Two subjects: the demo's digits-cnn (trained here on digits[0:600], 40 epochs,
seed 0; IDC top-6 fitted on digits[0:600]; seeds digits[1300:1400]) and the DeepImportance
LeNet-5 (IDC top-6 of its default layer fitted on the first 2000 MNIST training images; seeds the
first 200 test images). For each, :func:`mlflow_di.coverage.generation.generate` with budget
``--budget`` and generation seeds 0, 1, 2: IDC of the seeds, of the seeds plus the guided kept
inputs, and of the seeds plus every label-preserving random mutant of the same budget. Prints a
Markdown table and writes the figures as JSON. From the repository root::

    .venv/bin/python -m benchmarks.bench_generate --budget 2000
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import mlflow_di  # noqa: F401  (torchvision guard before anything imports torchvision)
import torch

from mlflow_di.coverage.generation import generate
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.data import load_images
from mlflow_di.models.loading import load_torch_model
from mlflow_di.models.training import train_zoo_model

SHARED = pathlib.Path(os.environ.get("MLFLOW_DI_SHARED", pathlib.Path(__file__).resolve().parents[2] / "shared"))


def digits_cnn():
    train = load_images("digits[0:600]")
    model = train_zoo_model("digits-cnn", train, epochs=40)
    return model, train, load_images("digits[1300:1400]")


def lenet5():
    model = load_torch_model(f"keras:lenet5:{SHARED / 'models/deepimportance/LeNet5.h5'}")
    train = model.preprocessing.prepare(load_images(f"mnist-train:{SHARED / 'data/mnist'}[0:2000]"))
    seeds = model.preprocessing.prepare(load_images(f"mnist-test:{SHARED / 'data/mnist'}[0:200]"))
    return model, train, seeds


SUBJECTS = {"digits-cnn": digits_cnn, "lenet5": lenet5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--seeds", default="0,1,2", help="generation seeds")
    parser.add_argument("--subjects", default="digits-cnn,lenet5")
    parser.add_argument("--out", default="benchmarks/reproduce/results/bench_generate.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name in args.subjects.split(","):
        model, train, seeds = SUBJECTS[name]()
        idc = ImportanceDrivenCoverage(top_m=6, seed=0, progress=False).fit(model, train)
        for seed in map(int, args.seeds.split(",")):
            started = time.perf_counter()
            result = generate(idc, model, seeds, args.budget, seed=seed)
            row = {"subject": name, "layer": result.layer, "seed": seed, **result.summary(),
                   "seconds": round(time.perf_counter() - started, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))
    print("| subject | seed | combinations | IDC seeds | IDC guided (kept) | IDC random (label-preserving mutants) | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['subject']} ({r['layer']}) | {r['seed']} | {r['total_combinations']} | {r['idc_seeds']:.1%} | "
              f"{r['idc_guided']:.1%} ({r['kept']}) | {r['idc_random']:.1%} ({r['preserved_random']}) | {r['seconds']} |")


if __name__ == "__main__":
    main()
