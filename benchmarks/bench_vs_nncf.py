"""Compare mlflow-di's bounded int8 search with NNCF's accuracy-aware quantization on the same models and data.

What is compared: for each model and each bound (an accuracy drop, or a top-1 disagreement rate with
the float model, both as fractions of images), two tools start from the same float ONNX export and
the same images and choose which layers to leave in float so that an int8 (QDQ) model meets the bound:

* mlflow-di: :func:`mlflow_di.compression.bounded.bounded_int8_static` (ONNX Runtime static
  quantization, measured search over the layers kept in float, then a held-out verification);
* NNCF: ``nncf.quantize_with_accuracy_control`` (``max_drop``, ``DropType.ABSOLUTE``) on the ONNX
  backend, with a ``validation_fn`` that runs the candidate in ONNX Runtime and returns accuracy
  (accuracy bound) or top-1 agreement with the float model (disagreement bound). NNCF's own
  defaults otherwise (MinMax, fast bias correction, ranking by the outputs' normalized MSE), except
  ``subset_size`` = all calibration images.

Data: the DeepImportance LeNet-1 / LeNet-5 (``--shared``), calibrated on MNIST train [0:500],
searched on MNIST test [0:5000] (NNCF's validation dataset) and verified on MNIST test [5000:10000],
as in ``benchmarks/bench_bounded.py``. Both tools' exports are then evaluated here identically: ONNX
Runtime's default CPU session, top-1 against the float ONNX model's top-1 (disagreements) and against
the labels (accuracy drop, in points). Layers in float are read off each ONNX graph (a Conv/Gemm/MatMul
whose weight is not fed by a DequantizeLinear). Latency: ONNX Runtime CPU, one intra-op thread,
median of ``--latency-runs`` runs after 5 warm-up runs, batch 1 and 64.

NNCF is not installed in this project's virtualenv (it could move pinned packages): its side runs
in a subprocess with another interpreter, exchanging the float ONNX and .npy arrays through a
temporary folder. Set that interpreter up once:

    python3 -m venv /tmp/nncf-venv && /tmp/nncf-venv/bin/pip install nncf==3.4.0 onnxruntime==1.32.0 onnx

Run (prints a Markdown section; ``--write`` also puts it in benchmarks/RESULTS.md):

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_vs_nncf [--shared ../shared] [--models lenet1,lenet5]
        [--nncf-python /tmp/nncf-venv/bin/python] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import onnx
import onnxruntime as ort

from benchmarks.bench_bounded import reference_lenet, splits
from benchmarks.results import write_section
from mlflow_di.compression.bounded import BoundedTarget, Bounds, UnreachableBounds, bounded_int8_static
from mlflow_di.compression.methods import float_export
from mlflow_di.compression.prune import prunable_layers

REPO = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_vs_nncf -->", "<!-- /bench_vs_nncf -->"
DEFAULT_NNCF_PYTHON = "/tmp/nncf-venv/bin/python"
SETUP_HINT = ("NNCF interpreter not found: create it with `python3 -m venv /tmp/nncf-venv && "
              "/tmp/nncf-venv/bin/pip install nncf==3.4.0 onnxruntime==1.32.0 onnx` (or pass --nncf-python / NNCF_PYTHON)")
WEIGHTED_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul"}
CPU_FLAGS = ("avx2", "avx512_vnni", "avx_vnni")
WARMUP_RUNS = 5

# The NNCF side, run as a script by the NNCF interpreter: ``python worker.py WORK``. WORK holds
# job.json ({"max_drop": float}), fp32.onnx, calib.npy (model inputs, N x C x H x W float32),
# eval_x.npy (model inputs) and eval_target.npy (the labels validation_fn compares top-1 with: the
# true labels for an accuracy bound, the float model's top-1 for a disagreement bound). It writes
# nncf.onnx, intermediate_model.onnx (NNCF's fully quantized model, before any layer is reverted)
# and result.json.
WORKER = r'''
import json
import pathlib
import sys
import time

import nncf
import numpy as np
import onnx
import onnxruntime as ort
from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

work = pathlib.Path(sys.argv[1])
job = json.loads((work / "job.json").read_text())
model = onnx.load(str(work / "fp32.onnx"))
input_name = model.graph.input[0].name
calib = np.load(work / "calib.npy")
eval_x = np.load(work / "eval_x.npy")
eval_target = np.load(work / "eval_target.npy")

# one image per item, so that subset sizes count images
calibration = nncf.Dataset([calib[i:i + 1] for i in range(len(calib))], lambda x: {input_name: x})
validation = nncf.Dataset([(eval_x[i:i + 1], int(eval_target[i])) for i in range(len(eval_x))],
                          lambda item: {input_name: item[0]})


def validation_fn(candidate, items):
    """Fraction of items whose top-1 equals the item's target (accuracy, or agreement with the float model)."""
    session = ort.InferenceSession(candidate.SerializeToString(), providers=["CPUExecutionProvider"])
    items = list(items)
    inputs = np.concatenate([x for x, _ in items])
    targets = np.array([target for _, target in items])
    top1 = np.concatenate([session.run(None, {input_name: inputs[start:start + 1000]})[0].argmax(axis=1)
                           for start in range(0, len(inputs), 1000)])
    return float(np.mean(top1 == targets))


