"""Benchmark of the fuzzing engine on the DFlare paper's LeNet-5 pair (script, not a test).

Original: the Keras LeNet-5 ('same' padding) imported into PyTorch; compressed: its 8-bit
TFLite version. Seeds: the first N images of the MNIST test split. Measures, in one run:

* per strategy (dflare, dflare-d, dflare-r, diffchaser): success rate, mean/median queries
  and mean seconds per triggering input, next to the paper's figures;
* lockstep (``--batch`` seeds at once) against one seed at a time, same seeds and settings:
  queries per second and their ratio, and how many seeds gave identical results;
* overhead: campaign seconds per query divided by the two models' own batched inference
  seconds per input (``predict_proba`` on batches of the same size, measured before and
  after the campaigns; the mean is used).

Writes its section of benchmarks/RESULTS.md between the bench_fuzz markers.

    python benchmarks/bench_fuzz.py            # the full run (500 seeds, timeout 180 s)
    python benchmarks/bench_fuzz.py --quick    # 50 seeds, timeout 30 s, smaller comparisons
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import mlflow_di  # noqa: F401  (torchvision guard before anything imports torchvision)
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
START, END = "<!-- bench_fuzz -->", "<!-- /bench_fuzz -->"
STRATEGIES = ("dflare", "dflare-d", "dflare-r", "diffchaser")

#: The paper's figures (notes/dflare.md); LeNet-5 8-bit where the paper gives it per pair,
#: otherwise its average over the 21 pairs.
PAPER = {
    "dflare": "100%, 117.02 queries, 0.706 s (LeNet-5 8-bit)",
    "dflare-d": "83% success on average, ~55x DFlare's queries (average over pairs)",
    "dflare-r": "~1.05x DFlare's queries (average over pairs)",
    "diffchaser": "74-99.9% success, 3,642 queries, 52 s (average over pairs)",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 seeds, timeout 30 s, 20 seeds for lockstep vs sequential")
    parser.add_argument("--seeds", type=int, help="MNIST test seeds for DFlare (default 500, quick 50)")
    parser.add_argument("--ablation-seeds", type=int, help="seeds for dflare-d, dflare-r, diffchaser (default: --seeds)")
    parser.add_argument("--sequential-seeds", type=int, help="seeds for lockstep vs sequential (default 50, quick 20)")
    parser.add_argument("--timeout", type=float, help="per-seed timeout in seconds (default 180, quick 30)")
    parser.add_argument("--batch", type=int, default=64, help="seeds in lockstep")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies to run")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and TFLite")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed")
    parser.add_argument("--shared", default=os.environ.get("MLFLOW_DI_SHARED", str(REPO.parent / "shared")))
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "RESULTS.md"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    quick = args.quick
    args.seeds = args.seeds or (50 if quick else 500)
    args.ablation_seeds = args.ablation_seeds or args.seeds
    args.sequential_seeds = args.sequential_seeds or (20 if quick else 50)
    args.timeout = args.timeout or (30.0 if quick else 180.0)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    return args


def load_pair(shared: pathlib.Path, threads: int):
    """(original TorchClassifier, compressed TFLiteClassifier) for the LeNet-5 pair."""
    os.environ["MLFLOW_DI_THREADS"] = str(threads)  # read by the ONNX/TFLite backends
    import torch

    torch.set_num_threads(threads)
    from mlflow_di.models.classifier import TFLiteClassifier
    from mlflow_di.models.keras_import import import_keras

    original = import_keras("lenet5-same", shared / "models" / "dflare" / "lenet5.h5").classifier()
    compressed = TFLiteClassifier(shared / "models" / "dflare" / "lenet5-quan.lite")
    return original, compressed


def inference_seconds_per_input(models, images: np.ndarray, batch: int, min_seconds: float = 3.0) -> float:
    """Both models' own predict_proba time per input, on batches of ``batch`` images."""
    batches = [images[i:i + batch] for i in range(0, len(images) - batch + 1, batch)] or [images]
    for model in models:
        model.predict_proba(batches[0])  # warm-up (TFLite re-plans for a new batch size)
    inputs, began = 0, time.perf_counter()
    while time.perf_counter() - began < min_seconds:
        for chunk in batches:
            for model in models:
                model.predict_proba(chunk)
            inputs += len(chunk)
    return (time.perf_counter() - began) / inputs


