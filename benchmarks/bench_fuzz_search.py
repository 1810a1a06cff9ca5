"""How few queries DFlare's variants need per triggering input (script, not a test).

Pair: the DFlare LeNet-5 ('same' padding) Keras original imported to PyTorch vs its 8-bit TFLite
version ``lenet5-quan.lite``. Seeds: MNIST test images [0:500] (tuning range) and [5000:5500]
(held out: never tuned on). Every named strategy runs once per campaign seed (``--runs``, seeds
0..runs-1) with a per-seed cap of ``--max-queries`` (30,000, as the reference-code measurements
in notes/dflare.md). Reported per strategy and seed range: success rate, mean and median queries
per trigger (over the seeds that triggered, the paper's convention), each averaged over the
campaign seeds, and the per-run values.

Strategies are names of :data:`mlflow_di.fuzz.strategies.STRATEGIES`, plus ``reference-code``
(DFlare as the released code runs it, :func:`benchmarks.bench_fuzz.reference_dflare`) and
``<name>:<option>=<value>,...`` for settings of the DFlare dataclass (ablations), e.g.
``dflare:restart=0``. From the repository root:

    .venv/bin/python -m benchmarks.bench_fuzz_search                       # the full run, writes RESULTS.md
    .venv/bin/python -m benchmarks.bench_fuzz_search --ranges 0:200 --runs 2 --no-write --strategies dflare
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

import mlflow_di  # noqa: F401  (torchvision guard)

from benchmarks.results import RESULTS, write_section

REPO = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_fuzz_search -->", "<!-- /bench_fuzz_search -->"
DEFAULT_STRATEGIES = ("dflare", "dflare-paper", "reference-code", "dflare-d", "dflare-r")
DEFAULT_RANGES = ("0:500", "5000:5500")


def make(spec: str):
    """A strategy object from ``name`` or ``name:option=value,...`` (see the module docstring)."""
    from mlflow_di.fuzz.strategies import make_strategy

    name, _, options = spec.partition(":")
    if name == "reference-code":
        from benchmarks.bench_fuzz import reference_dflare
        strategy = reference_dflare()
    else:
        strategy = make_strategy(name)
    if options:
        changes = {}
        for item in options.split(","):
            key, _, value = item.partition("=")
            try:
                changes[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                changes[key] = value
        strategy = dataclasses.replace(strategy, name=spec, **changes)
    return strategy


def run_one(original, compressed, seeds, spec: str, run: int, max_queries: int, batch: int, timeout: float) -> dict:
    from mlflow_di.fuzz.campaign import run_campaign

    began = time.perf_counter()
    result = run_campaign(original, compressed, seeds, strategy=make(spec), timeout=timeout, max_queries=max_queries,
                          batch=batch, seed=run, progress=False)
    summary = result.summary
    return {"strategy": spec, "seeds": seeds.name, "run": run, "fuzzed": summary.fuzzed,
            "triggers": summary.triggers, "success": summary.success_rate, "mean": summary.mean_queries,
            "median": summary.median_queries, "total_queries": summary.total_queries,
            "wall": time.perf_counter() - began}


def fmt(value, digits=1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def table(rows: list[dict], strategies: list[str], ranges: list[str]) -> list[str]:
    lines = ["| strategy | seeds | success | mean queries | median queries | per run: mean / median / success |",
             "|---|---|---|---|---|---|"]
    for spec in strategies:
        for seed_range in ranges:
            runs = [r for r in rows if r["strategy"] == spec and r["range"] == seed_range]
            if not runs:
                continue
            per_run = "; ".join(f"{fmt(r['mean'])} / {fmt(r['median'])} / {100 * r['success']:.1f}%" for r in runs)
            lines.append(f"| {spec} | [{seed_range}] x {len(runs)} | "
                         f"{100 * statistics.mean(r['success'] for r in runs):.2f}% | "
                         f"{fmt(statistics.mean(r['mean'] for r in runs))} | "
                         f"{fmt(statistics.mean(r['median'] for r in runs))} | {per_run} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=";".join(DEFAULT_STRATEGIES),
                        help="';'-separated strategy specs (name or name:option=value,...)")
    parser.add_argument("--ranges", default=",".join(DEFAULT_RANGES), help="comma-separated MNIST test index ranges")
    parser.add_argument("--runs", type=int, default=5, help="campaign seeds 0..runs-1")
    parser.add_argument("--max-queries", type=int, default=30000)
    parser.add_argument("--timeout", type=float, default=1e6, help="per-seed seconds (the query cap decides)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shared", default=os.environ.get("MLFLOW_DI_SHARED", str(REPO.parent / "shared")))
    parser.add_argument("--jsonl", help="append one JSON line per campaign here (and reuse the lines found)")
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    args = parser.parse_args(argv)
    from benchmarks.bench_fuzz import load_pair
    from mlflow_di.data import load_images

    strategies = [s.strip() for s in args.strategies.split(";") if s.strip()]
    ranges = [r.strip() for r in args.ranges.split(",") if r.strip()]
    original, compressed = load_pair(pathlib.Path(args.shared), args.threads)
    done = []
    if args.jsonl and pathlib.Path(args.jsonl).exists():
        done = [json.loads(line) for line in pathlib.Path(args.jsonl).read_text().splitlines() if line.strip()]
    rows = []
    began = time.perf_counter()
    for seed_range in ranges:
        seeds = load_images(f"mnist:{pathlib.Path(args.shared) / 'data' / 'mnist'}[{seed_range}]")
        for spec in strategies:
            for run in range(args.runs):
                key = (spec, seed_range, run, args.max_queries)
                row = next((r for r in done if (r["strategy"], r["range"], r["run"], r["max_queries"]) == key), None)
                if row is None:
                    row = run_one(original, compressed, seeds, spec, run, args.max_queries, args.batch, args.timeout)
                    row.update(range=seed_range, max_queries=args.max_queries)
                    if args.jsonl:
                        with open(args.jsonl, "a") as handle:
                            handle.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
                rows.append(row)
    lines = table(rows, strategies, ranges)
    print("\n".join(lines))
    if args.no_write:
        return 0
    command = "`.venv/bin/python -m benchmarks.bench_fuzz_search" + (
        "" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv)) + "`"
    section = [BEGIN, "## DFlare search efficiency (bench_fuzz_search)", "",
               f"Command: {command} (from the repository root; {time.perf_counter() - began:,.0f} s).",
               "Pair: LeNet-5 ('same' padding) Keras original imported to PyTorch vs `lenet5-quan.lite` (TFLite, "
               f"8-bit). Seeds: MNIST test images {', '.join(f'[{r}]' for r in ranges)} ([0:500] is where the search "
               "was tuned; [5000:5500] was never tuned on). Per seed: at most "
               f"{args.max_queries:,} queries; {args.runs} campaign seeds (`--seed 0..{args.runs - 1}`), "
               f"{args.batch} seeds in lockstep.", "",
               *lines, "",
               "Success, mean and median queries per trigger (over the seeds that triggered, the paper's convention) "
               "are averaged over the campaign seeds; per run: mean / median / success of each campaign seed in "
               "order. `dflare` is the default (DFlare's loop with the log-margin fitness, "
               "`mlflow_di/fuzz/dflare.py`); `dflare-paper` is the paper's fitness D / delta + O with the paper's "
               "acceptance rule; `reference-code` is DFlare as the released code runs it (its acceptance rule, uint8 "
               "wrap-around in two noise operators, Metropolis-Hastings bug; `benchmarks/bench_fuzz.py`). Ablations "
               "of the default: `dflare-d` without the novelty term, `dflare-r` with random operator choice, "
               "`dflare-paper` is the default with the paper's fitness (`fitness='gap'`); `dflare:<option>=...` rows "
               "are the default with one setting changed (`acceptance='strict'`: ties rejected; `restart`/`escalate`: "
               "back to the seed after N rejections in a row / operator applied 1 + s // K times after s "
               "rejections; `fitness='margin-both'`: the smaller of both models' margins). "
               "Paper (LeNet-5 8-bit, its own unpublished seed selection): 100% success, mean 117.02 queries.",
               END]
    write_section("\n".join(section), BEGIN, END, pathlib.Path(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
