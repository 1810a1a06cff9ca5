"""What pt2 and ONNX models cost white-box: the module rebuilt from each format vs the eager module.

    python -m benchmarks.bench_white_box [--repeat 3] [--write]

For each model (the zoo's digits CNN and LeNet-5, torchvision's ResNet-18 and MobileNetV3-Small
with random weights at 64x64), in one run: the seconds to export and to rebuild, then per
batch the lower of ``--repeat`` timings of a plain forward pass, of one LRP pass (forward and
backward with zennit's rules, :func:`~mlflow_di.coverage.relevance.input_relevance`), and of an
IDC fit on 256 inputs, on the eager module, on the module rebuilt from its pt2 program
(:mod:`mlflow_di.models.pt2`) and on the white-box view of its ONNX export (TorchScript exporter,
:mod:`mlflow_di.models.onnx_torch`), with the ratios to eager. Their numbers agree
(tests/test_pt2.py, tests/test_onnx_torch.py); this measures only the cost. ``--write`` puts the
table in benchmarks/RESULTS.md.
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


def _onnx_view(eager, inputs, name):
    import contextlib
    import io
    import tempfile

    import torch

    from mlflow_di.models.onnx_torch import onnx_to_torch

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):
        path = f"{folder}/model.onnx"
        torch.onnx.export(eager, (inputs[:2],), path, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "n"}})
        started = time.perf_counter()
        view = onnx_to_torch(path, name)
        return view, time.perf_counter() - started


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
        onnx_view, onnx_s = _onnx_view(eager, inputs, name)
        images = rng.integers(0, 256, (FIT_IMAGES, *shape), dtype=np.uint8)
        prep = Preprocessing(input_shape=shape)
        labels = TorchModel(eager, prep).classifier().predict(images)  # every input "correctly classified"
        data = ImageSet(images, labels, "random")
        row = {"model": name, "export_s": round(exported, 2), "rebuild_s": round(rebuilt_s, 2),
               "onnx_view_s": round(onnx_s, 2)}
        for task, run in (
            ("forward", lambda module: module(inputs)),
            ("lrp", lambda module: input_relevance(module, inputs, progress=False)),
            ("idc_fit", lambda module: ImportanceDrivenCoverage(top_m=4, clusters=(2, 3), progress=False).fit(
                TorchModel(module, prep), data)),
        ):
            with torch.no_grad() if task == "forward" else torch.enable_grad():
                times = {kind: _best(lambda m=module: run(m), repeat)
                         for kind, module in (("eager", eager), ("rebuilt", rebuilt), ("onnx", onnx_view))}
            row[f"{task}_eager_s"] = round(times["eager"], 4)
            for kind in ("rebuilt", "onnx"):
                row[f"{task}_{kind}_s"] = round(times[kind], 4)
                row[f"{task}_{kind}_ratio"] = round(times[kind] / times["eager"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def section(rows: list[dict], command: str) -> str:
    import torch

    lines = ["<!-- bench_white_box -->", "## pt2 and ONNX models white-box vs the eager module (bench_white_box)", "",
             f"Command: `{command}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with "
             f"{torch.get_num_threads()} threads; batches of {BATCH}, IDC fitted on {FIT_IMAGES} random images "
             "labelled by the model; the lower of the timings per cell. Ratios are to the eager module.", "",
             "| model | pt2 export s | pt2 rebuild s | ONNX view s | forward pt2 / ONNX | LRP (fwd+bwd) s eager | "
             "LRP pt2 / ONNX | IDC fit s eager | IDC fit pt2 / ONNX |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['export_s']} | {r['rebuild_s']} | {r['onnx_view_s']} | "
              f"{r['forward_rebuilt_ratio']}x / {r['forward_onnx_ratio']}x | {r['lrp_eager_s']} | "
              f"{r['lrp_rebuilt_ratio']}x / {r['lrp_onnx_ratio']}x | {r['idc_fit_eager_s']} | "
              f"{r['idc_fit_rebuilt_ratio']}x / {r['idc_fit_onnx_ratio']}x |" for r in rows]
    lines += ["", "Rebuilding happens once per load; the rebuilt layers are plain `torch.nn` modules and containers "
              "run their graph as `torch.fx` code. The pt2 model's outputs, activations and relevance are identical to "
              "the eager model's (`tests/test_pt2.py`); the ONNX view's match to float32 rounding, the exporter having "
              "folded batch norms into convolutions (`tests/test_onnx_torch.py`).", "<!-- /bench_white_box -->"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = measure(args.repeat)
    if args.write:
        from benchmarks.results import write_section

        write_section(section(rows, f"python -m benchmarks.bench_white_box --repeat {args.repeat}"),
                      "<!-- bench_white_box -->", "<!-- /bench_white_box -->")


if __name__ == "__main__":
    main()
