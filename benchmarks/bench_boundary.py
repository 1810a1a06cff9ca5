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

**Slices nobody tuned on** (``--slices 5``): five disjoint 100-seed slices of MNIST test drawn by
``numpy.random.default_rng(SLICE_GENERATOR_SEED)`` from the blocks [k*100:(k+1)*100] that the
boundary walk was never developed on ([9000:9100] above, [9700:9800] of the SSIM diagnosis), for
each pair: the boundary walk under SSIM >= 0.9 and under L-inf <= 32, and the oracle on the seeds the
SSIM walk left. Per slice: mean, median and 90th percentile queries per trigger, the share of what
exists, the original's passes and CPU seconds per seed; every seed's phase (``walk``, ``restart``,
``dflare``, none) goes to ``benchmarks/bench_boundary_seeds.csv``. Pairs and slices run in
``--jobs`` processes of one thread each; seconds are each seed's CPU seconds (its record's), so
the two processes do not bend them.

    .venv/bin/python -m benchmarks.bench_boundary --slices 5 --pairs lenet5,lenet1,lenet5:int8-static --jobs 2
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
SLICE_GENERATOR_SEED = 47
SLICE = 100
#: MNIST test blocks the boundary walk was developed on: never drawn
TUNED_BLOCKS = (90, 97)
SEEDS_CSV = pathlib.Path(__file__).with_name("bench_boundary_seeds.csv")


def oracle_walk(constraint: Constraint) -> BoundaryWalk:
    return BoundaryWalk(constraint=constraint, steps=150, step_sizes=(1.0, 2.0, 4.0, 6.0, 10.0, 20.0, 40.0),
                        linf_step_sizes=(1.0, 2.0, 4.0, 8.0), restarts=ORACLE_RESTARTS)


def solved(result) -> set[int]:
    """Indices (into the fuzzed seed set) of the seeds a campaign found a trigger for."""
    return {r.index for r in result.records if r.success and not r.already_deviating}


def all_inside(result, constraint: Constraint) -> bool:
    """Whether every trigger of a campaign is inside ``constraint``, measured on the saved image."""
    return all(constraint.allows(t, seed) for t, seed in zip(result.triggers, result.trigger_seeds))


def fuzzed(result) -> set[int]:
    return {r.index for r in result.records if not r.already_deviating}


def row(pair: str, budget: str, search: str, result, seconds: float, exists: int | None) -> str:
    s = result.summary
    inside = all_inside(result, BUDGETS[budget])
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


