"""Peak memory of the streaming passes for a small and a ten times bigger set of 224x224 RGB images.

Writes generated images (smooth random pictures, 10 random labels) outside the repository, as an
uncompressed npz (``np.savez`` layout, written row by row, so the generator never holds the set)
and/or as a folder of JPEG files, then runs each pass in a fresh subprocess and reads that
process's peak resident memory (``VmHWM`` in /proc/self/status, else ``ru_maxrss``):

- ``coverage``: ``CoverageSuite`` (IDC + all classic criteria) fitted on the whole set and scored
  on it, on a small CNN at 224x224 (two strided convs, 8 and 16 channels, global pooling, two
  linear layers; random weights). torchvision's resnet18 is not used: on this shared 2-core
  machine one of its LRP passes over 20,000 images at 224x224 takes hours;
- ``fuzz-seeds``: ``run_campaign`` over every image as a seed with ``max_queries=1`` (seed
  fingerprint, both models' seed predictions, one mutant per seed), the CNN against a copy with
  weights scaled by 0.9;
- ``calibration``: ``compress(..., "int8-static")`` calibrated on every image, then the int8
  model's predictions on every image (what ``mlflow-di compress`` does with --calib-data).

Peak memory should not grow with the number of images beyond what is kept per input (per-neuron
values, per-seed records, predictions). Writes a section into benchmarks/RESULTS.md between
``<!-- bench_streaming -->`` markers (only that section is replaced).

    .venv/bin/python -m benchmarks.bench_streaming [--sizes 2000,20000] [--source npz] [--passes all]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

BEGIN, END = "<!-- bench_streaming -->", "<!-- /bench_streaming -->"
PASSES = ("coverage", "fuzz-seeds", "calibration")
SOURCES = ("npz", "folder")
CHUNK = 250  # images generated (and written) at a time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,20000", help="numbers of images, comma-separated")
    parser.add_argument("--image-size", type=int, default=224, help="height and width of the images")
    parser.add_argument("--source", default="npz", help="npz, folder (JPEG files) or npz,folder")
    parser.add_argument("--passes", default="all", help=f"comma-separated among {', '.join(PASSES)} (default all)")
    parser.add_argument("--batch-size", type=int, default=128, help="images per batch in every pass")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="where the images are written (default: a new folder under the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated images")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not touch RESULTS.md")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one pass, print JSON
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------ data
def image_chunk(start: int, count: int, size: int) -> np.ndarray:
    """Deterministic smooth RGB pictures: an upsampled 7x7 random grid plus a little noise."""
    rng = np.random.default_rng(start)
    coarse = rng.integers(0, 256, (count, 7, 7, 3)).astype(np.float32)
    repeat = -(-size // 7)
    smooth = coarse.repeat(repeat, axis=1).repeat(repeat, axis=2)[:, :size, :size]
    noisy = smooth + rng.normal(0.0, 8.0, smooth.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def labels_for(count: int) -> np.ndarray:
    return np.random.default_rng(12345).integers(0, 10, count)


def write_npz(path: pathlib.Path, count: int, size: int) -> None:
    """An ``np.savez``-layout archive (stored members x, y) written chunk by chunk."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
              "shape": (count, size, size, 3)}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, header)
            for start in range(0, count, CHUNK):
                member.write(image_chunk(start, min(CHUNK, count - start), size).tobytes())
        with archive.open("y.npy", "w") as member:
            np.lib.format.write_array(member, labels_for(count))


def write_folder(root: pathlib.Path, count: int, size: int) -> None:
    from PIL import Image

    labels = labels_for(count)
    for label in range(10):
        (root / f"class{label}").mkdir(parents=True, exist_ok=True)
    for start in range(0, count, CHUNK):
        for offset, image in enumerate(image_chunk(start, min(CHUNK, count - start), size)):
            index = start + offset
            Image.fromarray(image).save(root / f"class{labels[index]}" / f"{index:06d}.jpg", quality=90)


def make_data(workdir: pathlib.Path, source: str, count: int, size: int) -> str:
    """The data spec of ``count`` generated images, written once per (source, count, size)."""
    target = workdir / f"{source}-{count}-{size}"
    if source == "npz":
        path = target.with_suffix(".npz")
        if not path.exists():
            write_npz(path, count, size)
        return f"npz:{path}"
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        write_folder(target, count, size)
        (target / ".complete").write_text("")
    return f"folder:{target}"


