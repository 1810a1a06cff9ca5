"""The same exports on ONNX Runtime and OpenVINO: how many answers differ, and how fast each runs, in one run.

DI LeNet-5 (../shared, imported from its Keras weights) is compressed with ``compress --method
int8-static,prune-l1,int8-nncf`` (int8-nncf where NNCF is installed; calibration mnist-train[0:500]) and each
export is scored on the MNIST test images by ``--runtime onnxruntime,openvino,openvino:f32``: the figures are
the command's own metrics
(``runtime.SLUG.top1_differs_from_first``, ``max_probability_difference``, disagreement with the source).
Then each runtime classifies the same images in batches of 256, in turns (``--repeat`` times), for the
speed ratio OpenVINO / ONNX Runtime. OpenVINO's default precision is the host's (bf16 on CPUs with it).

    .venv/bin/python -m benchmarks.bench_runtimes [--images 10000] [--repeat 3] [--write]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import tempfile
import time

import mlflow_di  # noqa: F401  (torchvision guard first)

BEGIN, END = "<!-- bench_runtimes -->", "<!-- /bench_runtimes -->"
RUNTIMES = ("onnxruntime", "openvino", "openvino:f32")
METHODS = ("int8-static", "prune-l1")  # and int8-nncf (NNCF's int8 for OpenVINO) where nncf is installed


def measure(images: int, repeat: int, shared: str) -> dict:
    import mlflow

    from mlflow_di.cli import main
    from mlflow_di.data import load_images
    from mlflow_di.models.loading import load_classifier
    from mlflow_di.models.runtimes import RuntimeChoice

    folder = tempfile.mkdtemp(prefix="bench-runtimes-")
    mlflow.set_tracking_uri(f"sqlite:///{folder}/mlflow.db")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder}/mlflow.db"
    model = f"keras:lenet5:{shared}/models/deepimportance/LeNet5.h5"
    data = f"mnist-test:{shared}/data/mnist[0:{images}]"
    methods = METHODS + (("int8-nncf",) if importlib.util.find_spec("nncf") else ())
    code = main(["compress", "--model-uri", model, "--method", ",".join(methods), "--calib-data",
                 f"mnist-train:{shared}/data/mnist[0:500]", "--eval-data", data, "--runtime", ",".join(RUNTIMES),
                 "--no-benefit"])
    if code != 0:
        raise SystemExit(f"compress failed with exit code {code}")
    client = mlflow.MlflowClient()
    test = load_images(data).images
    rows = []
    for method in methods:
        version = client.get_model_version(f"lenet5-{method}", "1")
        metrics, tags = client.get_run(version.run_id).data.metrics, version.tags
        row = {"method": method, "images": int(metrics["eval_images"]), "ort_disagreements": int(metrics["disagreements"])}
        for label in RUNTIMES[1:]:
            slug = RuntimeChoice.parse(label).slug
            row[label] = {"precision": tags[f"mlflow_di.runtimes.{slug}.precision"],
                          "differs": int(metrics[f"runtime.{slug}.top1_differs_from_first"]),
                          "max_difference": metrics[f"runtime.{slug}.max_probability_difference"],
                          "disagreements": int(metrics[f"runtime.{slug}.disagreements"])}
        seconds = {label: [] for label in RUNTIMES}
        models = {label: load_classifier(f"models:/lenet5-{method}/1", runtime=label) for label in RUNTIMES}
        for _ in range(repeat):
            for label, classifier in models.items():
                started = time.perf_counter()
                classifier.predict_proba(test, batch_size=256)
                seconds[label].append(time.perf_counter() - started)
        row["seconds"] = {label: statistics.median(values) for label, values in seconds.items()}
        row["versions"] = tags.get("mlflow_di.runtime.onnxruntime"), tags.get("mlflow_di.runtimes.openvino.openvino")
        rows.append(row)
    return {"rows": rows, "images": images, "repeat": repeat}


def render(result: dict) -> str:
    from mlflow_di.models.execution import cpu_model, int8_features

    ort, ov = result["rows"][0]["versions"]
    lines = [BEGIN, "## The same export on ONNX Runtime and OpenVINO (bench_runtimes)", "",
             f"`.venv/bin/python -m benchmarks.bench_runtimes --images {result['images']} --repeat {result['repeat']} "
             f"--write`: DI LeNet-5's {', '.join(row['method'] for row in result['rows'])} exports (compress, calibration "
             f"mnist-train[0:500]) on "
             f"the first {result['images']:,} MNIST test images, scored by `compress --runtime "
             f"{','.join(RUNTIMES)}`; onnxruntime {ort}, openvino {ov}. Machine: {cpu_model()}, "
             f"{os.cpu_count()} cores ({platform.machine()}, int8 features {', '.join(int8_features()) or 'none'}), "
             f"load average {os.getloadavg()[0]:.2f} at the end.", "",
             "| export | runtime | precision used | top-1 differs from ONNX Runtime | largest probability difference | "
             "disagrees with the source | s per pass (median) | / ONNX Runtime |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        base = row["seconds"]["onnxruntime"]
        lines.append(f"| {row['method']} | onnxruntime | f32 | - | - | {row['ort_disagreements']} of {row['images']:,} | "
                     f"{base:.3f} | 1.00 |")
        for label in RUNTIMES[1:]:
            found = row[label]
            lines.append(f"| {row['method']} | {label} | {found['precision']} | {found['differs']} | "
                         f"{found['max_difference']:.3g} | {found['disagreements']} of {row['images']:,} | "
                         f"{row['seconds'][label]:.3f} | {row['seconds'][label] / base:.2f} |")
    lines += ["", "On a CPU without native bf16 OpenVINO's default is f32, so `openvino` and `openvino:f32` are the same "
              "computation there; on one with AVX-512 BF16 or AMX the default row shows bf16 and its differences.", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shared", default=os.environ.get("MLFLOW_DI_SHARED", "../shared"))
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    from benchmarks.results import publish

    publish(render(measure(args.images, args.repeat, os.path.abspath(args.shared))), BEGIN, END, write=args.write)


if __name__ == "__main__":
    main()
