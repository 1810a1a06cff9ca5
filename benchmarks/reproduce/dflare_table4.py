"""DFlare Table 4: DFlare, DFlare_D, DFlare_R and DiffChaser on original/compressed model pairs.

Pairs (:data:`benchmarks.reproduce.config.PAIRS`): the paper's LeNet-1 and LeNet-5 with their
TFLite 8-bit versions, and the DFlare LeNet-5 with the package's own ``int8-static`` (calibrated
on the first 500 MNIST test images) and ``prune-l1`` (30% of the weights) ONNX exports. Every
campaign runs through ``run_campaign``'s public signature on the first ``fuzz_seeds`` test
images; runs differ in the campaign seed. Each finished campaign is saved at once
(``<out>/dflare_table4/<pair>__<strategy>__run<r>.json``) and skipped when the command is run
again with the same settings, so a long run can be interrupted and continued.
"""
from __future__ import annotations

import collections
import json
import pathlib
import time

from mlflow_di.fuzz.campaign import run_campaign

from benchmarks.reproduce.config import EXPENSIVE, Config
from benchmarks.reproduce.dflare_variants import harness_strategy
from benchmarks.reproduce.results import ExperimentResult, Log
from benchmarks.reproduce.subjects import pair_description

#: Campaign settings a saved campaign must share with the current config to be reused.
SETTINGS = ("fuzz_timeout", "fuzz_max_queries", "calibration_size", "prune_amount", "mode")


def plan(config: Config, strategy: str) -> tuple[int, int]:
    """(seeds, runs) for ``strategy``: DiffChaser and dflare-d-bug may have their own, smaller budget."""
    if strategy in EXPENSIVE:
        return (config.diffchaser_seeds or config.fuzz_seeds, config.diffchaser_runs or config.fuzz_runs)
    return config.fuzz_seeds, config.fuzz_runs


def max_queries(config: Config, strategy: str) -> int | None:
    """The query cap of ``strategy``'s campaigns: the expensive strategies' own, when set."""
    if strategy in EXPENSIVE and config.expensive_max_queries is not None:
        return config.expensive_max_queries
    return config.fuzz_max_queries


def campaign_record(result, pair: str, strategy: str, run: int, wall: float, config: Config, seeds: int) -> dict:
    summary = result.summary
    stops = collections.Counter(r.stop for r in result.records)
    return {"pair": pair, "strategy": strategy, "run": run, "seeds": summary.seeds, "fuzzed": summary.fuzzed,
            "already_deviating": summary.already_deviating, "triggers": summary.triggers,
            "success_rate": summary.success_rate, "mean_queries": summary.mean_queries,
            "median_queries": summary.median_queries, "mean_seconds": summary.mean_seconds,
            "total_queries": summary.total_queries, "total_seconds": summary.total_seconds,
            "wall_seconds": wall, "stops": dict(stops), "complete": result.complete,
            "settings": _settings(config, seeds)}


def _settings(config: Config, seeds: int) -> dict:
    settings = {"seeds": seeds, **{key: getattr(config, key) for key in SETTINGS}}
    if config.expensive_max_queries is not None:  # only when set: campaigns saved before it existed stay reusable
        settings["expensive_max_queries"] = config.expensive_max_queries
    return settings


def _record_path(folder: pathlib.Path, pair: str, strategy: str, run: int) -> pathlib.Path:
    return folder / f"{pair}__{strategy}__run{run}.json"


def _saved(path: pathlib.Path, config: Config, seeds: int) -> dict | None:
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if record.get("settings") == _settings(config, seeds) and record.get("complete") else None


def run(config: Config, subjects, log: Log, out: pathlib.Path | None = None) -> ExperimentResult:
    folder = (out or subjects.work_dir) / "dflare_table4"
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for pair_name in config.fuzz_pairs:
        pair = None
        for strategy in config.fuzz_strategies:
            n_seeds, runs = plan(config, strategy)
            seeds = subjects.fuzz_seeds.subset(slice(0, n_seeds), f"{subjects.fuzz_seeds.name}[0:{n_seeds}]")
            for run_index in range(runs):
                path = _record_path(folder, pair_name, strategy, run_index)
                record = _saved(path, config, len(seeds))
                if record is None:
                    if pair is None:
                        pair = subjects.pair(pair_name)
                    log(f"dflare_table4: {pair_name} {strategy} run {run_index + 1}/{runs} on {len(seeds)} seeds")
                    started = time.perf_counter()
                    result = run_campaign(pair.original, pair.compressed, seeds, strategy=harness_strategy(strategy),
                                          timeout=config.fuzz_timeout, max_queries=max_queries(config, strategy),
                                          batch=config.fuzz_batch, seed=run_index, progress=False)
                    record = campaign_record(result, pair_name, strategy, run_index, time.perf_counter() - started,
                                             config, len(seeds))
                    if not result.complete:  # interrupted: keep nothing half-done
                        raise KeyboardInterrupt
                    path.write_text(json.dumps(record, indent=1))
                    log(f"dflare_table4: {pair_name} {strategy} run {run_index + 1}: success "
                        f"{record['success_rate']:.1%}, mean queries {record['mean_queries']}, "
                        f"{record['wall_seconds']:.0f} s")
                records.append(record)
    meta = {"seeds": config.fuzz_seeds, "runs": config.fuzz_runs, "timeout": config.fuzz_timeout,
            "plan": {strategy: plan(config, strategy) for strategy in config.fuzz_strategies},
            "max_queries": config.fuzz_max_queries,
            "max_queries_by_strategy": {strategy: max_queries(config, strategy) for strategy in config.fuzz_strategies},
            "pairs": {name: pair_description(name, config) for name in config.fuzz_pairs}}
    return ExperimentResult("dflare_table4", records, meta, config.to_dict())