def timed_campaign(original, compressed, seeds, **kwargs):
    from mlflow_di.fuzz import run_campaign

    began = time.perf_counter()
    result = run_campaign(original, compressed, seeds, **kwargs)
    return result, time.perf_counter() - began


#: The parts of a record that reflect the search's decisions (probabilities at the trigger are
#: left out: their last bits depend on the batch the trigger was computed in).
DECISIONS = ("success", "stop", "queries", "operators", "operator_counts", "trigger_labels")


def same_search(first, second) -> bool:
    """True when two runs of one seed made the same decisions and found the same trigger."""
    a, b = first.to_dict(), second.to_dict()
    return all(a[key] == b[key] for key in DECISIONS)


def fmt(value, digits=2, suffix="") -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{suffix}"


def main(argv=None) -> int:
    args = parse_args(argv)
    shared = pathlib.Path(args.shared)
    if not (shared / "models" / "dflare" / "lenet5.h5").exists():
        print(f"reference models not found under {shared}; set --shared or MLFLOW_DI_SHARED", file=sys.stderr)
        return 2
    from mlflow_di.data import load_images

    load_at_start = os.getloadavg()
    original, compressed = load_pair(shared, args.threads)
    seeds = load_images(f"mnist:{shared / 'data' / 'mnist'}[0:{args.seeds}]")
    progress = not args.no_progress
    common = dict(timeout=args.timeout, batch=args.batch, seed=args.seed, progress=progress)

    model_before = inference_seconds_per_input((original, compressed), seeds.images, args.batch)
    print(f"models: {model_before * 1e6:.1f} us per input (both, batch {args.batch})", flush=True)

    runs = {}
    for name in args.strategies:
        count = args.seeds if name == "dflare" else args.ablation_seeds
        result, wall = timed_campaign(original, compressed, seeds.subset(slice(0, count)), strategy=name, **common)
        runs[name] = (result, wall)
        s = result.summary
        print(f"{name}: success {s.success_rate:.1%}, mean queries {fmt(s.mean_queries)}, "
              f"mean s {fmt(s.mean_seconds, 3)}, wall {wall:.1f} s", flush=True)

    sequential_seeds = seeds.subset(slice(0, args.sequential_seeds))
    lockstep, lockstep_wall = timed_campaign(original, compressed, sequential_seeds, strategy="dflare", **common)
    alone, alone_wall = timed_campaign(original, compressed, sequential_seeds, strategy="dflare",
                                       **{**common, "batch": 1})
    model_after = inference_seconds_per_input((original, compressed), seeds.images, args.batch)
    model_per_input = (model_before + model_after) / 2

    section = report(args, runs, (lockstep, lockstep_wall), (alone, alone_wall), model_before, model_after,
                     model_per_input, load_at_start)
    print(section)
    write_section(pathlib.Path(args.results), section)
    return 0


