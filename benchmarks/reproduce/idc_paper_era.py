"""IDC under the paper-era protocol (benchmarks only): what DeepImportance's Table 3 scripts computed.

The paper's IDC figures on U_O came from ``TABLE3_VALIDATION_MNIST.py -C c`` (one digit at a
time) with ``coverages/comb_cov.py`` as of the repository's first commit. This experiment adds
that protocol's ingredients one at a time, for each LeNet and m, so each one's effect shows:

1. ``pooled``: the product's IDC (all classes, ReLU-correct epsilon LRP, k-means as the paper says);
2. ``per_class``: the product's ``coverage --per-class`` (:class:`PerClassCoverage`), mean over the
   ten classes;
3. ``reference``: per class, important neurons from the reference LRP (:mod:`reference_lrp`: no
   conv ReLUs, plain z-rule; signed sum over the class's correctly classified analysis inputs), the
   reference clustering (exact zeros dropped, fewer than 10 values -> centroid 0, centroids
   rounded to 2 decimals), each neuron compared with its own centroids;
4. ``paper_era``: 3 with comb_cov.py's pairing: the centroids are stored in ascending neuron
   order (``quantizeSilhouette`` skips neurons not in the set) while a test input's activations
   are read in relevance order, so the i-th most relevant neuron is compared with the centroids
   of the important neuron with the i-th smallest index.

Test inputs of class c are U_O's inputs labelled c, as in the script. Every stage is run with
``rq2_runs`` k-means seeds (the reference's k-means was unseeded). The paper-era protocol is also
scored on RQ2's U_O+S and U_O+DI (the same noise as RQ2's run of that seed), so its trend can be
compared with the paper's. :class:`ReferenceTraces` also serves RQ3 and RQ5's paper-era columns.
"""
from __future__ import annotations

import numpy as np
import torch

from mlflow_di.coverage.activations import PreprocessedImages, collect_activations, default_layer
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.coverage.per_class import PerClassCoverage
from mlflow_di.coverage.clustering import choose_clusters, nearest_centroid

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.idc_rq2 import noisy_sets
from benchmarks.reproduce.reference_lrp import reference_relevance
from benchmarks.reproduce.results import ExperimentResult, Log

STAGES = ("pooled", "per_class", "reference", "paper_era")
#: The paper-era protocol on RQ2's noisy unions too (the same noise as RQ2's run with the same seed).
EXTENDED = ("paper_era_U_O+S", "paper_era_U_O+DI")


