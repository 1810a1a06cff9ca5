"""Train the IDC paper's LeNet-1/4/5 from scratch with the project site's recipe; test accuracy per seed.

Recipe (../shared/notes/deepimportance.md): Adadelta lr 1.0, rho 0.95 (Keras 2 defaults, epsilon
1e-7), batch 256, 10 epochs, categorical cross-entropy, Keras' default initialisation (Glorot-
uniform weights, zero biases), on the 60,000-image MNIST training split; accuracy on the 10,000
test images. The paper's Table 1: 98.33 / 98.59 / 98.96; the released .h5 files score
98.08 / 98.56 / 98.79.

    python -m benchmarks.train_reference_lenets [--shared ../shared] [--seeds 0,1,2] [--device auto] [--write]

``--write`` replaces this script's section of benchmarks/REPRODUCTION.md.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)

PAPER = {"lenet1": 98.33, "lenet4": 98.59, "lenet5": 98.96}
RELEASED = {"lenet1": 98.08, "lenet4": 98.56, "lenet5": 98.79}
BEGIN, END = "<!-- train_reference_lenets -->", "<!-- /train_reference_lenets -->"


def _split(folder: pathlib.Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    from mlflow_di.data import read_idx

    return (read_idx(folder / f"{prefix}-images-idx3-ubyte.gz")[..., None],
            read_idx(folder / f"{prefix}-labels-idx1-ubyte.gz"))


def train_model(arch: str, seed: int, device, images: np.ndarray, labels: np.ndarray, epochs: int = 10):
    """A zoo ``arch`` trained from scratch by the site's recipe on raw uint8 ``images``; (TorchModel, losses).

    Keras' initialisation seeded by ``seed``; the batch order too. Also used by the reproduction
    harness's RQ6 (benchmarks/reproduce/idc_rq6.py) to retrain LeNet-5 on augmented training sets.
    """
    import torch

    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel
    from mlflow_di.models.training import keras_initialise, train_classifier

    spec = zoo.architecture(arch)
    model = TorchModel(keras_initialise(zoo.build(arch, seed=seed), seed), spec.preprocessing, arch).to(device)
    torch.manual_seed(seed)
    losses = train_classifier(model.module, model.to_tensor(images), torch.from_numpy(np.asarray(labels).astype(np.int64)),
                              epochs=epochs, lr=1.0, batch_size=256, seed=seed, progress=False, optimizer="adadelta",
                              num_threads=None)
    return model, losses


def train_one(arch: str, seed: int, device, train, test) -> dict:
    started = time.perf_counter()
    model, losses = train_model(arch, seed, device, train[0], train[1])
    accuracy = float(np.mean(model.classifier().predict(test[0]) == test[1]))
    return {"arch": arch, "seed": seed, "test_accuracy": round(100 * accuracy, 2), "final_loss": round(losses[-1], 4),
            "seconds": round(time.perf_counter() - started, 1), "device": str(model.device)}


def render(rows: list[dict], command: str) -> str:
    lines = [BEGIN, "## Training the reference LeNets from scratch (paper Table 1)", "",
             f"Configuration: `{command}`; the site's recipe (Adadelta lr 1.0, rho 0.95, batch 256, 10 epochs, "
             "categorical cross-entropy, Keras' Glorot-uniform init) on the 60,000 MNIST training images; "
             "test accuracy (%) on the 10,000 test images.", "",
             "| model | seeds | test accuracy per seed | mean | paper Table 1 | released .h5 |", "|---|---|---|---:|---:|---:|"]
    for arch in PAPER:
        mine = [r for r in rows if r["arch"] == arch]
        if not mine:
            continue
        values = [r["test_accuracy"] for r in mine]
        lines.append(f"| {arch} | {', '.join(str(r['seed']) for r in mine)} | {', '.join(f'{v:.2f}' for v in values)} | "
                     f"{np.mean(values):.2f} | {PAPER[arch]:.2f} | {RELEASED[arch]:.2f} |")
    lines += ["", "```", *(json.dumps(r) for r in rows), "```", END]
    return "\n".join(lines)


def main() -> None:
    from mlflow_di.models.device import resolve_device

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--archs", default="lenet1,lenet4,lenet5")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    folder = pathlib.Path(args.shared) / "data" / "mnist"
    train, test = _split(folder, "train"), _split(folder, "t10k")
    device = resolve_device(args.device)
    rows = []
    for arch in args.archs.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            rows.append(train_one(arch, seed, device, train, test))
            print(json.dumps(rows[-1]), flush=True)
    if args.write:
        from benchmarks.results import write_section

        write_section(render(rows, "python -m benchmarks.train_reference_lenets " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k not in ("write", "shared"))),
            BEGIN, END, pathlib.Path(__file__).resolve().parent / "REPRODUCTION.md")


if __name__ == "__main__":
    main()