start = time.perf_counter()
quantized = nncf.quantize_with_accuracy_control(
    model,
    calibration_dataset=calibration,
    validation_dataset=validation,
    validation_fn=validation_fn,
    max_drop=job["max_drop"],
    drop_type=nncf.DropType.ABSOLUTE,
    subset_size=len(calib),
    advanced_accuracy_restorer_parameters=AdvancedAccuracyRestorerParameters(intermediate_model_dir=str(work)),
)
seconds = time.perf_counter() - start
onnx.save(quantized, str(work / "nncf.onnx"))
(work / "result.json").write_text(json.dumps({"seconds": seconds, "nncf": nncf.__version__,
                                              "onnxruntime": ort.__version__}))
'''


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("MLFLOW_DI_SHARED", "/work/shared")))
    parser.add_argument("--models", default="lenet1,lenet5", help="lenet1 and/or lenet5 (DeepImportance, --shared)")
    parser.add_argument("--nncf-python", default=os.environ.get("NNCF_PYTHON", DEFAULT_NNCF_PYTHON),
                        help="interpreter with nncf installed (default: $NNCF_PYTHON, else %(default)s)")
    parser.add_argument("--max-accuracy-drop", type=float, default=0.001, help="accuracy bound (fraction)")
    parser.add_argument("--max-disagreement-rate", type=float, default=0.003, help="disagreement bound (fraction)")
    parser.add_argument("--latency-runs", type=int, default=30, help="timed runs per latency figure (>= 20)")
    parser.add_argument("--write", action="store_true", help="also write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.latency_runs = max(args.latency_runs, 20)
    return args


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- machine context ---------------------------------------------------------------------------

def machine_context() -> dict:
    model, flags = "unknown", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "flags": {flag: flag in flags for flag in CPU_FLAGS}, "onnxruntime": ort.__version__,
            "cores": os.cpu_count()}


# --- ONNX Runtime helpers ----------------------------------------------------------------------

def top1(path, inputs: np.ndarray) -> np.ndarray:
    """Top-1 classes from ONNX Runtime's default CPU session."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: inputs[start:start + 1000]})[0].argmax(axis=1)
                           for start in range(0, len(inputs), 1000)])


def latency_ms(path, inputs: np.ndarray, runs: int) -> float:
    """Median wall time of one ``session.run`` (one intra-op thread) after WARMUP_RUNS runs, in ms."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: inputs}
    for _ in range(WARMUP_RUNS):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000


def latencies(path, inputs: np.ndarray, runs: int) -> tuple[float, float]:
    return latency_ms(path, inputs[:1], runs), latency_ms(path, inputs[:64], runs)


class Split:
    """Model inputs of one split with the labels and the float ONNX model's top-1 on it."""

    def __init__(self, inputs, labels, float_top1):
        self.inputs, self.labels, self.float_top1 = inputs, np.asarray(labels), float_top1

    def figures(self, path) -> dict:
        """Disagreements with the float model and accuracy drop (points) of the export at ``path``."""
        predicted = top1(path, self.inputs)
        drop = np.sum(self.float_top1 == self.labels) - np.sum(predicted == self.labels)
        return {"disagreements": int(np.sum(predicted != self.float_top1)), "images": len(self.labels),
                "drop_images": int(drop), "drop_points": 100 * drop / len(self.labels)}


# --- which layers stayed in float --------------------------------------------------------------

def weighted_nodes(float_path) -> dict[str, str]:
    """ONNX node name -> layer name (its weight initializer without ``.weight``) of the weighted nodes."""
    model = onnx.load(str(float_path))
    initializers = {init.name for init in model.graph.initializer}
    return {node.name: node.input[1].removesuffix(".weight") for node in model.graph.node
            if node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] in initializers}


def float_layers(quantized_path, weighted: dict[str, str]) -> list[str]:
    """The weighted layers of the quantized graph whose weight is not fed by a DequantizeLinear
    (a node missing from the graph is listed with a trailing ``?``)."""
    model = onnx.load(str(quantized_path))
    producer = {output: node for node in model.graph.node for output in node.output}
    nodes = {node.name: node for node in model.graph.node}
    kept = []
    for node_name, layer in weighted.items():
        node = nodes.get(node_name)
        if node is None:
            kept.append(f"{layer}?")
        elif getattr(producer.get(node.input[1]), "op_type", None) != "DequantizeLinear":
            kept.append(layer)
    return kept


def activation_quantizers(quantized_path) -> int:
    """QuantizeLinear nodes on computed tensors (not on initializers): how many activations are int8."""
    model = onnx.load(str(quantized_path))
    initializers = {init.name for init in model.graph.initializer}
    return sum(node.op_type == "QuantizeLinear" and node.input[0] not in initializers for node in model.graph.node)


# --- the two tools -----------------------------------------------------------------------------

def run_mlflow_di(source, calib, search, held_out, bounds: Bounds, ranking, out_dir) -> dict:
    start = time.perf_counter()
    try:
        result, record = bounded_int8_static(source.module, source.preprocessing, calib,
                                             BoundedTarget(bounds, search, held_out, tuple(ranking)), out_dir,
                                             progress=False)
    except UnreachableBounds as unreachable:
        return {"error": f"UnreachableBounds: {unreachable}", "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    first = record.trials[0] if record.trials and not record.trials[0].kept_float else None
    return {"path": pathlib.Path(result.path), "seconds": seconds, "reported_kept": list(record.kept_float),
            "recipe": record.recipe, "exports": record.exports,
            "all_int8": (first.search.disagreements, first.search.images) if first else None}


def run_nncf(nncf_python, work: pathlib.Path, fp32_path, calib_x, eval_x, eval_target, max_drop: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "fp32.onnx").write_bytes(pathlib.Path(fp32_path).read_bytes())
    np.save(work / "calib.npy", calib_x)
    np.save(work / "eval_x.npy", eval_x)
    np.save(work / "eval_target.npy", np.asarray(eval_target, dtype=np.int64))
    (work / "job.json").write_text(json.dumps({"max_drop": max_drop}))
    (work / "worker.py").write_text(WORKER)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["NNCF_CI"] = "1"  # NNCF's switch that stubs out its telemetry
    with open(work / "nncf.log", "w") as output:
        completed = subprocess.run([str(nncf_python), str(work / "worker.py"), str(work)], cwd=work, env=env,
                                   stdout=output, stderr=subprocess.STDOUT)
    if completed.returncode != 0 or not (work / "result.json").exists():
        tail = (work / "nncf.log").read_text().strip().splitlines()[-15:]
        log("\n".join(tail))
        return {"error": f"NNCF worker exited {completed.returncode}: {tail[-1] if tail else ''}"}
    result = json.loads((work / "result.json").read_text())
    return {"path": work / "nncf.onnx", "all_int8_path": work / "intermediate_model.onnx", **result}


# --- one model ---------------------------------------------------------------------------------

def one_model(args, name: str, work: pathlib.Path, notes: list[str]) -> tuple[list[dict], dict]:
    log(f"{name}: loading model and splits")
    source = reference_lenet(args.shared, name)
    calib, search, held_out = splits(args, name, source)
    (work / name).mkdir(parents=True)
    fp32 = float_export(source.module, source.preprocessing, work / name / "fp32.onnx").path
    prepare = source.preprocessing.apply
    calib_x = prepare(np.asarray(calib))
    splits_x = {}
    for key, split in (("search", search), ("held_out", held_out)):
        inputs = prepare(np.asarray(split.images))
        splits_x[key] = Split(inputs, split.labels, top1(fp32, inputs))
        differs = int(np.sum(splits_x[key].float_top1 != np.asarray(split.original)))
        if differs:
            notes.append(f"{name}: the float ONNX model's top-1 differs from PyTorch's on {differs} images of "
                         f"{split.name} (mlflow-di searches against PyTorch's, the tables use ONNX's)")
    weighted = weighted_nodes(fp32)
    ranking = [layer for layer, _ in prunable_layers(source.module)]
    float_row = {"model": name, "layers": len(weighted),
                 "accuracy": {key: float(np.mean(split.float_top1 == split.labels)) for key, split in splits_x.items()},
                 "latency": latencies(fp32, splits_x["held_out"].inputs, args.latency_runs)}

    rows = []
    for kind, value in (("accuracy", args.max_accuracy_drop), ("disagreement", args.max_disagreement_rate)):
        bounds = Bounds(max_accuracy_drop=value) if kind == "accuracy" else Bounds(max_disagreement_rate=value)
        row = {"model": name, "kind": kind, "bound": value, "layers": len(weighted)}
        log(f"{name}, {kind} <= {value:g}: mlflow-di search")
        row["mlflow-di"] = run_mlflow_di(source, calib, search, held_out, bounds, ranking, work / name / f"mlflow-di-{kind}")
        log(f"{name}, {kind} <= {value:g}: NNCF search")
        target = search.labels if kind == "accuracy" else splits_x["search"].float_top1
        row["NNCF"] = run_nncf(args.nncf_python, work / name / f"nncf-{kind}", fp32, calib_x, splits_x["search"].inputs,
                               target, value)
        for tool in ("mlflow-di", "NNCF"):
            outcome = row[tool]
            if "error" in outcome:
                continue
            outcome["kept"] = float_layers(outcome["path"], weighted)
            outcome["activation_quantizers"] = activation_quantizers(outcome["path"])
            outcome["search"] = splits_x["search"].figures(outcome["path"])
            outcome["held_out"] = splits_x["held_out"].figures(outcome["path"])
            outcome["latency"] = latencies(outcome["path"], splits_x["held_out"].inputs, args.latency_runs)
            if tool == "NNCF" and outcome["all_int8_path"].exists():
                all_int8 = splits_x["search"].figures(outcome["all_int8_path"])
                outcome["all_int8"] = (all_int8["disagreements"], all_int8["images"])
            if tool == "mlflow-di" and sorted(outcome["kept"]) != sorted(outcome["reported_kept"]):
                notes.append(f"{name}, {kind}: mlflow-di reports {outcome['reported_kept']} in float, its graph has "
                             f"{outcome['kept']}")
        rows.append(row)
        log(json.dumps(row, default=str))
    return rows, float_row


# --- the Markdown section ----------------------------------------------------------------------

def meets(kind: str, bound: float, figures: dict) -> bool:
    count = figures["drop_images"] if kind == "accuracy" else figures["disagreements"]
    return count <= bound * figures["images"] + 1e-9


def figures_text(figures: dict) -> str:
    return f"{figures['disagreements']}/{figures['images']}, {figures['drop_points']:+.2f} pts"


def tool_cells(row: dict, tool: str) -> list[str]:
    outcome = row[tool]
    if "error" in outcome:
        seconds = f"{outcome['seconds']:.1f}" if "seconds" in outcome else ""
        return [tool, f"error: {outcome['error']}", "", "", "", "", "", seconds, "", ""]
    kept = f"{len(outcome['kept'])}: {', '.join(outcome['kept'])}" if outcome["kept"] else "0"
    all_int8 = "{}/{}".format(*outcome["all_int8"]) if outcome.get("all_int8") else "?"
    label = (f"{tool} (exports: {outcome['exports']}, recipe {outcome['recipe']})" if tool == "mlflow-di"
             else tool)
    return [label, kept, str(outcome["activation_quantizers"]), all_int8, figures_text(outcome["search"]),
            figures_text(outcome["held_out"]),
            "yes" if meets(row["kind"], row["bound"], outcome["held_out"]) else "**no**", f"{outcome['seconds']:.1f}",
            f"{outcome['latency'][0]:.3f}", f"{outcome['latency'][1]:.3f}"]


def section(args, machine: dict, nncf_versions: dict, rows: list[dict], float_rows: list[dict],
            notes: list[str]) -> str:
    command = shlex.join(["PYTHONPATH=.", ".venv/bin/python", "-m", "benchmarks.bench_vs_nncf", *sys.argv[1:]])
    flags = ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in machine["flags"].items())
    lines = [
        BEGIN,
        "## mlflow-di bounded int8 vs NNCF accuracy-aware quantization", "",
        f"Command: `{command}`", "",
        f"Machine: {machine['cpu']} ({machine['cores']} cores, shared), CPU flags: {flags}; onnxruntime "
        f"{machine['onnxruntime']} (mlflow-di side and all measurements); NNCF side: `{args.nncf_python}` with nncf "
        f"{nncf_versions.get('nncf', '?')}, onnxruntime {nncf_versions.get('onnxruntime', '?')}.", "",
        "Both tools start from the same float ONNX (`float_export`) and the same images: calibration MNIST train "
        "[0:500], search MNIST test [0:5000] (NNCF's validation dataset, `DropType.ABSOLUTE`, `subset_size=500`, "
        "otherwise NNCF's defaults: MinMax, fast bias correction, layers ranked by the outputs' normalized MSE; its "
        "`validation_fn` returns accuracy for the accuracy bound, top-1 agreement with the float model for the "
        "disagreement bound), held out MNIST test [5000:10000]. mlflow-di: `bounded_int8_static` with the layers "
        "in module order as the tie-break ranking. Every export is evaluated here the same way (ONNX Runtime's "
        "default CPU session): *disagreements* with the float ONNX model's top-1 and the *accuracy drop* against "
        "MNIST's labels, in points. *in float*: Conv/Gemm/MatMul nodes whose weight is not fed by a "
        "DequantizeLinear. *act. Q*: QuantizeLinear nodes on activations (how many tensors are still quantized; a "
        "layer in float can still read a quantized input). *all int8*: the tool's fully quantized model before any "
        "layer is reverted, "
        "disagreements on the search split. *search s*: wall time of the tool's call (mlflow-di's includes its "
        "float export and held-out check; NNCF's excludes interpreter start and `import nncf`). *latency*: ONNX "
        f"Runtime CPU, intra_op_num_threads=1, median of {args.latency_runs} runs after {WARMUP_RUNS} warm-up runs, "
        "ms per call.", "",
        "| model | bound | tool | in float | act. Q | all int8 | search split | held out | meets bound (held out) | search s "
        "| latency b1 ms | latency b64 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for float_row in float_rows:
        accuracy = float_row["accuracy"]
        lines.append(f"| {float_row['model']} | | float (fp32) | {float_row['layers']} of {float_row['layers']} | 0 | | "
                     f"accuracy {accuracy['search']:.2%} | accuracy {accuracy['held_out']:.2%} | | | "
                     f"{float_row['latency'][0]:.3f} | {float_row['latency'][1]:.3f} |")
        for row in (row for row in rows if row["model"] == float_row["model"]):
            bound = f"{row['kind']} <= {row['bound']:g}"
            for tool in ("mlflow-di", "NNCF"):
                lines.append("| " + " | ".join([row["model"], bound, *tool_cells(row, tool)]) + " |")
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    lines.append(END)
    return "\n".join(lines) + "\n"


def nncf_available(python: str) -> bool:
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return False
    return subprocess.run([python, "-c", "import nncf, onnx, onnxruntime"], capture_output=True).returncode == 0


def main() -> None:
    args = parse_args()
    if not nncf_available(args.nncf_python):
        print(SETUP_HINT)
        sys.exit(2)
    machine = machine_context()
    rows, float_rows, notes = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-vs-nncf-") as work:
        for name in args.models.split(","):
            model_rows, float_row = one_model(args, name.strip(), pathlib.Path(work), notes)
            rows += model_rows
            float_rows.append(float_row)
    nncf_versions = next((row["NNCF"] for row in rows if "nncf" in row["NNCF"]), {})
    if nncf_versions.get("onnxruntime") not in (None, machine["onnxruntime"]):
        notes.append(f"the NNCF side ran onnxruntime {nncf_versions['onnxruntime']}, this side {machine['onnxruntime']}")
    text = section(args, machine, nncf_versions, rows, float_rows, notes)
    print(text)
    if args.write:
        write_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
