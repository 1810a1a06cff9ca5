"""The cell criteria (NC, KMNC, NBC/SNAC, TKNC) on the host and where the activations are, in one run.

ResNet-18's hidden layers as :func:`~mlflow_di.coverage.activations.hidden_layers` picks them (conv1,
layer1..layer4: 64 + 64 + 128 + 256 + 512 = 1,024 neurons), ReLU-like values (half of them zero, so
TKNC sorts many ties), training bounds from a first set, then a scored set of ``--images`` inputs:

- host: what the host pass does, the NumPy criteria on the whole set (:func:`criteria.batch_cells`);
- device: what a CUDA pass does, the torch criteria batch by batch on ``--device``
  (:class:`criteria.DeviceCells`' functions), the cells ``|``-ed there and copied back once.

Both give the same cells (checked every run). Milliseconds per image, best of five.

    .venv/bin/python -m benchmarks.bench_criteria_cells [--device cpu|cuda] [--images 2048] [--batch-size 256]
"""
from __future__ import annotations

import argparse
import json
import time

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import torch

from mlflow_di.coverage.criteria import Batch, ClassicCoverage, batch_cells
from mlflow_di.models.device import describe_device, resolve_device

#: ResNet-18's hidden layers' channels (conv1, layer1 .. layer4)
RESNET18_WIDTHS = (64, 64, 128, 256, 512)
CELL_CRITERIA = ("nc", "kmnc", "nbc", "snac", "tknc")


def relu_like(rng, rows: int) -> np.ndarray:
    values = rng.gamma(2.0, 1.0, (rows, sum(RESNET18_WIDTHS))).astype(np.float32)
    values[rng.random(values.shape) < 0.5] = 0.0
    return values


def best_of(repeats: int, work, device) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    device = resolve_device(args.device)
    rng = np.random.default_rng(0)
    train, test = relu_like(rng, 2048), relu_like(rng, args.images)
    scaled = rng.random(test.shape, dtype=np.float32)
    estimator = ClassicCoverage(criteria=CELL_CRITERIA, layers=[f"l{i}" for i in range(5)])
    low, high = train.min(axis=0).astype(np.float64), train.max(axis=0).astype(np.float64)

    def on_host():
        return batch_cells(CELL_CRITERIA, Batch(test, scaled, low, high, RESNET18_WIDTHS), estimator)

    batches = [(torch.from_numpy(test[s:s + args.batch_size]).to(device),
                torch.from_numpy(scaled[s:s + args.batch_size]).to(device))
               for s in range(0, len(test), args.batch_size)]
    low_t, high_t = (torch.from_numpy(bound).to(device) for bound in (low, high))

    def on_device():
        cells = {}
        for values, batch_scaled in batches:
            batch = Batch(values, batch_scaled, low_t, high_t, RESNET18_WIDTHS)
            for field, covered in batch_cells(CELL_CRITERIA, batch, estimator, on_device=True).items():
                cells[field] = covered if field not in cells else cells[field] | covered
        return {field: covered.cpu().numpy() for field, covered in cells.items()}

    host, moved = on_host(), on_device()
    same = host.keys() == moved.keys() and all(np.array_equal(host[f], moved[f]) for f in host)
    host_s, device_s = best_of(5, on_host, torch.device("cpu")), best_of(5, on_device, device)
    print(json.dumps({"benchmark": "criteria_cells", "device": describe_device(device), "images": args.images,
                      "batch": args.batch_size, "neurons": sum(RESNET18_WIDTHS),
                      "host_ms_per_image": round(host_s / args.images * 1e3, 4),
                      "device_ms_per_image": round(device_s / args.images * 1e3, 4),
                      "host_over_device": round(host_s / device_s, 2), "same_cells": same}))
    if not same:
        raise SystemExit("the device's cells differ from the host's")


if __name__ == "__main__":
    main()
