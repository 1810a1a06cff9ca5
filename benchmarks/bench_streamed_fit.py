"""A streamed IDC fit (``coverage`` on data bigger than memory, or ``--workers``) with its model traced once a
pass vs once a batch, in one run.

A fit split into batches (:class:`~mlflow_di.coverage.partials.FitJob`) runs a relevance pass per batch, and
each pass used to trace the model with fx twice: for its batch-norm pairs and for tensor arithmetic no
canonizer handles. Now the job keeps what the first batch's traces found
(:func:`~mlflow_di.coverage.canonizers.traced_once`). The "once a batch" side clears that memory before every
batch, which is the earlier behaviour. Random-init mobilenet_v3_small at 224 px (its traces cost the most
of the torchvision families here), IDC alone, LocalPasses; seconds of the whole fit, the two sides
alternating, after a warm-up.

    .venv/bin/python -m benchmarks.bench_streamed_fit [--images 128] [--batch-size 16] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import time

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import torch
import torchvision

from benchmarks.bench_scale import IMAGENET
from mlflow_di.coverage import partials
from mlflow_di.coverage.partials import LocalPasses
from mlflow_di.coverage.suite import CoverageSuite
from mlflow_di.data import ImageSet
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel

#: FitJob.__call__ as it is: what the first batch's traces found is kept for the others
KEPT = partials.FitJob.__call__


def traced_every_batch(job, *args, **kwargs):
    """FitJob.__call__ as it was: nothing kept from an earlier batch's traces."""
    job._traced.clear()
    return KEPT(job, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TorchModel(torchvision.models.mobilenet_v3_small().eval(),
                       Preprocessing(input_shape=(224, 224, 3), **IMAGENET), "mobilenet_v3_small")
    images = np.random.default_rng(0).integers(0, 256, (args.images, 224, 224, 3), dtype=np.uint8)
    data = ImageSet(images, model.classifier().predict(images, 32), f"generated {args.images}x224x224")

    def fit() -> float:
        started = time.perf_counter()
        CoverageSuite(criteria="idc", only_correct=False, batch_size=args.batch_size, progress=False).fit(
            model, data, passes=LocalPasses())
        return time.perf_counter() - started

    fit()  # warm-up
    for run in range(args.runs):
        partials.FitJob.__call__ = traced_every_batch
        try:
            every = fit()
        finally:
            partials.FitJob.__call__ = KEPT
        once = fit()
        print(json.dumps({"benchmark": "streamed_fit", "run": run + 1, "images": args.images,
                          "batches": -(-args.images // args.batch_size), "traced_every_batch_s": round(every, 3),
                          "traced_once_s": round(once, 3), "ratio": round(every / once, 2)}))


if __name__ == "__main__":
    main()
