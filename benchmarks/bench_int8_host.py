"""int8 recipes on two kinds of x86 CPU, and what an export buys on this one.

Section ``bench_recipes``: for the DeepImportance LeNet-1 and LeNet-5 (calibrated on MNIST train
[0:500]), each int8-static recipe's disagreements with the float model on MNIST test [0:5000] under
host semantics (ONNX Runtime's default session) and reference semantics (graph optimizations off),
on this CPU and on an emulated AVX2 CPU without VNNI (``qemu-x86_64 -cpu Haswell``: the CPU
ONNX Runtime's u8s8 kernels saturate on), with each export's latency on this CPU.

Section ``bench_benefit``: latency (batch 1 and 64, median of 20 runs after 5 warm-up runs, one
thread), throughput, file size and peak memory (:mod:`mlflow_di.models.benefit`) of the fp32 export and
the default int8-static export of LeNet-5, torchvision resnet18 and mobilenet_v3_small (random
weights, 224x224 RGB, calibrated on 32 random images), with this CPU's int8 features beside it.

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_int8_host [--shared ../shared] [--no-emulation] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np

from benchmarks.results import write_section

REPO = pathlib.Path(__file__).resolve().parents[1]
EMULATED_CPU = "Haswell"
SCORE = """
import json, sys
import numpy as np, onnxruntime as ort
from mlflow_di.models.execution import execution_context, session_options
folder = sys.argv[1]
found = {"context": execution_context().describe()}
for model in sys.argv[2].split(","):
    inputs, reference = np.load(f"{folder}/{model}-inputs.npy"), np.load(f"{folder}/{model}-labels.npy")
    for name in sys.argv[3].split(","):
        for semantics in ("host", "reference"):
            session = ort.InferenceSession(f"{folder}/{model}-{name}.onnx", session_options(semantics, 1),
                                           providers=["CPUExecutionProvider"])
            labels = np.concatenate([session.run(None, {"input": inputs[i:i + 500]})[0].argmax(1)
                                     for i in range(0, len(inputs), 500)])
            found[f"{model} {name} {semantics}"] = int(np.sum(labels != reference))