def draw_slices(count: int) -> list[tuple[int, int]]:
    """``count`` disjoint [start, start + 100) slices of MNIST test's 10,000 images, in index order."""
    blocks = [block for block in range(10_000 // SLICE) if block not in TUNED_BLOCKS]
    chosen = np.random.default_rng(SLICE_GENERATOR_SEED).choice(blocks, size=count, replace=False)
    return [(int(block) * SLICE, (int(block) + 1) * SLICE) for block in sorted(chosen)]


def trigger_ssims(record) -> list[str]:
    """The paper's and the whole-image SSIM of a record's trigger, as CSV cells (empty without one)."""
    distances = (record.trigger_distances or {}) if record is not None and record.success else {}
    return [f"{distances[key]:.3f}" if distances.get(key) is not None else "" for key in ("ssim", "ssim_whole")]


def phase(record) -> str:
    """The phase of the boundary strategy that found a seed's trigger (``-`` when none did)."""
    return record.operators[0].split(":")[0] if record.success and record.operators else "-"


_PAIRS: dict = {}


def slice_task(task: tuple[str, str, tuple[int, int], bool]) -> tuple[list[str], list[list]]:
    """One pair on one slice (run in a worker process): its table rows and its per-seed CSV rows."""
    import torch

    torch.set_num_threads(1)
    shared, pair, (start, stop), oracle = task
    if pair not in _PAIRS:
        _PAIRS[pair] = load_pair(pathlib.Path(shared), pair)
    original, compressed = _PAIRS[pair]
    seeds = mlflow_di.load_images(f"mnist-test:{pathlib.Path(shared) / 'data' / 'mnist'}[{start}:{stop}]")
    results = {budget: run_boundary(original, compressed, seeds, BoundaryWalk(constraint=constraint), timeout=600,
                                    max_queries=MAX_QUERIES, progress=False) for budget, constraint in BUDGETS.items()}
    ssim_budget, linf_budget = BUDGETS
    ssim_result = results[ssim_budget]
    unsolved = sorted(fuzzed(ssim_result) - solved(ssim_result))
    extra, oracle_seconds, oracle_records = set(), 0.0, {}
    if oracle and unsolved:
        oracle_result, oracle_seconds = run_oracle(original, compressed, seeds, unsolved, BUDGETS[ssim_budget])
        extra = {unsolved[i] for i in solved(oracle_result)}
        oracle_records = {unsolved[r.index]: r for r in oracle_result.records}
    exists = len(solved(ssim_result) | extra)
    seconds = {budget: sum(r.seconds for r in result.records if not r.already_deviating) /
               max(len(fuzzed(result)), 1) for budget, result in results.items()}
    rows = []
    for budget, result in results.items():
        queries = [r.queries for r in result.records if r.success and not r.already_deviating]
        passes = [r.original_passes for r in result.records if not r.already_deviating]
        phases = {name: sum(phase(r) == name for r in result.records if not r.already_deviating)
                  for name in ("walk", "restart", "dflare")}
        inside = all_inside(result, BUDGETS[budget])
        share = f"{len(queries) / exists:.0%}" if oracle and budget == ssim_budget and exists else "-"
        stats = (f"{np.mean(queries):.1f} | {np.median(queries):.0f} | {np.percentile(queries, 90):.0f}"
                 if queries else "- | - | -")
        ratio = f" ({seconds[budget] / seconds[linf_budget]:.2f}x L-inf)" if budget == ssim_budget else ""
        rows.append(f"| {pair} | [{start}:{stop}] | {budget} | {len(queries)}/{len(fuzzed(result))} | {share} | {stats} | "
                    f"{phases['walk']} / {phases['restart']} / {phases['dflare']} | {np.mean(passes):.0f} | "
                    f"{seconds[budget]:.2f}{ratio} | {'yes' if inside else 'NO'} |")
    if oracle:
        rows.append(f"| {pair} | [{start}:{stop}] | oracle, on the {len(unsolved)} seeds the SSIM walk left | "
                    f"{len(extra)} more; exists on {exists}/{len(fuzzed(ssim_result))} | | | | | | | "
                    f"{oracle_seconds / max(len(unsolved), 1):.1f} wall | |")
    seed_rows = [[pair, budget, start + r.index, phase(r) if not r.already_deviating else "already deviating",
                  r.queries, r.original_passes, f"{r.seconds:.3f}",
                  ("found" if r.index in extra else "none") if budget == ssim_budget and r.index in unsolved and oracle
                  else "", *trigger_ssims(oracle_records.get(r.index) if r.index in extra and budget == ssim_budget
                                          else r)]
                 for budget, result in results.items() for r in result.records]
    print(*rows, sep="\n", flush=True)
    return rows, seed_rows


def main_slices(args) -> None:
    """``--slices N``: every pair on N slices nobody tuned on, in ``--jobs`` processes (module docstring)."""
    import csv
    import multiprocessing

    slices = draw_slices(args.slices)
    tasks = [(args.shared, pair, bounds, not args.no_oracle) for pair in args.pairs.split(",") for bounds in slices]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        outcomes = pool.map(slice_task, tasks, chunksize=1)
    with SEEDS_CSV.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["pair", "budget", "mnist_test_index", "phase", "queries", "original_passes", "cpu_seconds",
                         "oracle_on_seeds_the_walk_left", "trigger_ssim", "trigger_ssim_whole"])
        for _, seed_rows in outcomes:
            writer.writerows(seed_rows)
    rows = [row for table_rows, _ in outcomes for row in table_rows]
    text = "\n".join([
        "## Realistic deviations on slices nobody tuned on (bench_boundary --slices)", "",
        f"`.venv/bin/python -m benchmarks.bench_boundary --slices {args.slices} --pairs {args.pairs} --jobs {args.jobs}` "
        f"(2 CPU cores, no GPU, one thread per process): {args.slices} disjoint {SLICE}-seed slices of MNIST test drawn "
        f"by `numpy.random.default_rng({SLICE_GENERATOR_SEED})` from the blocks the walk was not developed on "
        f"({', '.join(f'[{a}:{b}]' for a, b in slices)}); the boundary walk with its defaults, at most {MAX_QUERIES:,} "
        "queries to the compressed model per seed. *queries per trigger*: mean | median | 90th percentile. *phase*: "
        "seeds whose trigger the walk from the seed / a random restart / the DFlare fallback found. *of what exists*: "
        "the SSIM walk's triggers over the seeds on which it or the oracle found one (the oracle: boundary walk with "
        f"150 steps, 7 step sizes and {ORACLE_RESTARTS} random restarts, then DFlare; at most {ORACLE_QUERIES:,} "
        f"queries and {ORACLE_TIMEOUT:.0f} s per seed, on the seeds the SSIM walk left). The SSIM budget bounds the "
        "paper's SSIM and the whole-image SSIM (`realism.budget_ssim`); the per-seed CSV has both for every trigger "
        "(the oracle's where it found the seed's). *CPU s per seed*: the "
        "seed records' CPU seconds (mlflow_di.fuzz.charge), with the ratio to the L-inf walk on the same slice. "
        f"Every seed's phase: `benchmarks/{SEEDS_CSV.name}`.", "",
        "| pair | slice | budget | triggers / fuzzed | of what exists | queries per trigger: mean | median | p90 "
        "| phase (walk / restart / dflare) | original passes per seed | CPU s per seed | every trigger inside |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|", *rows, ""])
    print(text)
    if not args.no_write:
        write_section(f"<!-- bench_boundary slices -->\n{text}\n<!-- /bench_boundary slices -->",
                      "<!-- bench_boundary slices -->", "<!-- /bench_boundary slices -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--pairs", default="lenet5,lenet1")
    parser.add_argument("--seeds", default="9000:9100")
    parser.add_argument("--no-oracle", action="store_true", help="skip the slow oracle search")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not touch RESULTS.md")
    parser.add_argument("--section", default="", help="write a section of this name (e.g. exports) instead of the main one")
    parser.add_argument("--slices", type=int, default=0, help="N: slices nobody tuned on instead of --seeds")
    parser.add_argument("--jobs", type=int, default=1, help="processes for --slices")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DI_THREADS", "1")
    if args.slices:
        return main_slices(args)
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
                inside = oracle is None or all_inside(oracle, constraint)
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
