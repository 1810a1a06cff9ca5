"""Realistic deviations: the boundary strategy against DFlare inside the same realism budget.

Subject: the DFlare reference pairs (``lenetN.h5`` imported as ``lenetN-same`` vs ``lenetN-quan.lite``),
MNIST test seeds [9000:9100], one run each, both capped at 2,000 queries to the compressed model per
seed. Budgets: SSIM >= 0.9 and L-inf <= 32. Per row: success, mean queries to the compressed model per
trigger, the original's forward+backward passes per seed (boundary only; DFlare's original runs once per
query), wall seconds, and the check that every trigger is inside its budget (measured on the saved
trigger, not assumed).

**The oracle** estimates on which seeds a trigger exists inside the budget at all: every seed that
neither search solved is searched again by a strong, slow search (the boundary walk with more steps,
seven step sizes, ``ORACLE_RESTARTS`` walks from random points inside the budget, then DFlare, at
most ``ORACLE_QUERIES`` queries and ``ORACLE_TIMEOUT`` s per seed). "Exists" is the union of the
seeds any of the three solved: a lower bound on what exists, so "of what exists" is an upper bound
on each search's share.

A pair ``lenetN:METHOD`` fuzzes the same original against an export that ``compress`` makes here
(``int8-static`` calibrated on MNIST train [0:500], ``prune-l1`` at its default 30%) instead of the
paper's TFLite file.

    .venv/bin/python -m benchmarks.bench_boundary [--shared ../shared] [--pairs lenet5,lenet1] [--seeds 9000:9100]
        [--no-oracle] [--no-write] [--section exports]
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
ORACLE_RESTARTS = 8
ORACLE_QUERIES = 10_000
ORACLE_TIMEOUT = 30.0


def oracle_walk(constraint: Constraint) -> BoundaryWalk:
    return BoundaryWalk(constraint=constraint, steps=150, step_sizes=(1.0, 2.0, 4.0, 6.0, 10.0, 20.0, 40.0),
                        linf_step_sizes=(1.0, 2.0, 4.0, 8.0), restarts=ORACLE_RESTARTS)


def solved(result) -> set[int]:
    """Indices (into the fuzzed seed set) of the seeds a campaign found a trigger for."""
    return {r.index for r in result.records if r.success and not r.already_deviating}


def fuzzed(result) -> set[int]:
    return {r.index for r in result.records if not r.already_deviating}


def row(pair: str, budget: str, search: str, result, seconds: float, exists: int | None) -> str:
    s = result.summary
    inside = all(BUDGETS[budget].allows(t, seed) for t, seed in zip(result.triggers, result.trigger_seeds))
    passes = [r.original_passes for r in result.records if r.original_passes is not None and not r.already_deviating]
    mean = "-" if s.mean_queries is None else f"{s.mean_queries:.1f}"
    share = f"{s.triggers / exists:.0%}" if exists else "-"
    return (f"| {pair} | {budget} | {search} | {s.triggers}/{s.fuzzed} ({s.success_rate:.0%}) | {share} | {mean} | "
            f"{f'{np.mean(passes):.0f}' if passes else '-'} | {seconds:.0f} | {'yes' if inside else 'NO'} |")


def load_pair(shared: pathlib.Path, pair: str):
    """(original TorchModel, compressed classifier) of ``lenetN`` (the paper's TFLite file) or
    ``lenetN:METHOD`` (an export compress makes here, in a folder that lives as long as the process)."""
    import tempfile

    name, _, method = pair.partition(":")
    original = mlflow_di.load_torch_model(f"keras:{name}-same:{shared / 'models' / 'dflare' / f'{name}.h5'}")
    if not method:
        return original, mlflow_di.load_classifier(str(shared / "models" / "dflare" / f"{name}-quan.lite"))
    from mlflow_di.compression import compress
    from mlflow_di.models.classifier import OnnxClassifier

    calib = mlflow_di.load_images(f"mnist-train:{shared / 'data' / 'mnist'}[0:500]")
    result = compress(original.module, original.preprocessing, method, tempfile.mkdtemp(prefix="bench-boundary-"),
                      calib_inputs=calib.images)
    return original, OnnxClassifier(result.path, name=f"{name} {method}")


def run_oracle(original, compressed, seeds, unsolved: list[int], constraint: Constraint):
    """The oracle's result on the ``unsolved`` seeds (indices into ``seeds``) and its wall seconds."""
    from mlflow_di.data import ImageSet

    subset = ImageSet(np.asarray(seeds.images[np.asarray(unsolved, np.int64)]), seeds.labels[unsolved],
                      f"{seeds.name} unsolved")
    started = time.perf_counter()
    result = run_boundary(original, compressed, subset, oracle_walk(constraint), timeout=ORACLE_TIMEOUT,
                          max_queries=ORACLE_QUERIES, progress=False)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--pairs", default="lenet5,lenet1")
    parser.add_argument("--seeds", default="9000:9100")
    parser.add_argument("--no-oracle", action="store_true", help="skip the slow oracle search")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not touch RESULTS.md")
    parser.add_argument("--section", default="", help="write a section of this name (e.g. exports) instead of the main one")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DI_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    shared = pathlib.Path(args.shared)
    seeds = mlflow_di.load_images(f"mnist-test:{shared / 'data' / 'mnist'}[{args.seeds}]")
    rows = ["| pair | budget | search | triggers / fuzzed | of what exists | queries per trigger | "
            "original passes per seed | s | every trigger inside |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for pair in args.pairs.split(","):
        original, compressed = load_pair(shared, pair)
        for budget, constraint in BUDGETS.items():
            results = {}
            for search in ("boundary", "dflare"):
                started = time.perf_counter()
                if search == "boundary":
                    result = run_boundary(original, compressed, seeds, BoundaryWalk(constraint=constraint),
                                          timeout=600, max_queries=MAX_QUERIES, progress=False)
                else:
                    result = run_campaign(original.classifier(), compressed, seeds, DFlare(constraint=constraint),
                                          timeout=600, max_queries=MAX_QUERIES, progress=False)
                results[search] = (result, time.perf_counter() - started)
            found = solved(results["boundary"][0]) | solved(results["dflare"][0])
            exists = None
            oracle_row = None
            if not args.no_oracle:
                unsolved = sorted(fuzzed(results["boundary"][0]) - found)
                oracle, seconds = run_oracle(original, compressed, seeds, unsolved, constraint) if unsolved else (None, 0.0)
                extra = {unsolved[i] for i in solved(oracle)} if oracle is not None else set()
                exists = len(found | extra)
                inside = oracle is None or all(constraint.allows(t, s) for t, s in zip(oracle.triggers, oracle.trigger_seeds))
                oracle_row = (f"| {pair} | {budget} | oracle, on the {len(unsolved)} seeds neither solved | "
                              f"{len(extra)} more; exists on {exists}/{len(fuzzed(results['boundary'][0]))} | - | - | - | "
                              f"{seconds:.0f} | {'yes' if inside else 'NO'} |")
            for search, (result, seconds) in results.items():
                rows.append(row(pair, budget, search, result, seconds, exists))
                print(rows[-1], flush=True)
            if oracle_row:
                rows.append(oracle_row)
                print(oracle_row, flush=True)
    text = "\n".join([
        "## Realistic deviations: boundary vs DFlare in one budget (bench_boundary"
        + (f", {args.section})" if args.section else ")"), "",
        f"`.venv/bin/python -m benchmarks.bench_boundary --pairs {args.pairs} --seeds {args.seeds}` (2 CPU cores, "
        f"no GPU, one thread): the pairs named (`lenetN`: the DFlare reference pair; `lenetN:METHOD`: the same original "
        f"against an export `compress` made here), MNIST test seeds [{args.seeds}], one run each, at most "
        f"{MAX_QUERIES:,} queries to the compressed model per seed; queries count the compressed model only, the "
        "original's forward and backward passes are counted apart (boundary; DFlare runs the original once per "
        f"query). *of what exists*: triggers over the seeds on which any search found one, the oracle included "
        f"(boundary walk with 150 steps, 7 step sizes and {ORACLE_RESTARTS} random restarts, then DFlare; at most "
        f"{ORACLE_QUERIES:,} queries and {ORACLE_TIMEOUT:.0f} s per seed, on the seeds the two searches left).",
        "", *rows, ""])
    print(text)
    if not args.no_write:
        begin, end = (BEGIN, END) if not args.section else (f"<!-- bench_boundary {args.section} -->",
                                                             f"<!-- /bench_boundary {args.section} -->")
        write_section(f"{begin}\n{text}\n{end}", begin, end)


if __name__ == "__main__":
    main()
