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
``rq2_runs`` k-means seeds (the reference's k-means was unseeded).
"""
from __future__ import annotations

import numpy as np
import torch

from mlflow_di.coverage.activations import PreprocessedImages, collect_activations, default_layer
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.coverage.per_class import PerClassCoverage
from mlflow_di.coverage.quantize import choose_clusters, nearest_centroid

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.reference_lrp import reference_relevance
from benchmarks.reproduce.results import ExperimentResult, Log

STAGES = ("pooled", "per_class", "reference", "paper_era")


class ReferenceTraces:
    """One model's reference relevance (analysis set) and subject-layer activations (both sets)."""

    def __init__(self, model, analysis, test):
        self.layer = default_layer(model.module)
        inputs = torch.as_tensor(np.asarray(model.preprocessing.apply(analysis.images)))
        self.relevance = reference_relevance(model.module, inputs, self.layer)
        self.analysis_values = self._values(model, analysis.images)
        self.test_values = self._values(model, test.images)
        self.correct = model.classifier().predict(analysis.images) == analysis.labels

    def _values(self, model, images):
        return collect_activations(model.module, PreprocessedImages(images, model.preprocessing), [self.layer])[self.layer]


def reference_class_idc(traces: ReferenceTraces, analysis_labels, test_labels, label: int, top_m: int, seed: int
                        ) -> dict[str, float]:
    """IDC_m of class ``label`` with reference relevance and clustering: correctly paired and as comb_cov.py paired."""
    members = (analysis_labels == label) & traces.correct
    order = np.argsort(-traces.relevance[members].sum(0), kind="stable")[:top_m]  # relevance order
    centroids = {int(n): choose_clusters(traces.analysis_values[members, n], seed=seed, reference_quirks=True).centroids
                 for n in order}
    values = traces.test_values[test_labels == label][:, order]
    total = int(np.prod([len(c) for c in centroids.values()]))
    paired = {"reference": [centroids[int(n)] for n in order],            # neuron i <-> its own centroids
              "paper_era": [centroids[int(n)] for n in np.sort(order)]}  # neuron i <-> i-th smallest index's
    result = {}
    for stage, lists in paired.items():
        cells = np.stack([nearest_centroid(values[:, i], c) for i, c in enumerate(lists)], axis=1)
        result[stage] = len(np.unique(cells, axis=0)) / total if len(cells) else float("nan")
    return result


def measure_model(config: Config, subjects, name: str, log: Log) -> list[dict]:
    model, analysis, test = subjects.idc_models[name], subjects.analysis, subjects.test
    log(f"idc_paper_era: {name} reference relevance and activations")
    traces = ReferenceTraces(model, analysis, test)
    labels = [int(c) for c in np.unique(analysis.labels)]
    rows = []
    for m in config.rq2_top_m:
        values: dict[str, list[float]] = {stage: [] for stage in STAGES}
        per_class_reference: list[list[float]] = []
        for seed in range(config.rq2_runs):
            log(f"idc_paper_era: {name} m={m} seed {seed}")
            values["pooled"].append(subjects.idc(name, m, seed).score(test).idc)
            per_class = PerClassCoverage(ImportanceDrivenCoverage(top_m=m, seed=seed, progress=False), progress=False)
            values["per_class"].append(per_class.fit(model, analysis).score(test).mean_idc)
            classes = [reference_class_idc(traces, analysis.labels, test.labels, c, m, seed) for c in labels]
            for stage in ("reference", "paper_era"):
                values[stage].append(float(np.nanmean([c[stage] for c in classes])))
            per_class_reference.append([c["paper_era"] for c in classes])
        rows.append({"model": name, "layer": traces.layer, "top_m": m, **values,
                     "paper_era_per_class": np.mean(per_class_reference, axis=0).tolist()})
    return rows


def run(config: Config, subjects, log: Log) -> ExperimentResult:
    rows = []
    for name in subjects.idc_models:
        rows.extend(measure_model(config, subjects, name, log))
    meta = {"runs": config.rq2_runs, "analysis": subjects.analysis.name, "test": subjects.test.name,
            "test_inputs": len(subjects.test)}
    return ExperimentResult("idc_paper_era", rows, meta, config.to_dict())
