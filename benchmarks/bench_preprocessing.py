"""uint8 images -> model input: the table lookup :meth:`Preprocessing.apply` uses vs the arithmetic on every value.

    python -m benchmarks.bench_preprocessing [--repeat 5] [--write]

For each image size and layout (random uint8 images, ImageNet's mean and std), in one run: ms per
image of ``apply`` (a table of the 256 levels per channel, looked up with OpenCV) and of
``arithmetic`` (astype, scale, mean, std, transpose on every value), the lower of ``--repeat``
timings each, their ratio, and whether the two gave the same bits. ``--write`` puts the table in
benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

import mlflow_di  # noqa: F401  (torchvision guard first)

#: (images per batch, height, width, channels): MNIST, CIFAR, a small and an ImageNet-sized input.
CASES = ((256, 28, 28, 1), (256, 32, 32, 3), (64, 64, 64, 3), (64, 224, 224, 3))


def _best_ms_per_image(fn, count: int, repeat: int) -> float:
    fn()  # warm-up (the table is computed once per settings)
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best / count * 1e3


def measure(repeat: int) -> list[dict]:
    from mlflow_di.models.preprocessing import Preprocessing

    rows = []
    rng = np.random.default_rng(0)
    for count, height, width, channels in CASES:
        images = rng.integers(0, 256, (count, height, width, channels), dtype=np.uint8)
        mean, std = (123.675, 116.28, 103.53)[:channels], (58.395, 57.12, 57.375)[:channels]
        for layout in ("NCHW", "NHWC"):
            prep = Preprocessing(scale=1.0, mean=mean, std=std, layout=layout, input_shape=(height, width, channels))
            lookup = _best_ms_per_image(lambda: prep.apply(images), count, repeat)
            arithmetic = _best_ms_per_image(lambda: prep.arithmetic(images), count, repeat)
            same = np.array_equal(prep.apply(images).view(np.uint32), prep.arithmetic(images).view(np.uint32))
            rows.append({"images": f"{count}x{height}x{width}x{channels}", "layout": layout,
                         "lookup_ms_per_image": round(lookup, 4), "arithmetic_ms_per_image": round(arithmetic, 4),
                         "speedup": round(arithmetic / lookup, 2), "same_bits": bool(same)})
    return rows


def section(rows: list[dict], command: str) -> str:
    lines = ["<!-- bench_preprocessing -->", "## Preprocessing: uint8 images -> model input (bench_preprocessing)", "",
             f"Command: `{command}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores; random uint8 images, ImageNet mean/std, "
             "the lower of the timings per case.", "",
             "| batch | layout | table lookup ms/img | arithmetic ms/img | speed-up | same bits |",
             "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['images']} | {r['layout']} | {r['lookup_ms_per_image']} | {r['arithmetic_ms_per_image']} | "
              f"{r['speedup']}x | {'yes' if r['same_bits'] else 'NO'} |" for r in rows]
    lines += ["", "`Preprocessing.apply` looks uint8 pixels up in a (channels, 256) float32 table computed by the "
              "arithmetic's own float32 operations, so the inputs are the same bits "
              "(`tests/test_preprocessing.py` checks it on random settings); images of another dtype take the "
              "arithmetic.", "<!-- /bench_preprocessing -->"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = measure(args.repeat)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.write:
        from benchmarks.results import write_section

        command = f"python -m benchmarks.bench_preprocessing --repeat {args.repeat}"
        write_section(section(rows, command), "<!-- bench_preprocessing -->", "<!-- /bench_preprocessing -->")


if __name__ == "__main__":
    main()
