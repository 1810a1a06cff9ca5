"""The boundary walk's DFlare fallback: the seeds' fallbacks advanced together vs one seed at a time.

The walk leaves most seeds under a tight realism budget to its fallback (DFlare inside the budget, up to the
queries left), which asks one input per step. One seed at a time, that is one model call per query; the
fallbacks of a chunk's seeds together (``FALLBACK_BATCH``) make one batched call of each model per step.
Both runs below are the same campaign in one process, one thread, ``FALLBACK_BATCH`` 1 (the walk as it
was) and its default: the wall and CPU seconds, their ratio, and whether every seed's record (stop,
queries, the original's passes, operators, trigger labels and distances; seconds aside) is the same.

Subject: the reference LeNet-5 (``lenet5.h5`` as ``lenet5-same``) against its int8 TFLite file, MNIST test
seeds [9000:9040], the realism step's budget (L-inf <= 4), 2,000 queries per seed.

    .venv/bin/python -m benchmarks.bench_boundary_fallback [--shared ../shared] [--seeds 9000:9040] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

os.environ.setdefault("MLFLOW_DI_THREADS", "1")

import mlflow_di  # noqa: E402  (torchvision guard first)
from benchmarks.bench_boundary import load_pair  # noqa: E402
from benchmarks.results import publish  # noqa: E402
from mlflow_di.fuzz import boundary  # noqa: E402
from mlflow_di.fuzz.boundary import BoundaryWalk, run_boundary  # noqa: E402
from mlflow_di.fuzz.realism import Constraint  # noqa: E402

BEGIN, END = "<!-- bench_boundary_fallback -->", "<!-- /bench_boundary_fallback -->"
MAX_QUERIES = 2000
BUDGET = Constraint(max_linf=4)


def _run(original, compressed, seeds, fallback_batch: int):
    boundary.FALLBACK_BATCH = fallback_batch
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_boundary(original, compressed, seeds, BoundaryWalk(constraint=BUDGET), max_queries=MAX_QUERIES,
                          progress=False)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _kept(record) -> tuple:
    return (record.index, record.stop, record.queries, record.original_passes, record.operators,
            record.operator_counts, record.trigger_labels, record.trigger_distances)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[2] / "shared")
    parser.add_argument("--seeds", default="9000:9040")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    original, compressed = load_pair(args.shared, "lenet5")
    seeds = mlflow_di.load_images(f"mnist-test:{args.shared / 'data' / 'mnist'}[{args.seeds}]")
    default = boundary.FALLBACK_BATCH
    alone, alone_wall, alone_cpu = _run(original, compressed, seeds, 1)
    together, together_wall, together_cpu = _run(original, compressed, seeds, default)
    fallen = sum("dflare" in r.operator_counts for r in together.records)
    same = [_kept(r) for r in alone.records] == [_kept(r) for r in together.records]
    lines = [BEGIN, "## The boundary walk's fallback: seeds together vs one at a time (bench_boundary_fallback)", "",
             f"LeNet-5 vs its int8 TFLite file, MNIST test [{args.seeds}] ({len(seeds)} seeds, {fallen} reach the "
             f"fallback), L-inf <= 4, {MAX_QUERIES} queries per seed, one thread, both runs in one process. "
             f"Triggers: {together.summary.triggers} (together), {alone.summary.triggers} (alone).", "",
             "| fallbacks | wall s | CPU s |", "|---|---:|---:|",
             f"| one seed at a time (FALLBACK_BATCH 1) | {alone_wall:.1f} | {alone_cpu:.1f} |",
             f"| together (FALLBACK_BATCH {default}) | {together_wall:.1f} | {together_cpu:.1f} |", "",
             f"Together / alone: wall {together_wall / alone_wall:.2f}, CPU {together_cpu / alone_cpu:.2f}. Every seed's "
             f"record the same, seconds aside: {'yes' if same else 'NO'}.", "",
             "    .venv/bin/python -m benchmarks.bench_boundary_fallback", END]
    publish("\n".join(lines), BEGIN, END, write=not args.no_write)


if __name__ == "__main__":
    main()
