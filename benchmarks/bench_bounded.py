"""Benchmark the bounded int8-static export (``compress --max-disagreement-rate``) and what it costs.

For each model and bound, in one run: one plain int8-static export (every layer quantized) scored
on the search split, the layer-wise diagnosis that ranks the layers, then the search
(:func:`mlflow_di.compression.bounded.bounded_int8_static`) and its held-out verification. The
table gives the fully quantized export's disagreements, the layers the search kept in float, the
chosen export's disagreements on the search and held-out splits (with the held-out rate's 95%
upper bound), the exports the search measured, and its wall time as a multiple of the plain
export's (export + scoring on the search split). Writes a section of benchmarks/RESULTS.md
between ``<!-- bench_bounded -->`` markers.

Models: the DeepImportance LeNet-1 and LeNet-5 (``../shared``; calibrated on MNIST train [0:500],
searched on MNIST test [0:5000], verified on [5000:10000]) and torchvision models with random
weights at 32x32 RGB (MNIST digits padded and repeated over 3 channels; their own predictions as the
labels, so accuracy drop and disagreement coincide; ``--torchvision-images`` per split). A random
ResNet-18 answers one class for every digit, so int8 cannot change its answers; a random
MobileNetV2's top logits are nearly tied, so int8 flips many: the search's hard case. Random
weights make degenerate classifiers, so ``resnet18-mnist`` is torchvision's ResNet-18 trained
here for ``--train-epochs`` on MNIST train [0:5000] (padded RGB), scored against MNIST's labels.

    .venv/bin/python -m benchmarks.bench_bounded [--shared ../shared] [--models lenet1,lenet5,resnet18,mobilenet_v2]
        [--bounds 0.003,0.0005] [--torchvision-bounds 0.003,0.05,0.2]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

from benchmarks.results import write_section
import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import torch

from mlflow_di.compression import compress, diagnose
from mlflow_di.compression.bounded import (
    BoundedTarget,
    Bounds,
    LabelledSplit,
    UnreachableBounds,
    bounded_int8_static,
    rank_layers,
)
from mlflow_di.compression.methods import calibration_inputs
from mlflow_di.compression.prune import prunable_layers
from mlflow_di.data import load_images

REPO = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_bounded -->", "<!-- /bench_bounded -->"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_shared = os.environ.get("MLFLOW_DI_SHARED", str(REPO.parent / "shared"))
    parser.add_argument("--shared", type=pathlib.Path, default=pathlib.Path(default_shared))
    parser.add_argument("--models", default="lenet1,lenet5,resnet18,mobilenet_v2,resnet18-mnist",
                        help="lenet1, lenet5 (../shared), torchvision families (random weights) and FAMILY-mnist "
                             "(trained here on MNIST)")
    parser.add_argument("--train-epochs", type=int, default=2, help="epochs for the FAMILY-mnist models")
    parser.add_argument("--bounds", default="0.003,0.0005", help="--max-disagreement-rate values for the LeNets")
    parser.add_argument("--torchvision-bounds", default="0.003,0.05,0.2",
                        help="--max-disagreement-rate values for the torchvision models")
    parser.add_argument("--torchvision-images", type=int, default=1000, help="images per split for torchvision models")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not touch RESULTS.md")
    return parser.parse_args()


def reference_lenet(shared: pathlib.Path, arch: str):
    from mlflow_di.models.loading import load_torch_model, resolve
    from mlflow_di.models.reference import ModelRef

    file = {"lenet1": "LeNet1.h5", "lenet5": "LeNet5.h5"}[arch]
    return load_torch_model(resolve(ModelRef.parse(f"keras:{arch}:{shared}/models/deepimportance/{file}")), None)


def as_rgb32(images: np.ndarray) -> np.ndarray:
    """MNIST 28x28x1 -> 32x32x3 (zero padding, the grey channel repeated)."""
    padded = np.pad(images[..., 0] if images.ndim == 4 else images, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(padded[..., None], 3, axis=-1).astype(np.uint8)


TORCHVISION_PREPROCESSING = dict(scale=1 / 255, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375),
                                 layout="NCHW", output="logits", input_shape=(32, 32, 3))
TRAINED_SUFFIX = "-mnist"


def torchvision_model(args, name: str):
    """``family``: random weights (``family_model``); ``family-mnist``: torchvision's own random init trained
    for ``--train-epochs`` on MNIST train [0:5000] as padded RGB digits."""
    import torchvision

    from benchmarks.check_lrp_conservation import family_model
    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.torch_model import TorchModel
    from mlflow_di.models.training import train_classifier

    preprocessing = Preprocessing(**TORCHVISION_PREPROCESSING)
    if not name.endswith(TRAINED_SUFFIX):
        return TorchModel(family_model(name).eval(), preprocessing, name=name)
    torch.manual_seed(0)
    model = TorchModel(getattr(torchvision.models, name.removesuffix(TRAINED_SUFFIX))(num_classes=10), preprocessing,
                       name=name)
    train = load_images(f"mnist-train:{args.shared}/data/mnist[0:5000]")
    start = time.perf_counter()
    train_classifier(model.module, model.to_tensor(as_rgb32(np.asarray(train.images[:]))),
                     torch.from_numpy(np.asarray(train.labels)), epochs=args.train_epochs, lr=1e-3, progress=False,
                     num_threads=None)
    print(f"{name}: trained {args.train_epochs} epochs in {time.perf_counter() - start:.0f} s", flush=True)
    model.module.eval()
    return model


def splits(args, name, source):
    """(calibration images, search split, held-out split) for one model."""
    mnist = f"{args.shared}/data/mnist"
    calib = load_images(f"mnist-train:{mnist}[0:500]")
    if not name.startswith("lenet"):
        count = args.torchvision_images
        test = load_images(f"mnist-test:{mnist}[0:{2 * count}]")
        images = as_rgb32(np.asarray(test.images[:]))
        predicted = source.classifier().predict(images)
        # a random model's own answers are its labels; a trained one is scored on MNIST's
        labels = np.asarray(test.labels) if name.endswith(TRAINED_SUFFIX) else predicted
        made = [LabelledSplit(f"mnist-test[{i * count}:{(i + 1) * count}] rgb32", images[i * count:(i + 1) * count],
                              labels[i * count:(i + 1) * count], predicted[i * count:(i + 1) * count]) for i in (0, 1)]
        return as_rgb32(np.asarray(calib.images[:])), made[0], made[1]
    made = []
    for part in ("0:5000", "5000:10000"):
        data = load_images(f"mnist-test:{mnist}[{part}]")
        images = np.asarray(data.images[:])
        made.append(LabelledSplit(f"mnist-test[{part}]", images, np.asarray(data.labels),
                                  source.classifier().predict(images)))
    return np.asarray(calib.images[:]), made[0], made[1]


def one_model(args, name, bounds_list, work):
    source = reference_lenet(args.shared, name) if name.startswith("lenet") else torchvision_model(args, name)
    calib, search, held_out = splits(args, name, source)
    layers = [layer for layer, _ in prunable_layers(source.module)]
    compress(source.module, source.preprocessing, "int8-static", work / name / "warm-up", calib_inputs=calib)
    start = time.perf_counter()
    plain = compress(source.module, source.preprocessing, "int8-static", work / name / "plain", calib_inputs=calib)
    plain_scores = search.score(plain.path)
    plain_seconds = time.perf_counter() - start
    held_plain = held_out.score(plain.path)
    start = time.perf_counter()
    diagnosis = diagnose(plain.float_path, plain.path, calibration_inputs(search.images, source.preprocessing))
    ranking = rank_layers(diagnosis, layers)
    diagnosis_seconds = time.perf_counter() - start
    rows = []
    for value in bounds_list:
        start = time.perf_counter()
        try:
            _, record = bounded_int8_static(source.module, source.preprocessing, calib,
                                            BoundedTarget(Bounds(max_disagreement_rate=value), search, held_out,
                                                          tuple(ranking)), work / name / str(value),
                                            first=plain, progress=False)
        except UnreachableBounds as unreachable:
            rows.append({"model": name, "bound": value, "layers": len(layers), "error": str(unreachable)})
            continue
        seconds = time.perf_counter() - start + diagnosis_seconds + plain_seconds
        chosen, held = record.chosen.search, record.held_out
        rows.append({"model": name, "bound": value, "layers": len(layers),
                     "plain": f"{plain_scores.disagreements}/{plain_scores.images}, held out "
                              f"{held_plain.disagreements}/{held_plain.images}",
                     "kept": ", ".join(record.kept_float) or "(none)", "kept_count": len(record.kept_float),
                     "search": f"{chosen.disagreements}/{chosen.images}",
                     "held_out": f"{held.disagreements}/{held.images} ({held.disagreement_rate:.2%}, upper 95% "
                                 f"{held.disagreement_upper_bound():.2%})",
                     "meets_held_out": not record.held_out_failures, "exports": record.exports,
                     "seconds": seconds, "plain_seconds": plain_seconds, "cost": seconds / plain_seconds})
        print(rows[-1], flush=True)
    return rows


def section(rows, args) -> str:
    lines = [
        "## Bounded int8 export (compress --max-disagreement-rate)", "",
        f"Command: `.venv/bin/python -m benchmarks.bench_bounded --models {args.models} --bounds {args.bounds} "
        f"--torchvision-bounds {args.torchvision_bounds}` "
        "(2 cores, CPU, ONNX Runtime; after one warm-up export per model). int8-static, MinMax calibration on MNIST "
        "train [0:500]; the search scores "
        "candidates on MNIST test [0:5000] and the choice is verified on [5000:10000] (torchvision models: "
        f"{args.torchvision_images} padded RGB digits per split; with random weights their own predictions are the "
        f"labels, `-mnist`: trained here for {args.train_epochs} epochs on MNIST train [0:5000]). *plain*: every layer "
        "int8 (disagreements with the float model, search / held-out split). *cost*: the bounded compress's wall "
        "time (plain export and scoring, diagnosis, search, verification) over the plain export's (export and "
        "scoring on the search split).", "",
        "| model | layers | bound | plain | kept in float | search | held out | meets held out | exports | cost |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['layers']} | {row['bound']:g} | | unreachable: {row['error']} | | | | | |")
            continue
        lines.append(f"| {row['model']} | {row['layers']} | {row['bound']:g} | {row['plain']} | {row['kept']} "
                     f"({row['kept_count']}) | {row['search']} | {row['held_out']} | "
                     f"{'yes' if row['meets_held_out'] else '**no**'} | {row['exports']} | "
                     f"{row['cost']:.1f}x ({row['seconds']:.0f} s / {row['plain_seconds']:.1f} s) |")
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-bounded-") as work:
        for name in args.models.split(","):
            bounds = args.bounds if name.startswith("lenet") else args.torchvision_bounds
            rows += one_model(args, name, [float(value) for value in bounds.split(",")], pathlib.Path(work))
    text = section(rows, args)
    print(text)
    if not args.no_write:
        write_section(f"{BEGIN}\n{text}{END}", BEGIN, END)


if __name__ == "__main__":
    main()
