"""DFlare RQ4 (dissemination): the further a model drifts from the original, the faster DFlare
finds a deviation.

From the DFlare LeNet-5, make models with x% of all weights (conv and dense kernels, drawn
uniformly over the whole network) each multiplied by 1 + 0.1 or 1 - 0.1 (random sign), for x in
10..50. For each, run DFlare against the original on the seed images and record the mean
queries and seconds per triggering input (each seed's search stops at its first deviation);
Pearson's r of those against x, and a plot.
"""
from __future__ import annotations

import copy
import pathlib

import numpy as np
import torch
from torch import nn

from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.models.classifier import TorchClassifier

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.results import ExperimentResult, Log, mean_std

PLOT_NAME = "dflare_rq4.png"


def mutate_weights(module: nn.Module, percent: float, scale: float, rng: np.random.Generator) -> nn.Module:
    """A copy of ``module`` with ``percent``% of its weight elements (kernels, not biases) scaled by 1 +/- scale."""
    mutated = copy.deepcopy(module)
    weights = [p for name, p in mutated.named_parameters() if name.endswith("weight")]
    flat = torch.cat([p.detach().reshape(-1) for p in weights]).numpy().astype(np.float64)
    count = int(round(len(flat) * percent / 100.0))
    chosen = rng.choice(len(flat), size=count, replace=False)
    flat[chosen] *= 1.0 + scale * rng.choice([-1.0, 1.0], size=count)
    offset = 0
    with torch.no_grad():
        for parameter in weights:
            size = parameter.numel()
            parameter.copy_(torch.from_numpy(flat[offset:offset + size]).reshape(parameter.shape))
            offset += size
    return mutated.eval()


def pearson(xs, ys) -> float | None:
    """Pearson's r, or None when it is undefined (fewer than 3 finite points or no spread)."""
    from scipy.stats import pearsonr

    points = [(float(x), float(y)) for x, y in zip(xs, ys) if y is not None and np.isfinite(y)]
    if len(points) < 3 or len({p[0] for p in points}) < 2 or len({p[1] for p in points}) < 2:
        return None
    return float(pearsonr([p[0] for p in points], [p[1] for p in points])[0])


def correlations(rows: list[dict]) -> dict:
    """Pearson's r of x against the mean queries / seconds, over the per-x means and over all campaigns."""
    percents = sorted({row["percent"] for row in rows})
    means = {key: [mean_std(r[key] for r in rows if r["percent"] == p)[0] for p in percents]
             for key in ("mean_queries", "mean_seconds")}
    return {
        "queries_of_means": pearson(percents, means["mean_queries"]),
        "seconds_of_means": pearson(percents, means["mean_seconds"]),
        "queries_all_campaigns": pearson([r["percent"] for r in rows], [r["mean_queries"] for r in rows]),
        "seconds_all_campaigns": pearson([r["percent"] for r in rows], [r["mean_seconds"] for r in rows]),
    }


def plot(rows: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Mean queries and seconds per triggering input against x (mean and std over runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    percents = sorted({row["percent"] for row in rows})
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for axis, key, label in ((axes[0], "mean_queries", "queries per triggering input"),
                             (axes[1], "mean_seconds", "seconds per triggering input")):
        stats = [mean_std(r[key] for r in rows if r["percent"] == p) for p in percents]
        axis.errorbar(percents, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o", capsize=3)
        axis.set_xlabel("% of weights mutated by +/-10%")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    figure.suptitle("DFlare on mutated copies of the DFlare LeNet-5 (mean, std over runs)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def run(config: Config, subjects, log: Log, out: pathlib.Path | None = None) -> ExperimentResult:
    source = subjects.dflare_original
    original = source.classifier()
    seeds = subjects.dissemination_seeds
    rows = []
    for run_index in range(config.rq4_runs):
        for percent in config.rq4_percents:
            log(f"dflare_rq4: {percent}% of weights, run {run_index + 1}/{config.rq4_runs}")
            rng = np.random.default_rng([4, run_index, percent])
            mutated = TorchClassifier(mutate_weights(source.module, percent, config.rq4_scale, rng),
                                      source.preprocessing, f"{source.name}-mutated-{percent}pct")
            result = run_campaign(original, mutated, seeds, strategy="dflare-paper", timeout=config.rq4_timeout,
                                  max_queries=config.fuzz_max_queries, batch=config.fuzz_batch, seed=run_index,
                                  progress=False)
            summary = result.summary
            rows.append({"percent": percent, "run": run_index, "seeds": summary.seeds,
                         "seed_agreement": 1.0 - summary.already_deviating / summary.seeds,
                         "success_rate": summary.success_rate, "mean_queries": summary.mean_queries,
                         "median_queries": summary.median_queries, "mean_seconds": summary.mean_seconds})
    plot_path = plot(rows, (out or subjects.work_dir) / PLOT_NAME)
    meta = {"seeds": len(seeds), "runs": config.rq4_runs, "scale": config.rq4_scale, "timeout": config.rq4_timeout,
            "plot": plot_path.name, "pearson": correlations(rows), "source": source.name}
    return ExperimentResult("dflare_rq4", rows, meta, config.to_dict())
