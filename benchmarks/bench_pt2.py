"""What a pt2 (torch.export) model costs white-box: the rebuilt module tree vs the eager module.

    python -m benchmarks.bench_pt2 [--repeat 3] [--write]

For each model (the zoo's digits CNN and LeNet-5, torchvision's ResNet-18 and MobileNetV3-Small
with random weights at 64x64), in one run: the seconds to export and to rebuild, then per
batch the lower of ``--repeat`` timings of a plain forward pass, of one LRP pass (forward and
backward with zennit's rules, :func:`~mlflow_di.coverage.relevance.input_relevance`), and of an
IDC fit on 256 inputs, each on the eager module and on the module rebuilt from its exported
program, with the ratio rebuilt/eager. The two give the same numbers (tests/test_pt2.py); this
measures only the cost. ``--write`` puts the table in benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)

BATCH = 64
FIT_IMAGES = 256


def _models():
    from benchmarks.check_lrp_conservation import family_model
    from mlflow_di.models import zoo

    yield "digits-cnn", zoo.build("digits-cnn"), (8, 8, 1)
    yield "lenet5", zoo.build("lenet5"), (28, 28, 1)
    yield "resnet18", family_model("resnet18", 64), (64, 64, 3)
    yield "mobilenet_v3_small", family_model("mobilenet_v3_small", 64), (64, 64, 3)


def _best(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(repeat: int) -> list[dict]:
    import torch

    from mlflow_di.coverage.idc import ImportanceDrivenCoverage
    from mlflow_di.coverage.relevance import input_relevance
    from mlflow_di.data import ImageSet
    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.pt2 import rebuild
    from mlflow_di.models.torch_model import TorchModel

    rows = []
    rng = np.random.default_rng(0)
    for name, eager, shape in _models():
        height, width, channels = shape
        inputs = torch.rand(BATCH, channels, height, width, generator=torch.Generator().manual_seed(0))
        started = time.perf_counter()
        program = torch.export.export(eager.eval(), (inputs[:2],), dynamic_shapes=[{0: torch.export.Dim.AUTO}])
        exported = time.perf_counter() - started
        started = time.perf_counter()
        rebuilt = rebuild(program, name)
        rebuilt_s = time.perf_counter() - started
        images = rng.integers(0, 256, (FIT_IMAGES, *shape), dtype=np.uint8)
        prep = Preprocessing(input_shape=shape)
        labels = TorchModel(eager, prep).classifier().predict(images)  # every input "correctly classified"
        data = ImageSet(images, labels, "random")
        row = {"model": name, "export_s": round(exported, 2), "rebuild_s": round(rebuilt_s, 2)}
        for task, run in (
            ("forward", lambda module: module(inputs)),
            ("lrp", lambda module: input_relevance(module, inputs, progress=False)),
            ("idc_fit", lambda module: ImportanceDrivenCoverage(top_m=4, clusters=(2, 3), progress=False).fit(
                TorchModel(module, prep), data)),
        ):
            with torch.no_grad() if task == "forward" else torch.enable_grad():
                times = {kind: _best(lambda m=module: run(m), repeat) for kind, module in (("eager", eager),
                                                                                          ("rebuilt", rebuilt))}
            row[f"{task}_eager_s"] = round(times["eager"], 4)
            row[f"{task}_rebuilt_s"] = round(times["rebuilt"], 4)
            row[f"{task}_ratio"] = round(times["rebuilt"] / times["eager"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def section(rows: list[dict], command: str) -> str:
    import torch

    lines = ["<!-- bench_pt2 -->", "## pt2 (torch.export) models white-box: rebuilt vs eager (bench_pt2)", "",
             f"Command: `{command}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
             f"{torch.get_num_threads()} threads; batches of {BATCH}, IDC fitted on {FIT_IMAGES} random images "
             "labelled by the model; the lower of the timings per cell. Ratio = rebuilt / eager.", "",
             "| model | export s | rebuild s | forward ratio | LRP (fwd+bwd) s eager / rebuilt | LRP ratio | "
             "IDC fit s eager / rebuilt | IDC fit ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['export_s']} | {r['rebuild_s']} | {r['forward_ratio']}x | "
              f"{r['lrp_eager_s']} / {r['lrp_rebuilt_s']} | {r['lrp_ratio']}x | "
              f"{r['idc_fit_eager_s']} / {r['idc_fit_rebuilt_s']} | {r['idc_fit_ratio']}x |" for r in rows]
    lines += ["", "Rebuilding happens once per load (`models/pt2.py`); the rebuilt layers are the same `torch.nn` "
              "modules, and containers run their exported graph as `torch.fx` code. Outputs, activations and "
              "relevance are identical to the eager model's (`tests/test_pt2.py`).", "<!-- /bench_pt2 -->"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = measure(args.repeat)
    if args.write:
        from benchmarks.results import write_section

        write_section(section(rows, f"python -m benchmarks.bench_pt2 --repeat {args.repeat}"), "<!-- bench_pt2 -->",
                      "<!-- /bench_pt2 -->")


if __name__ == "__main__":
    main()