class ReferenceTraces:
    """One model's reference relevance on the analysis set, and the per-class reference fits made from it.

    ``layer`` (default: the default subject layer) is the layer whose neurons are ranked and clustered;
    :meth:`idc` scores any labelled set of inputs with the fits of every class, which are made once per
    (class, m, seed) and reused for every set.
    """

    def __init__(self, model, analysis, layer: str | None = None):
        self.model, self.layer = model, layer or default_layer(model.module)
        inputs = torch.as_tensor(np.asarray(model.preprocessing.apply(analysis.images)))
        self.relevance = reference_relevance(model.module, inputs, self.layer)
        self.analysis_values = self.values(analysis.images)
        self.analysis_labels = analysis.labels
        self.correct = model.classifier().predict(analysis.images) == analysis.labels
        self._fits: dict[tuple[int, int, int], tuple[np.ndarray, dict]] = {}

    def values(self, images) -> np.ndarray:
        """(N, neurons) activations of the layer (conv neuron: channel mean), as the reference reads them."""
        return collect_activations(self.model.module, PreprocessedImages(images, self.model.preprocessing),
                                   [self.layer])[self.layer]

    def fit(self, label: int, top_m: int, seed: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """Class ``label``'s important neurons (relevance order) and their centroids (reference clustering)."""
        key = (label, top_m, seed)
        if key not in self._fits:
            members = (self.analysis_labels == label) & self.correct
            order = np.argsort(-self.relevance[members].sum(0), kind="stable")[:top_m]
            self._fits[key] = order, {int(n): choose_clusters(self.analysis_values[members, n], seed=seed,
                                                              reference_quirks=True).centroids for n in order}
        return self._fits[key]

    def idc(self, values: np.ndarray, labels: np.ndarray, top_m: int, seed: int) -> dict[str, float | list]:
        """Per-class IDC_m of the set (``values`` from :meth:`values`, true ``labels``): its mean over the
        classes with reference pairing and with comb_cov.py's, and the latter per class."""
        classes = [int(c) for c in np.unique(self.analysis_labels)]
        scores = [class_idc(*self.fit(c, top_m, seed), values[labels == c]) for c in classes]
        return {"reference": float(np.nanmean([s["reference"] for s in scores])),
                "paper_era": float(np.nanmean([s["paper_era"] for s in scores])),
                "paper_era_per_class": [s["paper_era"] for s in scores]}


def class_idc(order: np.ndarray, centroids: dict[int, np.ndarray], values: np.ndarray) -> dict[str, float]:
    """IDC of one class's test activations ``values`` (N, neurons), correctly paired and as comb_cov.py paired."""
    total = int(np.prod([len(c) for c in centroids.values()]))
    paired = {"reference": [centroids[int(n)] for n in order],            # neuron i <-> its own centroids
              "paper_era": [centroids[int(n)] for n in np.sort(order)]}  # neuron i <-> i-th smallest index's
    chosen = values[:, order]  # relevance order, as comb_cov.py reads them
    result = {}
    for stage, lists in paired.items():
        cells = np.stack([nearest_centroid(chosen[:, i], c) for i, c in enumerate(lists)], axis=1)
        result[stage] = len(np.unique(cells, axis=0)) / total if len(cells) else float("nan")
    return result


def measure_model(config: Config, subjects, name: str, model_index: int, log: Log) -> list[dict]:
    model, analysis, test = subjects.idc_models[name], subjects.analysis, subjects.test
    log(f"idc_paper_era: {name} reference relevance and activations")
    traces = subjects.reference_traces(name)
    test_values = traces.values(test.images)
    rows = {m: {"model": name, "layer": traces.layer, "top_m": m, **{k: [] for k in STAGES + EXTENDED}}
            for m in config.rq2_top_m}
    per_class = {m: [] for m in config.rq2_top_m}
    for seed in range(config.rq2_runs):
        added = noisy_sets(config, subjects, name, model_index, seed)  # RQ2's U_O+S and U_O+DI of this run
        union = {key: (np.concatenate([test_values, traces.values(data.images)]), np.concatenate([test.labels, data.labels]))
                 for key, data in added.items()}
        for m in config.rq2_top_m:
            log(f"idc_paper_era: {name} m={m} seed {seed}")
            row = rows[m]
            row["pooled"].append(subjects.idc(name, m, seed).score(test).idc)
            estimator = PerClassCoverage(ImportanceDrivenCoverage(top_m=m, seed=seed, progress=False), progress=False)
            row["per_class"].append(estimator.fit(model, analysis).score(test).mean_idc)
            original = traces.idc(test_values, test.labels, m, seed)
            row["reference"].append(original["reference"])
            row["paper_era"].append(original["paper_era"])
            per_class[m].append(original["paper_era_per_class"])
            for key, (values, labels) in union.items():
                row[f"paper_era_U_O+{key}"].append(traces.idc(values, labels, m, seed)["paper_era"])
    for m, row in rows.items():
        row["paper_era_per_class"] = np.mean(per_class[m], axis=0).tolist()
    return list(rows.values())


def run(config: Config, subjects, log: Log) -> ExperimentResult:
    rows = []
    for index, name in enumerate(subjects.idc_models):
        rows.extend(measure_model(config, subjects, name, index, log))
    meta = {"runs": config.rq2_runs, "analysis": subjects.analysis.name, "test": subjects.test.name,
            "test_inputs": len(subjects.test)}
    return ExperimentResult("idc_paper_era", rows, meta, config.to_dict())
