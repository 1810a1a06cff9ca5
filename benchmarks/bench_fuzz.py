"""Benchmark of the fuzzing engine on the DFlare paper's LeNet-5 pair (script, not a test).

Original: the Keras LeNet-5 ('same' padding) imported into PyTorch; compressed: its 8-bit
TFLite version. Seeds: the first N images of the MNIST test split. Measures, in one run:

* per strategy (dflare, dflare-paper, dflare-paper-d, dflare-paper-r, diffchaser): success rate, mean/median queries
  and mean seconds per triggering input, next to the paper's figures. Every search stops at
  the per-seed timeout or at ``--max-queries``, whichever comes first: this machine runs a
  query ~100x faster than the paper's setup, so a time budget alone would give the searches
  far more queries than the paper's 180 s did;
* DFlare with the reference code's behaviours (acceptance rule, uint8 wrap-around in two
  noise operators, Metropolis-Hastings bug; see :func:`reference_dflare`), to show how much of
  the gap to the paper's query count they explain;
* lockstep (``--batch`` seeds at once) against one seed at a time, same seeds and settings:
  queries per second and their ratio, and how many seeds gave identical results;
* overhead: DFlare campaign seconds per query divided by the two models' own batched
  inference seconds per input (``predict_proba`` on batches of the same size, measured right
  before and after the campaign; the mean is used), in ``--overhead-rounds`` rounds of which
  the lowest ratio counts, as other jobs on a shared machine only add time.

Writes its section of benchmarks/RESULTS.md between the bench_fuzz markers. From the
repository root:

    .venv/bin/python -m benchmarks.bench_fuzz            # the full run (500 seeds, timeout 180 s)
    .venv/bin/python -m benchmarks.bench_fuzz --quick    # 50 seeds, timeout 30 s, smaller comparisons
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import platform
import sys
import time

import mlflow_di  # noqa: F401  (torchvision guard before anything imports torchvision)
import numpy as np

from benchmarks.results import RESULTS, write_section
from mlflow_di.fuzz.dflare import DFlare
from mlflow_di.fuzz.mutations import default_operators

REPO = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_fuzz -->", "<!-- /bench_fuzz -->"
STRATEGIES = ("dflare", "dflare-paper", "dflare-paper-d", "dflare-paper-r", "diffchaser")
REFERENCE = "dflare (reference code)"

#: The paper's figures (notes/dflare.md); LeNet-5 8-bit where the paper gives it per pair,
#: otherwise its average over the 21 pairs.
PAPER = {
    "dflare": "(not in the paper: log-margin fitness)",
    "dflare-paper": "100%, 117.02 queries, 0.706 s (LeNet-5 8-bit)",
    "dflare-paper-d": "DFlare_D: 83% success, ~55x DFlare's queries (average over pairs; from a never-accepting bug)",
    "dflare-paper-r": "~1.05x DFlare's queries (average over pairs)",
    "diffchaser": "74-99.9% success, 3,642 queries, 52 s (average over pairs)",
    REFERENCE: "(the code behind the paper's figures)",
}


# --- the reference code's behaviours, for the comparison row only (the engine follows the paper) ---

def _reference_cast(values: np.ndarray) -> np.ndarray:
    """The reference's ``.astype(np.uint8)`` on float pixels: truncation, then wrap-around (300 -> 44)."""
    return (np.trunc(values).astype(np.int64) % 256).astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class ReferenceGaussianNoise:
    """``img + N(0, sqrt(0.1))`` cast as the reference does (most pixels drop one level)."""

    name: str = "gaussian_noise"

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _reference_cast(image + rng.standard_normal(image.shape) * math.sqrt(0.1))


@dataclasses.dataclass(frozen=True)
class ReferenceMultiplicativeNoise:
    """``img + img * N(mean, sqrt(var))`` cast as the reference does (bright strokes can wrap to dark)."""

    name: str = "multiplicative_noise"

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        mean, sigma = -0.5 + rng.random(), math.sqrt(0.05 * rng.random())
        return _reference_cast(image + image * (rng.standard_normal(image.shape) * sigma + mean))


def reference_operators() -> tuple:
    operators = list(default_operators())
    operators[0], operators[2] = ReferenceGaussianNoise(), ReferenceMultiplicativeNoise()
    return tuple(operators)


