"""A campaign whose batches stay on the models' device vs one that copies each batch to the host and back,
in one run.

When a campaign's operators and both models run on one device (PyTorch models on a GPU), a step's mutants
stay there as the models' batch (:func:`~mlflow_di.fuzz.population.apply_mutations_on_device`). The "copied"
side turns that off (``lockstep.takes_device_batches`` answers no): the mutants come to the host's rows and
the models send them back, as before. The "kept" side answers yes for PyTorch models, on any device. Both
models are bench_scale's near-free ``tiny_cnn`` (2.8M multiply-adds at 224 px), so the copies are a visible
share; the operators and the models run on ``--device``. On ``cpu`` torch stands in for the device and a
"copy" is a host memcpy into rows the campaign reuses, so nothing is saved there (which is why a real CPU
campaign keeps its rows, see ``takes_device_batches``); a GPU's copies cross PCIe and wait for the device.
Also checks both sides give the same records.

    .venv/bin/python -m benchmarks.bench_device_batch [--device cpu] [--seeds 64] [--queries 30] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import time

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np

from benchmarks.bench_scale import IMAGENET, tiny_cnn
from mlflow_di.data import ImageSet
from mlflow_di.fuzz import lockstep
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.device_mutations import with_operators_on
from mlflow_di.fuzz.dflare import DFlare
from mlflow_di.fuzz.results import comparable_records
from mlflow_di.models.classifier import TorchClassifier
from mlflow_di.models.device import describe_device, resolve_device
from mlflow_di.models.preprocessing import Preprocessing

#: lockstep's check as it is: a step's batch stays on the device when both models run there (not on the CPU)
CHECK = lockstep.takes_device_batches


def _copies(model, device) -> bool:
    """The "copied" side: no model takes a device batch, so every step comes to the host."""
    return False


def _keeps(model, device) -> bool:
    """The "kept" side: every PyTorch model takes the device's batch (on a GPU, the check as it is)."""
    return isinstance(model, TorchClassifier)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--seeds", type=int, default=64)
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device(args.device)
    preprocessing = Preprocessing(input_shape=(args.size, args.size, 3), **IMAGENET)
    original = TorchClassifier(tiny_cnn().to(device), preprocessing, "tiny-cnn")
    compressed = TorchClassifier(tiny_cnn().to(device), preprocessing, "tiny-cnn-copy")  # same weights: full budgets
    images = np.random.default_rng(0).integers(0, 256, (args.seeds, args.size, args.size, 3), dtype=np.uint8)
    seeds = ImageSet(images, np.zeros(args.seeds, np.int64), f"generated {args.seeds}x{args.size}x{args.size}")
    strategy = with_operators_on(DFlare(), device)

    def campaign():
        started = time.perf_counter()
        result = run_campaign(original, compressed, seeds, strategy=strategy, max_queries=args.queries, timeout=1e9,
                              batch=args.seeds, progress=False)
        queries = max(sum(record.queries for record in result.records), 1)
        return (time.perf_counter() - started) / queries, result

    def side(check):
        lockstep.takes_device_batches = check
        try:
            return campaign()
        finally:
            lockstep.takes_device_batches = CHECK

    side(_keeps)  # warm-up
    for run in range(args.runs):
        copied, copied_result = side(_copies)
        kept, kept_result = side(_keeps)
        print(json.dumps({"benchmark": "device_batch", "run": run + 1, "device": describe_device(device),
                          "size": args.size, "seeds": args.seeds, "queries": args.queries,
                          "copied_ms_per_query": round(copied * 1e3, 4), "kept_ms_per_query": round(kept * 1e3, 4),
                          "ratio": round(copied / kept, 3),
                          "same_records": comparable_records(copied_result) == comparable_records(kept_result)}))


if __name__ == "__main__":
    main()
