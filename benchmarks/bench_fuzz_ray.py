"""Fuzzing on Ray: queries/s with 1 and 2 local workers against the in-process runner, Ray's cost per
chunk, and the driver's ceiling in seeds/s.

1. LeNet-5 (DeepImportance weights, PyTorch, one thread per process) against its int8-static ONNX
   export, MNIST test seeds, dflare with ``--max-queries``: wall seconds and queries/s in this
   process, then on 1 and 2 Ray workers (1 CPU each) of one local cluster, every per-seed record
   compared with the local run's. All three in one run; the cluster is started before the clock.
2. Ray's cost per chunk: a model that costs nothing (NumPy brightness threshold, 8x8 images),
   chunks of 64 seeds on one worker; the driver's seconds per chunk minus the worker's own.
3. The driver's ceiling: the same free model, one query per seed, 2 workers: how many finished seeds
   per second one driver can take in and write to the campaign folder.

    .venv/bin/python -m benchmarks.bench_fuzz_ray [--shared ../shared] [--seeds 256] \
        [--max-queries 2000] [--strategy dflare-paper]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.results import write_section
from mlflow_di._ray import connect
from mlflow_di.compression import compress
from mlflow_di.data import ImageSet, load_images
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.distributed import RayExecutor
from mlflow_di.fuzz.results import comparable_records
from mlflow_di.models.loading import load_classifier

BEGIN, END = "<!-- bench_fuzz_ray -->", "<!-- /bench_fuzz_ray -->"


class Threshold:
    """A model that costs (almost) nothing: class 1 when the mean brightness exceeds ``t``."""

    def __init__(self, t: float):
        self.t, self.name = t, f"brightness>{t}"

    def predict_proba(self, images):
        p1 = 1 / (1 + np.exp(-40 * (images.reshape(len(images), -1).mean(axis=1) / 255 - self.t)))
        return np.stack([1 - p1, p1], axis=1)


def timed(seeds, original, compressed, executor=None, **settings):
    began = time.perf_counter()
    result = run_campaign(original, compressed, seeds, executor=executor, progress=False, **settings)
    return result, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--seeds", type=int, default=256)
    parser.add_argument("--max-queries", type=int, default=2000)
    parser.add_argument("--strategy", default="dflare-paper", help="dflare-paper: the paper's fitness needs hundreds "
                        "of queries per LeNet-5 seed, so the campaign is long enough to time")
    parser.add_argument("--ceiling-seeds", type=int, default=20000)
    args = parser.parse_args()
    os.environ["MLFLOW_DI_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"  # workers inherit both

    shared = pathlib.Path(args.shared)
    mnist = shared / "data" / "mnist"
    began = time.perf_counter()
    ray, _ = connect("local")  # every core, loopback only, as fuzz --workers starts it
    startup = time.perf_counter() - began
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    original = load_classifier(f"keras:lenet5:{shared / 'models' / 'deepimportance' / 'LeNet5.h5'}")
    seeds = original.preprocessing.prepare(load_images(f"mnist-test:{mnist}[0:{args.seeds}]"))
    settings = dict(strategy=args.strategy, max_queries=args.max_queries, batch=64, seed=0, timeout=600)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        source = mlflow_di.load_torch_model(f"keras:lenet5:{shared / 'models' / 'deepimportance' / 'LeNet5.h5'}")
        calib = load_images(f"mnist-train:{mnist}[0:500]").images
        # int8-static, not -dynamic: dynamic quantization scales activations per call, so its outputs depend on
        # which other images share the batch, and no two runs that batch differently can have equal records
        export = load_classifier(str(compress(source.module, source.preprocessing, "int8-static",
                                              f"{folder}/int8-static", calib_inputs=calib).path))
        local, local_wall = timed(seeds, original, export, **settings)
        one = seeds.subset(slice(0, 1))
        _, fixed = timed(one, original, export, RayExecutor(workers=1, cpus_per_worker=1), **settings)
        runs = {"in this process": (local, local_wall)}
        for workers in (1, 2):
            executor = RayExecutor(workers=workers, cpus_per_worker=1, chunk_size=32)
            runs[f"Ray, {workers} worker{'s' * (workers > 1)}"] = timed(seeds, original, export, executor, **settings)
    queries = sum(r.queries for r in local.records)
    one_wall, two_wall = runs["Ray, 1 worker"][1], runs["Ray, 2 workers"][1]
    for label, (result, wall) in runs.items():
        same = comparable_records(result) == comparable_records(local)
        rows.append(f"| {label} | {wall:.1f} | {queries / wall:,.0f} | {local_wall / wall:.2f} | "
                    f"{'yes' if same else 'NO'} |")

    free = ImageSet(np.random.default_rng(0).integers(0, 60, (args.ceiling_seeds, 8, 8, 1), dtype=np.uint8),
                    np.zeros(args.ceiling_seeds, np.int64), "dark 8x8")
    one_chunk = RayExecutor(workers=1, cpus_per_worker=1, chunk_size=64)
    few = free.subset(slice(0, 64 * 20))
    _, chunk_wall = timed(few, Threshold(0.30), Threshold(0.32), one_chunk, max_queries=50, batch=64, seed=0,
                          timeout=600)
    per_chunk = (chunk_wall - sum(one_chunk.stats["chunk_seconds"])) / one_chunk.stats["chunks"]
    with tempfile.TemporaryDirectory() as folder:
        _, local_ceiling = timed(free, Threshold(0.30), Threshold(0.32), None, max_queries=1, batch=64, seed=0,
                                 timeout=600, out_dir=f"{folder}/local")
        _, ray_ceiling = timed(free, Threshold(0.30), Threshold(0.32), RayExecutor(workers=2, cpus_per_worker=1),
                               max_queries=1, batch=64, seed=0, timeout=600, out_dir=f"{folder}/ray")
    ray.shutdown()
    lines = [BEGIN, "## Fuzzing on Ray (fuzz --workers N)", "",
             f"Command: `.venv/bin/python -m benchmarks.bench_fuzz_ray --seeds {args.seeds} --max-queries "
             f"{args.max_queries} --strategy {args.strategy}`  ",
             f"Machine: {os.cpu_count()} cores, no GPU; one local Ray cluster (started in {startup:.1f} s, before the "
             "clock). LeNet-5 (PyTorch, 1 thread per process) vs its int8-static ONNX export (calibrated on "
             "mnist-train[0:500]); seeds "
             f"mnist-test[0:{args.seeds}], {args.strategy}, max {args.max_queries} queries per seed, batch 64, chunks of 32 "
             "seeds, 1 CPU per worker. Same run for all three.", "",
             "| where | wall s | queries/s | speed-up vs this process | records equal the local run's |",
             "|---|---:|---:|---:|---|", *rows, "",
             f"The Ray rows include each campaign's fixed cost: starting the worker processes and loading both models "
             f"there, **{fixed:.1f} s** for a one-seed campaign on one worker.  ",
             f"Ray's cost per chunk (a free model, 20 chunks of 64 seeds on one worker): **{per_chunk * 1000:.0f} ms** "
             "of driver wall time beyond the worker's own search (shipping the chunk and its results, the driver "
             "writing 64 records).  ",
             f"Driver ceiling (free model, 1 query per seed, {args.ceiling_seeds:,} seeds, records written to a "
             f"campaign folder): **{args.ceiling_seeds / ray_ceiling:,.0f} seeds/s** on 2 Ray workers; the "
             f"in-process runner does {args.ceiling_seeds / local_ceiling:,.0f} seeds/s.", "",
             f"2 workers against 1: **{one_wall / two_wall:.2f}x** (two worker processes on two cores, the driver "
             "mostly waiting).", "",
             "**Projection for a cluster** (N workers, each with its share of a GPU). A worker searches a chunk as one "
             "local process does, so the campaign's rate is N times one worker's, until one of three limits: (1) the "
             f"driver, which took in {args.ceiling_seeds / ray_ceiling:,.0f} finished seeds/s here; a worker "
             "finishes about 64 seeds (one lockstep batch) per seed search time, so one driver keeps up with "
             f"~{args.ceiling_seeds / ray_ceiling * 180 / 64:,.0f} workers when seeds search 180 s (the default "
             f"--timeout), ~{args.ceiling_seeds / ray_ceiling * 10 / 64:,.0f} at 10 s per seed; (2) the fixed cost per "
             "campaign, worker "
             f"start and model load ({fixed:.1f} s here for LeNet-5, more for a ResNet-50 file shipped through the "
             "object store), paid once per worker, so it matters only for campaigns shorter than a few minutes; "
             f"(3) chunk granularity: {per_chunk * 1000:.0f} ms per chunk against a chunk's search of 64 seeds x "
             "seconds each is negligible, but the last chunks leave workers idle, so keep seeds/chunk_size at "
             "several times N (5,000 seeds in chunks of 64 is 78 chunks: enough for ~20 workers; use smaller "
             "--batch for more). GPUs: --gpus-per-worker 0.25 puts four workers on a GPU, which pays when one "
             "worker's batched calls leave the GPU idle between steps (measure with bench_lockstep_backends on the "
             "GPU before choosing).", END]
    section = "\n".join(lines)
    print(section)
    write_section(section, BEGIN, END)


if __name__ == "__main__":
    main()
