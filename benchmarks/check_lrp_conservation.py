"""LRP conserves relevance on every torchvision family: input relevance sums to the explained logit.

    python -m benchmarks.check_lrp_conservation [--families resnet18,efficientnet_b0] [--draws 6] [--write]

Each family is made bias-free (every bias zeroed, every batch norm a pure scaling fitted to the
inputs), so that LRP-epsilon with a negligible epsilon must hand the whole logit to the input.
Per family and draw of 4 random 32x32 inputs it measures, as the largest |ratio - 1| over inputs:

- ``float32``: the product's :func:`~mlflow_di.coverage.relevance.input_relevance` summed, over
  the logit of the same canonized (batch norms merged) float32 forward pass that LRP runs;
- ``plain_f32_vs_f64``: the plain float32 logit over the float64 one: how well conditioned the
  model's own forward pass is in float32;
- ``merged_f32_vs_f64``: the canonized float32 logit over the float64 one;
- ``float64``: the same composite (rules and canonizers) run in float64, over the plain float64 logit.

Conservation is a property of the rules; ``float64`` shows it, ``float32`` shows it holds within
float32 rounding of the pass itself. When the model's float32 logits are far from its float64 ones,
the model, not LRP, is what float32 gets wrong. ``--write`` puts the table in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)

FAMILIES = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0",
            "vgg11_bn", "densenet121", "squeezenet1_0")
SIZE = 32
INPUTS = 4
BEGIN, END = "<!-- check_lrp_conservation -->", "<!-- /check_lrp_conservation -->"


def family_model(family: str, size: int = SIZE):
    """The family's torchvision model with 10 classes, seeded; VGG gets a narrow head (its stock
    head alone has 120M weights, which would only make a test slow, not different).

    Random init is made to behave like a trained net in one respect that matters here: its batch
    norms get statistics from one pass over random images, and its last layer larger weights.
    Freshly built MobileNets output logits of about 1e-9 (unit running variances with activations
    far smaller), whose top-1 label flips with the batch size, so IDC found no "correctly
    classified" inputs.
    """
    import torch
    import torchvision
    from torch import nn

    torch.manual_seed(0)
    model = getattr(torchvision.models, family)(num_classes=10)
    if family.startswith("vgg"):
        model.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        model.classifier = nn.Sequential(nn.Linear(512, 64), nn.ReLU(), nn.Dropout(), nn.Linear(64, 10))
    head = [layer for layer in model.modules() if isinstance(layer, (nn.Linear, nn.Conv2d))][-1]
    nn.init.normal_(head.weight, std=10.0 / head.weight[0].numel() ** 0.5)
    for layer in model.modules():
        if isinstance(layer, nn.BatchNorm2d):
            layer.momentum = None  # a cumulative average: one pass sets the statistics
    model.train()
    with torch.no_grad():
        model(torch.rand(16, 3, size, size, generator=torch.Generator().manual_seed(0)) * 4 - 2)
    return model.eval()


def bias_free(model, inputs):
    """Zero every bias and make each batch norm a pure scaling (zero mean) fitted to ``inputs``, so
    that LRP-epsilon must conserve relevance exactly (nothing is absorbed by biases)."""
    import torch
    from torch import nn

    for module in model.modules():
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = 1.0
    model.train()
    with torch.no_grad():
        model(inputs)
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.zero_()
    return model


def lrp_logits(model, inputs):
    """The model's logits as the LRP pass computes them: canonized (batch norms merged into the
    convolutions, residual sums stacked), in the inputs' dtype."""
    import torch

    from mlflow_di.coverage.relevance import lrp_composite

    with lrp_composite().context(model) as canonized, torch.no_grad():
        return canonized(inputs)


def _float64_relevance(model, inputs):
    """Input relevance from the product's composite run in float64 (zennit directly; the product's
    batching casts to float32)."""
    import torch

    from mlflow_di.coverage.canonizers import out_of_place
    from mlflow_di.coverage.relevance import lrp_composite

    x = inputs.double().requires_grad_(True)
    with out_of_place(model), lrp_composite(epsilon=1e-20).context(model) as hooked:
        logits = hooked(x)
        top = logits.argmax(dim=1, keepdim=True)
        seed = torch.zeros_like(logits).scatter(1, top, logits.detach().gather(1, top))
        (relevance,) = torch.autograd.grad(logits, x, grad_outputs=seed)
    return relevance.detach().reshape(len(x), -1).sum(dim=1).numpy()


def measure(family: str, draws: int) -> dict:
    import torch

    from mlflow_di.coverage.relevance import input_relevance

    worst = {"float32": 0.0, "plain_f32_vs_f64": 0.0, "merged_f32_vs_f64": 0.0, "float64": 0.0}
    for draw in range(draws):
        torch.manual_seed(1000 + draw)
        inputs = torch.rand(INPUTS, 3, SIZE, SIZE)
        model = bias_free(family_model(family), inputs)
        merged32 = lrp_logits(model, inputs).max(dim=1).values.numpy()
        relevance32 = input_relevance(model, inputs, epsilon=1e-20, progress=False).reshape(INPUTS, -1).sum(axis=1)
        with torch.no_grad():
            plain32 = model(inputs).max(dim=1).values.numpy()
        model64 = model.double()
        with torch.no_grad():
            plain64 = model64(inputs.double()).max(dim=1).values.numpy()
        relevance64 = _float64_relevance(model64, inputs)
        for key, ratio in (("float32", relevance32 / merged32), ("plain_f32_vs_f64", plain32 / plain64),
                           ("merged_f32_vs_f64", merged32 / plain64), ("float64", relevance64 / plain64)):
            worst[key] = max(worst[key], float(np.abs(ratio - 1).max()))
    return {"family": family, "draws": draws, "inputs": draws * INPUTS, **worst}


def section(rows: list[dict], command: str) -> str:
    lines = [BEGIN, "## LRP conservation on the torchvision families (check_lrp_conservation)", "",
             f"Command: `{command}`  ",
             "Bias-free random-init models at 32x32 (every bias zeroed, batch norms pure scalings), LRP-epsilon "
             "with epsilon 1e-20; each figure is the largest |ratio - 1| over the inputs. The first two columns "
             "are LRP's conservation (in float32 against the logit of the same canonized pass, in float64 with the "
             "same rules); the last two say how far the model's own float32 logits are from float64 ones, which "
             "is what the earlier, larger gaps measured against the plain forward pass were.", "",
             "| family | inputs | float32: sum R / LRP pass's logit | float64: sum R / logit "
             "| plain float32 logit / float64 | merged float32 logit / float64 |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['inputs']} | {r['float32']:.1e} | {r['float64']:.1e} "
                     f"| {r['plain_f32_vs_f64']:.1e} | {r['merged_f32_vs_f64']:.1e} |")
    lines += ["", "```", *(json.dumps(r) for r in rows), "```", END]
    return "\n".join(lines)


def main() -> None:
    import sys

    from benchmarks.results import write_section

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--draws", type=int, default=6)
    parser.add_argument("--write", action="store_true", help="put the table in benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    for family in args.families.split(","):
        rows.append(measure(family, args.draws))
        print(json.dumps(rows[-1]), flush=True)
    if args.write:
        command = "python -m benchmarks.check_lrp_conservation " + " ".join(sys.argv[1:])
        write_section(section(rows, command), BEGIN, END)


if __name__ == "__main__":
    main()