def reference_dflare() -> DFlare:
    """DFlare as the reference code (yqtianust/DFlare, test_gen_main.py) runs it: its acceptance rule
    (a mutant replaces x_max when | |D(x)| - |D(x_max)| | > 1e-3 (a drop counts too) or when it is
    novel, starting from D(x_max) = 0), operators that cast with wrap-around, and
    Metropolis-Hastings ignoring the previous operator."""
    return DFlare(name=REFERENCE, acceptance="reference", reference_bug=True, operators=reference_operators())


# --- the benchmark ---

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 seeds, timeout 30 s, 20 seeds for lockstep vs sequential")
    parser.add_argument("--seeds", type=int, help="MNIST test seeds for DFlare (default 500, quick 50)")
    parser.add_argument("--ablation-seeds", type=int, help="seeds for the other strategies (default: --seeds)")
    parser.add_argument("--sequential-seeds", type=int, help="seeds for lockstep vs sequential (default 50, quick 20)")
    parser.add_argument("--timeout", type=float, help="per-seed timeout in seconds (default 180, quick 30)")
    parser.add_argument("--max-queries", type=int, default=30000,
                        help="per-seed query budget for every strategy (default 30,000: about what the paper's 180 s "
                             "bought DFlare, 0.706 s per 117 queries)")
    parser.add_argument("--batch", type=int, default=64, help="seeds in lockstep")
    parser.add_argument("--overhead-rounds", type=int, default=2,
                        help="rounds of (models, DFlare campaign, models) for the overhead ratio; the lowest counts")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies to run")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference-code DFlare row")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and TFLite")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed")
    parser.add_argument("--shared", default=os.environ.get("MLFLOW_DI_SHARED", str(REPO.parent / "shared")))
    parser.add_argument("--results", default=str(RESULTS))
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
    os.environ["MLFLOW_DI_THREADS"] = str(threads)  # read by the torch and TFLite backends
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
    common = dict(timeout=args.timeout, max_queries=args.max_queries, batch=args.batch, seed=args.seed,
                  progress=progress)

    # Overhead: the models' own batched cost measured right before and after each DFlare campaign,
    # so that the load of other jobs on a shared machine drifts as little as possible in between.
    rounds = []
    for _ in range(max(1, args.overhead_rounds)):
        before = inference_seconds_per_input((original, compressed), seeds.images, args.batch)
        result, wall = timed_campaign(original, compressed, seeds, strategy="dflare", **common)
        after = inference_seconds_per_input((original, compressed), seeds.images, args.batch)
        rounds.append(OverheadRound(before, after, wall, result))
        print(f"overhead round {len(rounds)}: ratio {rounds[-1].ratio:.2f} (models {before * 1e6:.1f} / "
              f"{after * 1e6:.1f} us per input, campaign {rounds[-1].per_query * 1e6:.1f} us per query)", flush=True)

    runs = {}
    strategies = list(args.strategies) + ([] if args.no_reference else [reference_dflare()])
    for strategy in strategies:
        name = strategy if isinstance(strategy, str) else strategy.name
        if name == "dflare":
            runs[name] = (rounds[0].result, rounds[0].wall)
            continue
        result, wall = timed_campaign(original, compressed, seeds.subset(slice(0, args.ablation_seeds)),
                                      strategy=strategy, **common)
        runs[name] = (result, wall)
        s = result.summary
        print(f"{name}: success {s.success_rate:.1%}, mean queries {fmt(s.mean_queries)}, "
              f"mean s {fmt(s.mean_seconds, 3)}, wall {wall:.1f} s", flush=True)

    sequential_seeds = seeds.subset(slice(0, args.sequential_seeds))
    lockstep, lockstep_wall = timed_campaign(original, compressed, sequential_seeds, strategy="dflare", **common)
    alone, alone_wall = timed_campaign(original, compressed, sequential_seeds, strategy="dflare",
                                       **{**common, "batch": 1})

    section = report(args, runs, (lockstep, lockstep_wall), (alone, alone_wall), rounds, load_at_start,
                     os.getloadavg())
    print(section)
    write_section(section, BEGIN, END, pathlib.Path(args.results))
    return 0


