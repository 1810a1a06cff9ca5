"""IDC RQ5 (paper Table 5): IDC of every hidden layer (conv1, conv2, fc1, fc2) of the LeNets.

One multi-layer IDC model (``ImportanceDrivenCoverage(layers="all")``, a single relevance pass), scored on U_O and
on U_O+DI (the RQ2 relevance-guided noise set, as DeepImportance's layer-sensitivity script does).
A layer narrower than m (LeNet-1's conv1 has 4 channels) uses all of its neurons.

To explain differences between layers, each row also gives how alike the important neurons
behave on U_O: the mean |Pearson r| between their activations, and their mean |r| with the
amount of ink (mean pixel value) of the input. Strongly correlated neurons reach few of their
cluster combinations. ``paper_era_*``: each layer's IDC under the paper-era protocol (per class,
reference LRP and clustering, comb_cov.py's pairing; :mod:`benchmarks.reproduce.idc_paper_era`),
which DeepImportance's layer script used.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.coverage.activations import PreprocessedImages, collect_activations
from mlflow_di.coverage.idc import ImportanceDrivenCoverage

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.idc_rq2 import noisy_sets
from benchmarks.reproduce.results import ExperimentResult, Log


def mean_abs_correlation(values: np.ndarray) -> float:
    """Mean |Pearson r| between the columns of (N, k) ``values`` (constant columns count as 0)."""
    if values.shape[1] < 2:
        return float("nan")
    with np.errstate(invalid="ignore", divide="ignore"):
        matrix = np.nan_to_num(np.corrcoef(values.T))
    return float(np.abs(matrix[~np.eye(len(matrix), dtype=bool)]).mean())


def ink_correlation(values: np.ndarray, images: np.ndarray) -> float:
    """Mean |Pearson r| of each column of ``values`` with the inputs' mean pixel value."""
    ink = images.reshape(len(images), -1).mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.mean([abs(np.nan_to_num(np.corrcoef(column, ink)[0, 1])) for column in values.T]))


def measure_model(config: Config, subjects, name: str, model_index: int, log: Log) -> list[dict]:
    model = subjects.idc_models[name]
    by_layer: dict[str, dict] = {}
    test = subjects.test
    for run in range(config.rq5_runs):
        log(f"idc_rq5: {name} run {run + 1}/{config.rq5_runs}")
        idc = ImportanceDrivenCoverage(layers="all", top_m=config.rq5_top_m, seed=run, progress=False).fit(
            model, subjects.analysis)
        original = idc.score(test)
        added = noisy_sets(config, subjects, name, model_index, run)["DI"]
        with_di = idc.score(added, accumulate=original)
        activations = collect_activations(model.module, PreprocessedImages(test.images, model.preprocessing),
                                          idc.layers_)
        for layer, fitted in idc.fitted_layers_.items():
            row = by_layer.setdefault(layer, {"model": name, "layer": layer, "m": fitted.top_m, "combinations": [],
                                              "U_O": [], "U_O+DI": [], "correlation": [], "ink_correlation": [],
                                              "paper_era_U_O": [], "paper_era_U_O+DI": []})
            row["combinations"].append(original[layer].total)
            row["U_O"].append(original[layer].idc)
            row["U_O+DI"].append(with_di[layer].idc)
            important = activations[layer][:, fitted.important_neurons]
            row["correlation"].append(mean_abs_correlation(important))
            row["ink_correlation"].append(ink_correlation(important, test.images))
            traces = subjects.reference_traces(name, layer)
            values = activations[layer]
            row["paper_era_U_O"].append(traces.idc(values, test.labels, fitted.top_m, run)["paper_era"])
            union = np.concatenate([values, traces.values(added.images)]), np.concatenate([test.labels, added.labels])
            row["paper_era_U_O+DI"].append(traces.idc(*union, fitted.top_m, run)["paper_era"])
    return list(by_layer.values())


def run(config: Config, subjects, log: Log) -> ExperimentResult:
    rows = []
    for index, name in enumerate(subjects.idc_models):
        rows.extend(measure_model(config, subjects, name, index, log))
    meta = {"runs": config.rq5_runs, "top_m": config.rq5_top_m, "test_inputs": len(subjects.test)}
    return ExperimentResult("idc_rq5", rows, meta, config.to_dict())