def report(args, runs, lockstep_run, alone_run, model_before, model_after, model_per_input, load_at_start) -> str:
    lockstep, lockstep_wall = lockstep_run
    alone, alone_wall = alone_run
    lockstep_qps = lockstep.summary.total_queries / lockstep_wall
    alone_qps = alone.summary.total_queries / alone_wall
    same = sum(same_search(a, b) for a, b in zip(lockstep.records, alone.records))
    same_triggers = (lockstep.triggers.shape == alone.triggers.shape
                     and np.array_equal(lockstep.triggers, alone.triggers))
    command = "python benchmarks/bench_fuzz.py " + " ".join(sys.argv[1:]) if sys.argv[1:] else "python benchmarks/bench_fuzz.py"
    lines = [
        "## Differential fuzzing (bench_fuzz)",
        "",
        f"Command: `{command}` (from the repository root, `.venv/bin/python`).",
        f"Pair: LeNet-5 ('same' padding) Keras original imported to PyTorch vs `lenet5-quan.lite` (TFLite, 8-bit). "
        f"Seeds: MNIST test images [0:{args.seeds}] (ablations and DiffChaser: [0:{args.ablation_seeds}]). "
        f"Per-seed timeout {args.timeout:g} s, {args.batch} seeds in lockstep, campaign seed {args.seed}, "
        f"{args.threads} thread(s) per model; machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"load average at start {load_at_start[0]:.2f} (shared with other jobs, so seconds are noisy; ratios are "
        "measured in the same run).",
        "",
        "| strategy | seeds | already deviating | success | mean queries | median queries | mean s / trigger | campaign wall s | paper |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (result, wall) in runs.items():
        s = result.summary
        lines.append(f"| {name} | {s.seeds} | {s.already_deviating} | {s.success_rate:.1%} ({s.triggers}/{s.fuzzed}) | "
                     f"{fmt(s.mean_queries)} | {fmt(s.median_queries, 1)} | {fmt(s.mean_seconds, 3)} | {wall:.1f} | "
                     f"{PAPER.get(name, '')} |")
    lines += [
        "",
        f"Lockstep vs one seed at a time (DFlare, seeds [0:{args.sequential_seeds}]): "
        f"{lockstep_qps:,.0f} vs {alone_qps:,.0f} queries/s, ratio **{lockstep_qps / alone_qps:.2f}x** "
        f"({lockstep_wall:.1f} s vs {alone_wall:.1f} s); {same}/{len(lockstep.records)} seeds made the same "
        f"decisions (queries, operators, labels) in both modes; trigger images "
        f"{'identical' if same_triggers else 'differ'}.",
    ]
    checks = []
    if "dflare" in runs:
        result, wall = runs["dflare"]
        s = result.summary
        per_query = wall / max(s.total_queries, 1)
        overhead = per_query / model_per_input
        lines += [
            "",
            f"Overhead (DFlare campaign): {per_query * 1e6:.1f} us per query (campaign wall / queries) vs "
            f"{model_per_input * 1e6:.1f} us per input for the two models' own batched inference "
            f"(batch {args.batch}; {model_before * 1e6:.1f} before, {model_after * 1e6:.1f} after the campaigns): "
            f"ratio **{overhead:.2f}**.",
        ]
        stats = result.run_stats
        if stats is not None and s.total_queries:
            lines.append(
                f"Where the campaign's time went: model calls {stats.model_seconds:.1f} s "
                f"({stats.model_seconds / s.total_queries * 1e6:.1f} us per query; {stats.calls:,} calls, mean batch "
                f"{stats.mean_batch:.1f}: seeds that need many queries run nearly alone at the end, where batching "
                f"has little to share), searches (mutation, fitness, selection) {stats.search_seconds:.1f} s "
                f"({stats.search_seconds / s.total_queries * 1e6:.1f} us per query), the rest (seed check, saving, "
                f"progress) {wall - stats.model_seconds - stats.search_seconds:.1f} s.")
        checks += [
            ("DFlare success >= 99%", s.success_rate >= 0.99, f"{s.success_rate:.1%}"),
            ("overhead <= 1.5", overhead <= 1.5, f"{overhead:.2f}"),
            ("whole DFlare campaign < 10 min", wall < 600, f"{wall:.0f} s"),
        ]
        if "diffchaser" in runs and s.mean_queries and runs["diffchaser"][0].summary.mean_queries:
            ratio = runs["diffchaser"][0].summary.mean_queries / s.mean_queries
            checks.append(("DiffChaser >= 10x DFlare's mean queries", ratio >= 10, f"{ratio:.1f}x"))
    checks.append(("lockstep faster than sequential", lockstep_qps > alone_qps, f"{lockstep_qps / alone_qps:.2f}x"))
    lines += ["", "| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else 'no'} | {value} |" for name, ok, value in checks]
    return "\n".join(lines) + "\n"


def write_section(path: pathlib.Path, section: str) -> None:
    """Replace the text between the bench_fuzz markers (create the file or the section if missing)."""
    block = f"{START}\n{section}{END}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
