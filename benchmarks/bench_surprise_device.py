"""LSA and DSA on the host (NumPy) vs by torch on ``--device`` (coverage/surprise_device.py), in one run.

Random SA traces (``--train`` training traces of ``--neurons`` values in ``--classes`` classes, ``--test`` test
traces): DSA's fit (each training trace's distance to the nearest trace of another class, the quadratic step),
DSA's and LSA's scoring. Seconds of each, best of ``--runs``, and the largest relative difference of the
values between the two sides (they sum in another order). On ``cpu`` torch's CPU stands in for a GPU: both
sides then run on the same cores; on ``cuda`` the device side is what a CUDA model's coverage uses.

    .venv/bin/python -m benchmarks.bench_surprise_device [--device cpu] [--train 10000] [--test 2000]
"""
from __future__ import annotations

import argparse
import json

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np

from benchmarks.bench_idc import best_time
from mlflow_di.coverage.criteria_surprise import DistanceSurprise, LikelihoodSurprise
from mlflow_di.models.device import describe_device, resolve_device


def _largest_relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    finite = np.isfinite(a) & np.isfinite(b)
    return float(np.max(np.abs(a[finite] - b[finite]) / np.maximum(np.abs(a[finite]), 1e-300), initial=0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--train", type=int, default=10_000)
    parser.add_argument("--test", type=int, default=2_000)
    parser.add_argument("--neurons", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    device = resolve_device(args.device)
    rng = np.random.default_rng(0)
    train, test = rng.normal(size=(args.train, args.neurons)), rng.normal(size=(args.test, args.neurons))
    train_classes, test_classes = rng.integers(0, args.classes, args.train), rng.integers(0, args.classes, args.test)
    row = {"benchmark": "surprise_device", "device": describe_device(device), "train": args.train, "test": args.test,
           "neurons": args.neurons, "classes": args.classes}
    fitted = {}
    for side, on in (("host", None), ("device", device)):
        seconds, fitted[side] = best_time(lambda: DistanceSurprise().fit(train, train_classes, device=on), args.runs)
        row[f"dsa_fit_{side}_s"] = round(seconds, 4)
    row["dsa_fit_difference"] = _largest_relative_difference(fitted["host"].nearest_other_,
                                                             fitted["device"].nearest_other_)
    likelihood = LikelihoodSurprise().fit(train, train_classes)
    for name, model in (("dsa", fitted["host"]), ("lsa", likelihood)):
        values = {}
        for side, on in (("host", None), ("device", device)):
            seconds, values[side] = best_time(lambda: model.score_samples(test, test_classes, device=on), args.runs)
            row[f"{name}_score_{side}_s"] = round(seconds, 4)
        row[f"{name}_difference"] = _largest_relative_difference(values["host"], values["device"])
    print(json.dumps(row))


if __name__ == "__main__":
    main()
