"""The boundary walk's seeds together vs one at a time: its walks and its DFlare fallbacks.

Each step of a seed's walks is one forward/backward pass of the original on its targets' few images, and the
walk leaves most seeds under a tight realism budget to its fallback (DFlare inside the budget, up to the
queries left), which asks one input per step. One seed at a time, that is one small model call per step; the
walks of many seeds together (``WALK_BATCH``) make one batched pass per step, and the fallbacks of a chunk's
seeds together (``FALLBACK_BATCH``) one batched call of each model per step. The three runs below are the same
campaign in one process, one thread: both 1 (one seed at a time), the fallbacks together, and both together
(the defaults): the wall and CPU seconds, their ratios, and whether every seed's record (stop, queries, the
original's passes, operators, trigger labels and distances; seconds aside) is the same.

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


def _run(original, compressed, seeds, walk_batch: int, fallback_batch: int):
    boundary.WALK_BATCH, boundary.FALLBACK_BATCH = walk_batch, fallback_batch
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
    walks, fallbacks = boundary.WALK_BATCH, boundary.FALLBACK_BATCH
    settings = {"one seed at a time (WALK_BATCH 1, FALLBACK_BATCH 1)": (1, 1),
                f"fallbacks together (WALK_BATCH 1, FALLBACK_BATCH {fallbacks})": (1, fallbacks),
                f"walks and fallbacks together (WALK_BATCH {walks}, FALLBACK_BATCH {fallbacks})": (walks, fallbacks)}
    runs = {name: _run(original, compressed, seeds, *batches) for name, batches in settings.items()}
    (alone, alone_wall, alone_cpu), *_, (together, _, _) = runs.values()
    fallen = sum("dflare" in r.operator_counts for r in together.records)
    same = all([_kept(r) for r in result.records] == [_kept(r) for r in alone.records] for result, _, _ in runs.values())
    lines = [BEGIN, "## The boundary walk: seeds together vs one at a time (bench_boundary_fallback)", "",
             f"LeNet-5 vs its int8 TFLite file, MNIST test [{args.seeds}] ({len(seeds)} seeds, {fallen} reach the "
             f"fallback), L-inf <= 4, {MAX_QUERIES} queries per seed, one thread, the runs in one process. "
             f"Triggers: {', '.join(str(result.summary.triggers) for result, _, _ in runs.values())}.", "",
             "| seeds | wall s | CPU s | wall / alone |", "|---|---:|---:|---:|",
             *[f"| {name} | {wall:.1f} | {cpu:.1f} | {wall / alone_wall:.2f} |"
               for name, (_, wall, cpu) in runs.items()], "",
             f"Every seed's record the same in the three runs, seconds aside: {'yes' if same else 'NO'}.", "",
             "    .venv/bin/python -m benchmarks.bench_boundary_fallback", END]
    publish("\n".join(lines), BEGIN, END, write=not args.no_write)


if __name__ == "__main__":
    main()
