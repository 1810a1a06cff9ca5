"""Coverage on Ray: fit + score in this process and on 2 Ray workers at several sizes, the fixed cost, the crossover.

LeNet-5 (DeepImportance weights, imported to PyTorch), fitted on N MNIST training images and
scoring N/2 MNIST test images with every criterion (IDC, NC, KMNC, NBC, SNAC, TKNC, LSC, DSC),
for each N of ``--sizes``: once in this process (``passes=None``, PyTorch's default threads) and
once on :class:`~mlflow_di.coverage.distributed.RayPasses` with 2 workers of 1 CPU (a new
executor each time, so each Ray run pays its pool start as a ``coverage --workers 2`` command
does). The same again with a stand-in for an expensive model: LeNet-5 whose every forward call
first waits ``--delay`` seconds (a model on a remote accelerator, as in bench_ray_scaling).

Each kind's wall times are fitted to ``seconds = fixed + N * per_image`` (least squares over the
sizes); the crossover is the N above which 2 workers take less time than this process,
``(fixed_ray - fixed_local) / (per_image_local - per_image_ray)``, or none when Ray's per-image
time is not the smaller. Every Ray run's fitted suite and results are compared with the local
run's (they must be equal). The cluster (2 CPUs on this machine) is started before the clock.

    .venv/bin/python -m benchmarks.bench_coverage_ray [--shared ../shared] [--sizes 1000,4000,10000] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.results import publish
from mlflow_di._ray import connect
from mlflow_di.coverage.suite import CoverageSuite
from mlflow_di.data import load_images
from mlflow_di.models.loading import load_torch_model

BEGIN, END = "<!-- bench_coverage_ray -->", "<!-- /bench_coverage_ray -->"


def timed(model, train, test, passes=None):
    """(suite, results, seconds) of one fit on ``train`` and one score of ``test`` (a Ray executor closed inside)."""
    began = time.perf_counter()
    suite = CoverageSuite(progress=False).fit(model, train, passes=passes)
    results = suite.score_all([test], passes=passes)
    if passes is not None:
        passes.close()
    return suite, results, time.perf_counter() - began


def waiting(delay: float):
    """A forward pre-hook that waits ``delay`` seconds per call."""
    def wait(module, inputs):
        time.sleep(delay)

    return wait


def slow_copy(model, delay: float):
    """``model`` whose every call waits ``delay`` s first (no origin: shipped to the workers as it is, hook and all)."""
    import copy

    from mlflow_di.models.torch_model import TorchModel

    module = copy.deepcopy(model.module)
    module.register_forward_pre_hook(waiting(delay))
    return TorchModel(module, model.preprocessing, name=f"{model.name} waiting {delay * 1000:g} ms per call")


def line(sizes, seconds) -> tuple[float, float]:
    """(fixed seconds, seconds per image) of the least-squares line through (size, seconds)."""
    per_image, fixed = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return float(fixed), float(per_image)


def crossover(local: tuple[float, float], ray: tuple[float, float]) -> float | None:
    """Training images (the test set half as many) above which Ray takes less time; None when it never does."""
    if ray[1] >= local[1]:
        return None
    return max(0.0, (ray[0] - local[0]) / (local[1] - ray[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--sizes", default="1000,4000,10000", help="training images per run (test: half)")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds the stand-in model waits per call")
    parser.add_argument("--write", action="store_true", help="put the section in RESULTS.md")
    args = parser.parse_args()
    shared = pathlib.Path(args.shared)
    sizes = [int(size) for size in args.sizes.split(",")]
    model = load_torch_model(f"keras:lenet5:{shared / 'models' / 'deepimportance' / 'LeNet5.h5'}")
    kinds = {"LeNet-5": model, f"LeNet-5 waiting {args.delay * 1000:g} ms per call": slow_copy(model, args.delay)}
    load = os.getloadavg()[0]

    import ray as ray_module
    import torch

    from mlflow_di.coverage.distributed import RayPasses

    ray, _ = connect("local", num_cpus=2)  # loopback only, as coverage --workers starts it
    ray_module.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-in's hook, by value
    rows, fits, stats = [], {}, {}
    for kind, subject in kinds.items():
        walls = {"local": [], "ray": []}
        for size in sizes:
            train = load_images(f"mnist-train:{shared / 'data' / 'mnist'}[0:{size}]")
            test = load_images(f"mnist-test:{shared / 'data' / 'mnist'}[0:{size // 2}]")
            local_suite, local_results, local_s = timed(subject, train, test)
            passes = RayPasses(workers=2, cpus_per_worker=1.0, progress=False)
            suite, results, ray_s = timed(subject, train, test, passes)
            equal = (json.dumps(results[-1].summary()) == json.dumps(local_results[-1].summary())
                     and suite.idc_.to_json() == local_suite.idc_.to_json()
                     and results[-1].criteria.to_json() == local_results[-1].criteria.to_json())
            walls["local"].append(local_s)
            walls["ray"].append(ray_s)
            stats[(kind, size)] = passes.stats
            images = size + size // 2
            rows.append(f"| {kind} | {size:,} + {size // 2:,} | {local_s:.1f} | {ray_s:.1f} | "
                        f"{images / local_s:,.0f} | {images / ray_s:,.0f} | {local_s / ray_s:.2f}x | "
                        f"{'yes' if equal else '**NO**'} |")
        fits[kind] = (line(sizes, walls["local"]), line(sizes, walls["ray"]))
    ray.shutdown()

    fit_lines = []
    for kind, (local, spread) in fits.items():
        point = crossover(local, spread)
        fit_lines.append(
            f"- {kind}: this process {local[0]:.1f} s + {local[1] * 1e3:.3f} ms per training image; 2 workers "
            f"{spread[0]:.1f} s + {spread[1] * 1e3:.3f} ms. "
            + (f"**2 workers are faster above about {point:,.0f} training images** (+ half as many test images)."
               if point is not None else "**2 workers are never faster on this machine**: their time per image is "
               "not below this process's, which already keeps both cores busy with PyTorch's threads."))
    largest = stats[(next(iter(kinds)), sizes[-1])]
    pool = largest[0]["pool_seconds"]
    second = largest[1]
    lines = [BEGIN, "## Coverage on Ray (`coverage --workers`)", "",
             f"`.venv/bin/python -m benchmarks.bench_coverage_ray --sizes {args.sizes} --delay {args.delay:g} "
             "--write`: LeNet-5 (DeepImportance weights), fit on N MNIST training images and score N/2 MNIST test "
             "images, every criterion, in this process "
             f"({torch.get_num_threads()} PyTorch threads) and on 2 Ray workers (1 CPU, 1 thread each; a new pool per "
             "run, as a command pays it); then the same with LeNet-5 waiting "
             f"{args.delay * 1000:g} ms before every forward call (a model on a remote accelerator). Wall time of "
             "fit + score, clustering, KDE and nearest neighbours on the driver included. One local Ray cluster with "
             f"2 CPUs, started before the clock. Machine: {os.cpu_count()} cores, load average {load:.1f} at the "
             "start.", "",
             "| model | images (fit + score) | this process s | 2 Ray workers s | this process images/s | "
             "Ray images/s | Ray speed-up | results equal |",
             "|---|---|---:|---:|---:|---:|---:|---|", *rows, "",
             "Lines fitted through the sizes (seconds = fixed + N x per training image):", "", *fit_lines, "",
             f"**One pool for the fit and the scoring.** In the largest plain run the pool started in {pool:.1f} s "
             f"(worker processes, PyTorch imports, model load) at the fit; the scoring pass reused it "
             f"({second['pool_seconds']:.2f} s) and only fetched its job and images "
             f"(longest load in a worker over the whole command: {second['load_seconds']:.1f} s). With Ray Data's "
             "map_batches (before) each pass started its own pool.", END]
    publish("\n".join(lines), BEGIN, END, write=args.write)


if __name__ == "__main__":
    main()