@dataclasses.dataclass
class OverheadRound:
    """One DFlare campaign between two measurements of the models' own batched cost."""

    model_before: float
    model_after: float
    wall: float
    result: object

    @property
    def model_per_input(self) -> float:
        return (self.model_before + self.model_after) / 2

    @property
    def per_query(self) -> float:
        return self.wall / max(self.result.summary.total_queries, 1)

    @property
    def ratio(self) -> float:
        return self.per_query / self.model_per_input


def report(args, runs, lockstep_run, alone_run, rounds, load_at_start, load_at_end) -> str:
    lockstep, lockstep_wall = lockstep_run
    alone, alone_wall = alone_run
    lockstep_qps = lockstep.summary.total_queries / lockstep_wall
    alone_qps = alone.summary.total_queries / alone_wall
    same = sum(same_search(a, b) for a, b in zip(lockstep.records, alone.records))
    same_triggers = (lockstep.triggers.shape == alone.triggers.shape
                     and np.array_equal(lockstep.triggers, alone.triggers))
    command = " ".join([".venv/bin/python -m benchmarks.bench_fuzz", *sys.argv[1:]])
    lines = [
        BEGIN,
        "## Differential fuzzing (bench_fuzz)",
        "",
        f"Command: `{command}` (from the repository root).",
        f"Pair: LeNet-5 ('same' padding) Keras original imported to PyTorch vs `lenet5-quan.lite` (TFLite, 8-bit). "
        f"Seeds: MNIST test images [0:{args.seeds}] (other strategies: [0:{args.ablation_seeds}]). "
        f"Per seed: timeout {args.timeout:g} s or {args.max_queries:,} queries, whichever comes first. "
        f"{args.batch} seeds in lockstep, campaign seed {args.seed}, "
        f"{args.threads} thread(s) per model; machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"load average {load_at_start[0]:.2f} at start and {load_at_end[0]:.2f} at the end (shared with other jobs, "
        "so seconds are noisy; ratios are measured in the same run).",
        "",
        "| strategy | seeds | already deviating | success | mean queries | median queries | mean s / trigger | "
        "campaign wall s | paper |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (result, wall) in runs.items():
        s = result.summary
        lines.append(f"| {name} | {s.seeds} | {s.already_deviating} | {s.success_rate:.1%} ({s.triggers}/{s.fuzzed}) | "
                     f"{fmt(s.mean_queries)} | {fmt(s.median_queries, 1)} | {fmt(s.mean_seconds, 3)} | {wall:.1f} | "
                     f"{PAPER.get(name, '')} |")
    notes = ["Means and medians are over the seeds that triggered (the paper's convention)."]
    if "diffchaser" in runs:
        notes.append("`diffchaser` is a reconstruction: the paper's Algorithm 1 with pixel-level crossover and "
                     "mutation; its fitness formula, population size, selection and mutation amounts are documented "
                     "guesses (`mlflow_di/fuzz/diffchaser.py`).")
    if REFERENCE in runs:
        notes.append(f"`{REFERENCE}` is DFlare with the reference code's acceptance rule (a mutant is kept when |D| "
                     "changes by more than 1e-3 either way, or when it is novel), its uint8 wrap-around in two noise "
                     "operators and its Metropolis-Hastings bug; the engine follows the paper instead (kept when "
                     "H(x) >= H(x_max)).")
    lines += [
        "",
        " ".join(notes),
        "",
        f"Lockstep vs one seed at a time (DFlare, seeds [0:{args.sequential_seeds}]): "
        f"{lockstep_qps:,.0f} vs {alone_qps:,.0f} queries/s, ratio **{lockstep_qps / alone_qps:.2f}x** "
        f"({lockstep_wall:.1f} s vs {alone_wall:.1f} s); {same}/{len(lockstep.records)} seeds made the same "
        f"decisions (queries, operators, labels) in both modes; trigger images "
        f"{'identical' if same_triggers else 'differ'}.",
    ]
    checks, reasons = [], []
    if "dflare" in runs:
        s, wall = runs["dflare"][0].summary, runs["dflare"][1]
        best = min(rounds, key=lambda r: r.ratio)
        overhead, model_per_input, stats = best.ratio, best.model_per_input, best.result.run_stats
        lines += [
            "",
            f"Overhead (DFlare campaign, {len(rounds)} round(s) of: the two models' own batched inference at batch "
            f"{args.batch}, the campaign, the models again): ratios "
            + ", ".join(f"{r.ratio:.2f} ({r.per_query * 1e6:.1f} us per query vs {r.model_per_input * 1e6:.1f} us "
                        f"per input; models {r.model_before * 1e6:.1f} before, {r.model_after * 1e6:.1f} after)"
                        for r in rounds)
            + f". The lowest counts (other jobs on the shared machine only add time): ratio **{overhead:.2f}**.",
        ]
        if stats is not None and s.total_queries:
            model_per_query = stats.model_seconds / s.total_queries
            search_per_query = stats.search_seconds / s.total_queries
            lines.append(
                f"Where that campaign's time went: model calls {stats.model_seconds:.1f} s "
                f"({model_per_query * 1e6:.1f} us per query; {stats.calls:,} calls, {stats.inputs:,} inputs for "
                f"{s.total_queries:,} queries, mean batch {stats.mean_batch:.1f}; when fewer than {args.batch} seeds "
                f"are left, each proposes several inputs speculatively and unused ones are dropped), searches "
                f"(mutation, fitness, selection) {stats.search_seconds:.1f} s "
                f"({search_per_query * 1e6:.1f} us per query), the rest (seed check, saving, progress) "
                f"{best.wall - stats.model_seconds - stats.search_seconds:.1f} s.")
            if overhead > 1.5:
                reasons.append(
                    f"Overhead: the searches' own Python work ({search_per_query * 1e6:.0f} us per query: mutation, "
                    f"novelty, operator selection) is {search_per_query / model_per_input:.0%} of the models' batched "
                    f"cost per input, and model calls cost {model_per_query / model_per_input:.2f}x their batched cost "
                    "per query in the campaign.")
        checks += [
            ("DFlare success >= 99%", s.success_rate >= 0.99, f"{s.success_rate:.1%}"),
            ("overhead <= 1.5", overhead <= 1.5, f"{overhead:.2f}"),
            ("whole DFlare campaign < 10 min", wall < 600, f"{wall:.0f} s"),
        ]
        if "diffchaser" in runs and s.mean_queries and runs["diffchaser"][0].summary.mean_queries:
            chaser = runs["diffchaser"][0].summary
            ratio = chaser.mean_queries / s.mean_queries
            checks.append(("DiffChaser >= 10x DFlare's mean queries", ratio >= 10, f"{ratio:.1f}x"))
            if ratio < 10:
                reasons.append(
                    f"DiffChaser: the reconstruction needs {chaser.mean_queries:,.0f} mean queries on the seeds it "
                    f"solves ({chaser.success_rate:.1%} of them within the budget); its settings were fixed before "
                    "measuring, not tuned towards the target.")
    checks.append(("lockstep faster than sequential", lockstep_qps > alone_qps, f"{lockstep_qps / alone_qps:.2f}x"))
    if "dflare" in runs:
        s, wall = runs["dflare"][0].summary, runs["dflare"][1]
        stops = [r.stop for r in runs["dflare"][0].records if not r.success and not r.already_deviating]
        if s.success_rate < 0.99:
            reasons.append(f"DFlare success: {len(stops)} seeds stopped without a trigger "
                           f"({stops.count('timeout')} at the timeout, {stops.count('max_queries')} at the query budget).")
        if wall >= 600:
            reasons.append(f"Campaign time: {wall:.0f} s for {s.total_queries:,} queries on a machine with load "
                           f"{load_at_end[0]:.1f} at the end.")
    if lockstep_qps <= alone_qps:
        reasons.append(f"Lockstep: {lockstep_qps:,.0f} vs {alone_qps:,.0f} queries/s on {args.sequential_seeds} seeds; "
                       "too few seeds to fill a batch, or the machine's load changed between the two runs.")
    lines += ["", "| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else 'no'} | {value} |" for name, ok, value in checks]
    if reasons:
        lines += ["", "Why the unmet targets are unmet:", ""] + [f"* {reason}" for reason in reasons]
    lines.append(END)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
