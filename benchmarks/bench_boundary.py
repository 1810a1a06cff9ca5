"""Realistic deviations: the boundary strategy against DFlare inside the same realism budget.

Subject: the DFlare reference pairs (``lenetN.h5`` imported as ``lenetN-same`` vs ``lenetN-quan.lite``),
MNIST test seeds [9000:9100], one run each, both capped at 2,000 queries to the compressed model per
seed. Budgets: SSIM >= 0.9 and L-inf <= 32. Per row: success, mean queries to the compressed model per
trigger, the original's forward+backward passes per seed (boundary only; DFlare's original runs once per
query), wall seconds, and the check that every trigger is inside its budget (measured on the saved
trigger, not assumed).

    .venv/bin/python -m benchmarks.bench_boundary [--shared ../shared] [--pairs lenet5,lenet1] [--seeds 9000:9100]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.results import write_section
from mlflow_di.fuzz import DFlare
from mlflow_di.fuzz.boundary import BoundaryWalk, run_boundary
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.realism import Constraint

BEGIN, END = "<!-- bench_boundary -->", "<!-- /bench_boundary -->"
MAX_QUERIES = 2000
BUDGETS = {"SSIM >= 0.9": Constraint(min_ssim=0.9), "L-inf <= 32": Constraint(max_linf=32)}


def row(pair: str, budget: str, search: str, result, seconds: float) -> str:
    s = result.summary
    inside = all(BUDGETS[budget].allows(t, seed) for t, seed in zip(result.triggers, result.trigger_seeds))
    passes = [r.original_passes for r in result.records if r.original_passes is not None and not r.already_deviating]
    mean = "-" if s.mean_queries is None else f"{s.mean_queries:.1f}"
    return (f"| {pair} | {budget} | {search} | {s.triggers}/{s.fuzzed} ({s.success_rate:.0%}) | {mean} | "
            f"{f'{np.mean(passes):.0f}' if passes else '-'} | {seconds:.0f} | {'yes' if inside else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--pairs", default="lenet5,lenet1")
    parser.add_argument("--seeds", default="9000:9100")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DI_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    shared = pathlib.Path(args.shared)
    seeds = mlflow_di.load_images(f"mnist-test:{shared / 'data' / 'mnist'}[{args.seeds}]")
    rows = ["| pair | budget | search | triggers / fuzzed | queries per trigger | original passes per seed | s "
            "| every trigger inside |", "|---|---|---|---:|---:|---:|---:|---|"]
    for pair in args.pairs.split(","):
        original = mlflow_di.load_torch_model(f"keras:{pair}-same:{shared / 'models' / 'dflare' / f'{pair}.h5'}")
        compressed = mlflow_di.load_classifier(str(shared / "models" / "dflare" / f"{pair}-quan.lite"))
        for budget, constraint in BUDGETS.items():
            for search in ("boundary", "dflare"):
                started = time.perf_counter()
                if search == "boundary":
                    result = run_boundary(original, compressed, seeds, BoundaryWalk(constraint=constraint),
                                          timeout=600, max_queries=MAX_QUERIES, progress=False)
                else:
                    result = run_campaign(original.classifier(), compressed, seeds, DFlare(constraint=constraint),
                                          timeout=600, max_queries=MAX_QUERIES, progress=False)
                rows.append(row(pair, budget, search, result, time.perf_counter() - started))
                print(rows[-1], flush=True)
    text = "\n".join([
        "## Realistic deviations: boundary vs DFlare in one budget (bench_boundary)", "",
        f"`.venv/bin/python -m benchmarks.bench_boundary --pairs {args.pairs} --seeds {args.seeds}` (2 CPU cores, "
        f"no GPU, one thread): the DFlare reference pairs, MNIST test seeds [{args.seeds}], one run each, at most "
        f"{MAX_QUERIES:,} queries to the compressed model per seed; queries count the compressed model only, the "
        "original's forward and backward passes are counted apart (boundary; DFlare runs the original once per "
        "query).", "", *rows, ""])
    write_section(f"{BEGIN}\n{text}\n{END}", BEGIN, END)
    print(text)


if __name__ == "__main__":
    main()
