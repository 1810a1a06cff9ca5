"""How good is the fuzz progress bar's estimate of the time left?

Each campaign runs with its progress written as a log shows it (plain lines, one every 10 s, as in
CI or ``nohup``). Per line, the estimate of the whole campaign is ``elapsed + remaining``; the truth
is the bar's elapsed time on its last line. The table gives the first estimate over the truth (the
figure #33 asks to keep within 2x; a sequential campaign shows "?" until its mean seconds per seed
is known to within a quarter) and the worst ratio over all lines with an estimate.

Subject: the DFlare LeNet-5 reference pair (``lenet5.h5`` imported as ``lenet5-same`` vs
``lenet5-quan.lite``), MNIST test seeds [9000:9100] at most 2,000 queries per seed under each
realism budget, and seeds [0:4000] unconstrained at 30,000 queries.

    .venv/bin/python -m benchmarks.bench_progress [--shared ../shared] [--no-write]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import re

import mlflow_di  # noqa: F401  (torchvision guard first)
from benchmarks.results import write_section
from mlflow_di.fuzz import DFlare
from mlflow_di.fuzz.boundary import BoundaryWalk, run_boundary
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.realism import Constraint

BEGIN, END = "<!-- bench_progress -->", "<!-- /bench_progress -->"
LINE = re.compile(r"\| ([\d:]+)<([\d:]+|\?)")


def seconds(clock: str) -> float:
    """tqdm's ``[h:]mm:ss`` in seconds."""
    total = 0.0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return total


def estimates(log: str) -> list[tuple[float, float]]:
    """(elapsed, estimated total or None) per progress line."""
    out = []
    for match in LINE.finditer(log):
        elapsed, remaining = match.groups()
        out.append((seconds(elapsed), None if remaining == "?" else seconds(elapsed) + seconds(remaining)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--no-write", action="store_true", help="print the section, do not touch RESULTS.md")
    parser.add_argument("--only", default="", help="run only the campaigns whose name contains this")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DI_THREADS", "1")
    shared = pathlib.Path(args.shared)
    original = mlflow_di.load_torch_model(f"keras:lenet5-same:{shared / 'models' / 'dflare' / 'lenet5.h5'}")
    compressed = mlflow_di.load_classifier(str(shared / "models" / "dflare" / "lenet5-quan.lite"))
    mnist = shared / "data" / "mnist"
    few = mlflow_di.load_images(f"mnist-test:{mnist}[9000:9100]")
    many = mlflow_di.load_images(f"mnist-test:{mnist}[0:4000]")
    cases = [
        ("dflare, L-inf <= 32", lambda: run_campaign(original.classifier(), compressed, few, DFlare(
            constraint=Constraint(max_linf=32)), timeout=600, max_queries=2000)),
        ("dflare, SSIM >= 0.9", lambda: run_campaign(original.classifier(), compressed, few, DFlare(
            constraint=Constraint(min_ssim=0.9)), timeout=600, max_queries=2000)),
        ("dflare, unconstrained, seeds [0:4000], 30,000 queries", lambda: run_campaign(
            original.classifier(), compressed, many, DFlare(), timeout=600, max_queries=30_000)),
        ("boundary, L-inf <= 32", lambda: run_boundary(original, compressed, few, BoundaryWalk(
            constraint=Constraint(max_linf=32)), timeout=600, max_queries=2000)),
        ("boundary, SSIM >= 0.9", lambda: run_boundary(original, compressed, few, BoundaryWalk(
            constraint=Constraint(min_ssim=0.9)), timeout=600, max_queries=2000)),
    ]
    rows = ["| campaign | first estimate at | first estimate | truth | first / truth | worst line / truth |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, run in cases:
        if args.only not in name:
            continue
        log = io.StringIO()
        with contextlib.redirect_stderr(log):
            run()
        lines = estimates(log.getvalue())
        shown = [(at, estimate) for at, estimate in lines[:-1] if estimate is not None]
        if not shown:
            rows.append(f"| {name} | (no estimate before the last line) | | | | |")
        else:
            truth = lines[-1][0]
            first_at, first = shown[0]
            worst = max((estimate / truth for _, estimate in shown), key=lambda r: max(r, 1 / r))
            rows.append(f"| {name} | {first_at:.0f} s | {first:.0f} s | {truth:.0f} s | {first / truth:.2f} | "
                        f"{worst:.2f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "## The progress bar's estimate of the time left (bench_progress)", "",
        "`.venv/bin/python -m benchmarks.bench_progress` (2 CPU cores, no GPU, one thread): the LeNet-5 reference "
        "pair, MNIST test seeds [9000:9100] at 2,000 queries per seed unless named; progress written as a log shows "
        "it (a line every 10 s). *estimate*: the line's elapsed plus remaining; *truth*: the bar's elapsed time on "
        "its last line. The boundary walk starts its seeds in a shuffled order (up to 64 walk together) and shows \"?\" until "
        "the standard error of its mean seconds per seed is at most a quarter of it. Before the estimate counted "
        "budget (it extrapolated finished seeds), the first line of "
        "`dflare, L-inf <= 32` estimated 358 s for a 47 s campaign (7.6x).",
        "", *rows, ""])
    print(text)
    if not args.no_write:
        write_section(f"{BEGIN}\n{text}\n{END}", BEGIN, END)


if __name__ == "__main__":
    main()
