"""How far the relevance rule, the clustering quirks and the size of U_O move pooled IDC_6.

For each LeNet, IDC_6 of U_O under (a) the package's defaults (epsilon-LRP, clustering as the
paper says) and (b) the product's z-rule with the reference code's clustering quirks (drop exact
zeros, fewer than 10 values -> centroid 0, centroids rounded to 2 decimals), each scored on the
first 1,000, 2,500 and all U_O inputs. The z-rule here keeps the conv ReLUs: the reference LRP
that drops them is in the paper-era experiment (:mod:`benchmarks.reproduce.idc_paper_era`). The
important neurons, each neuron's silhouette-chosen cluster count and so |INCC| are listed,
because IDC is covered / |INCC| and one neuron's k moving from 2 to 4 halves it.
"""
from __future__ import annotations

from mlflow_di.coverage.idc import ImportanceDrivenCoverage

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.results import ExperimentResult, Log

VARIANTS = {"defaults (epsilon-LRP)": {},
            "z-rule (conv ReLUs kept), reference clustering": {"rule": "z", "reference_quirks": True}}
TOP_M = 6


def test_sizes(n: int) -> list[int]:
    return sorted({min(n, 1000), min(n, 2500), min(n, 5000), n})


def run(config: Config, subjects, log: Log) -> ExperimentResult:
    rows = []
    m = min(TOP_M, config.rq1_top_m) if config.mode == "tiny" else TOP_M
    for name, model in subjects.idc_models.items():
        for label, settings in VARIANTS.items():
            log(f"idc_sensitivity: {name} {label}")
            idc = ImportanceDrivenCoverage(top_m=m, progress=False, **settings).fit(model, subjects.analysis)
            row = {"model": name, "variant": label, "layer": idc.layer_,
                   "important_neurons": [int(n) for n in idc.important_neurons_],
                   "clusters": idc.clusters_per_neuron_, "combinations": idc.total_combinations_, "idc": {}}
            for size in test_sizes(len(subjects.test)):
                row["idc"][str(size)] = idc.score(subjects.test.subset(slice(0, size))).idc
            rows.append(row)
    meta = {"top_m": m, "sizes": test_sizes(len(subjects.test))}
    return ExperimentResult("idc_sensitivity", rows, meta, config.to_dict())
