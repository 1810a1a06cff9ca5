"""CPU and CUDA give the same results: relevance, activations, IDC and a fuzz campaign, side by side.

    python -m benchmarks.check_devices [--family resnet18] [--size 64]

Prints one JSON object: the largest relative differences and whether IDC picked the same neurons
and scored the same coverage on both devices. Needs a CUDA GPU (exits with a message otherwise).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)


def main() -> None:
    import torch

    from benchmarks.bench_scale import IMAGENET, random_torchvision_model
    from mlflow_di.coverage.idc import ImportanceDrivenCoverage
    from mlflow_di.coverage.relevance import layer_relevance
    from mlflow_di.data import ImageSet
    from mlflow_di.models.device import describe_device
    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.torch_model import TorchModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="resnet18")
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: nothing to compare")
    module = random_torchvision_model(args.family)
    preprocessing = Preprocessing(input_shape=(args.size, args.size, 3), **IMAGENET)
    images = np.random.default_rng(0).integers(0, 256, (128, args.size, args.size, 3), dtype=np.uint8)
    models = {device: TorchModel(copy.deepcopy(module), preprocessing, args.family).to(device)
              for device in ("cpu", "cuda")}
    labels = models["cpu"].classifier().predict(images)
    data = ImageSet(images, labels, "generated")
    out = {"family": args.family, "gpu": describe_device("cuda"), "torch": torch.__version__}
    probabilities = {d: m.classifier().predict_proba(images) for d, m in models.items()}
    out["probabilities_max_abs_diff"] = float(np.abs(probabilities["cpu"] - probabilities["cuda"]).max())
    out["top1_agreement"] = float(np.mean(probabilities["cpu"].argmax(1) == probabilities["cuda"].argmax(1)))
    layer = "layer4" if hasattr(module, "layer4") else "features"
    relevance = {d: layer_relevance(m.module, m.to_tensor(images[:32]), layer, progress=False)
                 for d, m in models.items()}
    scale = np.abs(relevance["cpu"].relevance[layer]).max()
    out["relevance_max_diff_relative_to_max"] = float(
        np.abs(relevance["cpu"].relevance[layer] - relevance["cuda"].relevance[layer]).max() / scale)
    fitted = {d: ImportanceDrivenCoverage(layers=layer, top_m=6, progress=False).fit(m, data) for d, m in models.items()}
    neurons = {d: f.fitted_layers_[layer].important_neurons.tolist()
               for d, f in fitted.items()}
    scores = {d: f.score(data).idc for d, f in fitted.items()}
    out.update(idc_cpu=scores["cpu"], idc_cuda=scores["cuda"], important_neurons_cpu=str(neurons["cpu"]),
               important_neurons_cuda=str(neurons["cuda"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