# ------------------------------------------------------------------------------- one pass
def small_cnn():
    """224x224x3 -> 10 logits: conv 5x5/4 (8 ch), conv 3x3/2 (16 ch), global average pool, 32 units, 10."""
    import collections

    from torch import nn

    return nn.Sequential(collections.OrderedDict(
        conv1=nn.Conv2d(3, 8, 5, stride=4), relu1=nn.ReLU(), conv2=nn.Conv2d(8, 16, 3, stride=2), relu2=nn.ReLU(),
        pool=nn.AdaptiveAvgPool2d(1), flatten=nn.Flatten(), fc1=nn.Linear(16, 32), relu3=nn.ReLU(),
        fc2=nn.Linear(32, 10)))


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pass(name: str, spec: str, batch_size: int) -> dict:
    import mlflow_di  # noqa: F401  (torchvision guard first)
    import torch

    from mlflow_di.data import load_images
    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.torch_model import TorchModel

    torch.set_num_threads(1)
    data = load_images(spec)
    size = data.image_shape
    torch.manual_seed(0)
    model = TorchModel(small_cnn().eval(), Preprocessing(input_shape=size), name="small-cnn")
    baseline = peak_rss_mib()  # libraries imported, model built, nothing read yet
    start = time.perf_counter()
    facts: dict = {}
    if name == "coverage":
        from mlflow_di.coverage.suite import CoverageSuite

        suite = CoverageSuite(top_m=4, only_correct=False, batch_size=batch_size, progress=False).fit(model, data)
        result = suite.score(data)
        facts = {"idc": round(result.metrics()["idc"], 4), "nc": round(result.metrics()["nc"], 4)}
    elif name == "fuzz-seeds":
        from mlflow_di.fuzz import run_campaign
        from mlflow_di.models.classifier import TorchClassifier

        twin = small_cnn()
        twin.load_state_dict(model.module.state_dict())
        with torch.no_grad():
            for parameter in twin.parameters():
                parameter.mul_(0.9)
        result = run_campaign(TorchClassifier(model.module, model.preprocessing), TorchClassifier(twin, model.preprocessing),
                              data, max_queries=1, batch=batch_size, seed=0, progress=False)
        facts = {"seeds": len(result.records), "triggers": int(sum(r.success for r in result.records))}
    elif name == "calibration":
        from mlflow_di.compression import compress
        from mlflow_di.models.classifier import OnnxClassifier

        with tempfile.TemporaryDirectory(prefix="bench-streaming-") as out:
            compressed = compress(model.module, model.preprocessing, "int8-static", out, calib_inputs=data.images)
            predicted = OnnxClassifier(compressed.path).predict(data.images, batch_size=batch_size)
        facts = {"calibration_samples": compressed.params["calibration_samples"], "predicted": len(predicted)}
    else:
        raise SystemExit(f"unknown pass {name!r}; choose from {PASSES}")
    return {"pass": name, "spec": spec, "images": len(data), "seconds": round(time.perf_counter() - start, 1),
            "baseline_mib": round(baseline, 1), "peak_mib": round(peak_rss_mib(), 1), **facts}


def measure(name: str, spec: str, batch_size: int) -> dict:
    """Run one pass in a fresh interpreter and return what it reports."""
    env = dict(os.environ, MLFLOW_DI_THREADS="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "benchmarks.bench_streaming", "--child", name, "--spec", spec,
               "--batch-size", str(batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=pathlib.Path(__file__).parents[1])
    if done.returncode != 0:
        raise SystemExit(f"{name} on {spec} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------- report
def section(rows: list[dict], args, sizes: list[int]) -> str:
    argv = " ".join(sys.argv[1:])
    lines = [
        BEGIN,
        "## Streaming: peak memory vs number of images",
        "",
        f"Command: `.venv/bin/python -m benchmarks.bench_streaming {argv}`".rstrip() + "  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs, torch and ONNX Runtime on "
        f"1 thread; images {args.image_size}x{args.image_size}x3, batch {args.batch_size}. Peak = the pass's own "
        "process (VmHWM); baseline = the same process after imports and model construction, before any image "
        "is read. Model: a small CNN (conv 5x5/4 8 ch, conv 3x3/2 16 ch, global average pool, 32, 10; random "
        "weights), since torchvision's resnet18 needs hours per LRP pass over 20,000 images on this machine.",
        "",
        "| source | pass | " + " | ".join(f"{n:,} images: peak MiB (s)" for n in sizes)
        + f" | growth {sizes[0]:,} -> {sizes[-1]:,} |",
        "|---|---|" + "---:|" * (len(sizes) + 1),
    ]
    for (source, name) in dict.fromkeys((r["source"], r["pass"]) for r in rows):
        cells = {r["images"]: r for r in rows if (r["source"], r["pass"]) == (source, name)}
        values = [f"{cells[n]['peak_mib']:.0f} ({cells[n]['seconds']:.0f})" if n in cells else "-" for n in sizes]
        growth = "-"
        if sizes[0] in cells and sizes[-1] in cells:
            growth = f"{cells[sizes[-1]]['peak_mib'] / cells[sizes[0]]['peak_mib'] - 1:+.1%}"
        lines.append(f"| {source} | {name} | " + " | ".join(values) + f" | {growth} |")
    lines += ["", "Raw figures (one JSON object per pass):", "", "```"]
    lines += [json.dumps({k: v for k, v in r.items() if k != "spec"}) for r in rows]
    lines += ["```", END]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_pass(args.child, args.spec, args.batch_size)))
        return
    sizes = [int(n) for n in args.sizes.split(",")]
    sources = [s.strip() for s in args.source.split(",")]
    passes = PASSES if args.passes == "all" else tuple(p.strip() for p in args.passes.split(","))
    for value, known, what in ((sources, SOURCES, "source"), (passes, PASSES, "pass")):
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise SystemExit(f"unknown {what} {unknown}; choose from {known}")
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="mlflow-di-bench-streaming-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for source in sources:
            for count in sizes:
                began = time.perf_counter()
                spec = make_data(workdir, source, count, args.image_size)
                print(f"{source}: {count} images ready in {time.perf_counter() - began:.0f} s ({spec})", flush=True)
                for name in passes:
                    row = dict(measure(name, spec, args.batch_size), source=source)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    text = section(rows, args, sizes)
    print(text)
    if not args.no_write:
        from benchmarks.results import write_section

        write_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