print(json.dumps(found))
"""


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_shared = os.environ.get("MLFLOW_DI_SHARED", str(REPO.parent / "shared"))
    parser.add_argument("--shared", type=pathlib.Path, default=pathlib.Path(default_shared))
    parser.add_argument("--no-emulation", action="store_true", help="skip the emulated CPU without VNNI")
    parser.add_argument("--no-write", action="store_true", help="print the sections, do not touch RESULTS.md")
    return parser.parse_args()


def score(folder, models, recipes, emulated: bool) -> dict:
    command = [sys.executable, "-c", SCORE, str(folder), ",".join(models), ",".join(recipes)]
    if emulated:
        command = ["qemu-x86_64", "-cpu", EMULATED_CPU, *command]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def recipes_section(args, work: pathlib.Path) -> str:
    from benchmarks.bench_bounded import reference_lenet
    from mlflow_di.compression import compress
    from mlflow_di.compression.recipes import RECIPES
    from mlflow_di.data import load_images
    from mlflow_di.models.benefit import measure

    mnist = f"{args.shared}/data/mnist"
    calib = np.asarray(load_images(f"mnist-train:{mnist}[0:500]").images[:])
    test = np.asarray(load_images(f"mnist-test:{mnist}[0:5000]").images[:])
    models, latency = ("lenet1", "lenet5"), {}
    for model in models:
        source = reference_lenet(args.shared, model)
        np.save(work / f"{model}-inputs.npy", source.preprocessing.apply(test).astype(np.float32))
        np.save(work / f"{model}-labels.npy", source.classifier().predict(test))
        for name, recipe in RECIPES.items():
            made = compress(source.module, source.preprocessing, "int8-static", work / model / name, calib_inputs=calib,
                            settings=recipe)
            shutil.copyfile(made.path, work / f"{model}-{name}.onnx")
            latency[model, name] = measure(work / f"{model}-{name}.onnx")
    native = score(work, models, list(RECIPES), emulated=False)
    emulated = score(work, models, list(RECIPES), emulated=True) if not args.no_emulation else {}
    lines = ["<!-- bench_recipes -->", "## int8 recipes on CPUs with and without VNNI (bench_int8_host)", "",
             "Command: `PYTHONPATH=. .venv/bin/python -m benchmarks.bench_int8_host` (2 cores). DeepImportance "
             "LeNets, int8-static calibrated on MNIST train [0:500]; top-1 disagreements with the float model on MNIST "
             "test [0:5000]: *host* = ONNX Runtime's default session (fused int8 kernels), *reference* = graph "
             "optimizations off (the QDQ graph as written). *no VNNI* runs the same files under `qemu-x86_64 -cpu "
             f"{EMULATED_CPU}`, an AVX2 CPU without VNNI, whatever this machine is. Latency: this CPU, one thread, "
             "median of 20 runs at batch 64.", "",
             f"- this CPU: {native['context']}",
             *([f"- emulated: {emulated['context']}"] if emulated else []), "",
             "| model | recipe | saturates without VNNI | this CPU: host / reference | no VNNI: host / reference | "
             "latency b64 (ms) |", "|---|---|---|---|---|---|"]
    for model in models:
        for name, recipe in RECIPES.items():
            here = f"{native[f'{model} {name} host']} / {native[f'{model} {name} reference']}"
            there = (f"{emulated[f'{model} {name} host']} / {emulated[f'{model} {name} reference']}" if emulated
                     else "not run")
            lines.append(f"| {model} | {name} | {'yes' if recipe.may_saturate else 'no'} | {here} | {there} | "
                         f"{latency[model, name].latency_batch_ms:.3f} |")
    return "\n".join(lines) + "\n<!-- /bench_recipes -->"


def benefit_section(args, work: pathlib.Path) -> str:
    import torch
    import torchvision

    from benchmarks.bench_bounded import reference_lenet
    from mlflow_di.compression import compress
    from mlflow_di.data import load_images
    from mlflow_di.models.benefit import compare
    from mlflow_di.models.execution import execution_context
    from mlflow_di.models.preprocessing import Preprocessing

    rows = []
    lenet = reference_lenet(args.shared, "lenet5")
    calib = np.asarray(load_images(f"mnist-train:{args.shared}/data/mnist[0:500]").images[:])
    subjects = [("lenet5 (28x28)", lenet.module, lenet.preprocessing, calib)]
    rgb = Preprocessing(layout="NCHW", input_shape=(224, 224, 3), scale=1 / 255.0)
    random_images = np.random.default_rng(0).integers(0, 256, size=(32, 224, 224, 3), dtype=np.uint8)
    for name in ("resnet18", "mobilenet_v3_small"):
        torch.manual_seed(0)
        subjects.append((f"{name} (224x224)", getattr(torchvision.models, name)(num_classes=10).eval(), rgb,
                         random_images))
    for label, module, preprocessing, images in subjects:
        slug = label.split()[0]
        fp32 = compress(module, preprocessing, "fp32", work / slug / "fp32")
        int8 = compress(module, preprocessing, "int8-static", work / slug / "int8", calib_inputs=images)
        found = compare(fp32.path, int8.path)
        rows.append((label, int8.params["recipe"], found))
        print(label, found.metrics(), flush=True)
    lines = ["<!-- bench_benefit -->", "## What an int8 export buys on this CPU (bench_int8_host)", "",
             "Command: `PYTHONPATH=. .venv/bin/python -m benchmarks.bench_int8_host`. fp32 export vs the default "
             "int8-static export (`compress --method int8-static`), each measured in its own process by "
             "`mlflow_di.models.benefit` (ONNX Runtime CPU session, 1 thread, median of 20 runs after 5 warm-up "
             "runs, random inputs; peak memory: that process's peak resident memory, ONNX Runtime included). "
             "torchvision models have random weights (the timings do not depend on them).", "",
             f"CPU: {execution_context(threads=1).describe()}", "",
             "| model | export | recipe | batch 1 (ms) | batch 64 (ms) | images/s (b64) | size (KiB) | peak memory (MiB) "
             "| speedup b64 / b1 |", "|---|---|---|---|---|---|---|---|---|"]
    for label, recipe_name, found in rows:
        for what, benefit in (("fp32", found.source), ("int8", found.export)):
            speed = f"{found.speedup:.2f}x / {found.speedup_b1:.2f}x" if what == "int8" else ""
            lines.append(f"| {label} | {what} | {recipe_name if what == 'int8' else ''} | {benefit.latency_b1_ms:.3f} | "
                         f"{benefit.latency_batch_ms:.2f} | {benefit.throughput:.0f} | {benefit.size_bytes / 1024:.1f} | "
                         f"{benefit.peak_memory_mib:.1f} | {speed} |")
    return "\n".join(lines) + "\n<!-- /bench_benefit -->"


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-int8-host-") as work:
        work = pathlib.Path(work)
        sections = [recipes_section(args, work), benefit_section(args, work)]
    for section in sections:
        print(section)
        if not args.no_write:
            begin, end = section.splitlines()[0], section.splitlines()[-1]
            write_section(section, begin, end)


if __name__ == "__main__":
    main()
