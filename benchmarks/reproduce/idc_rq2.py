"""IDC RQ2 (paper Table 3): does IDC see the diversity that relevance-guided perturbation adds?

Three test sets per LeNet: U_O (the test set), U_O+S (U_O plus copies of it with Gaussian noise,
std 0.75 on the 0..1 scale, on randomly chosen pixels) and U_O+DI (the same noise on each input's
top-2% most relevant pixels; S uses as many pixels, chosen among the others). IDC for m in
{6, 8, 10, 12} and the classic criteria; every run redraws the noise and reseeds IDC's k-means.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.data import ImageSet

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.perturb import gaussian_on_pixels, random_pixel_mask
from benchmarks.reproduce.results import ExperimentResult, Log

SETS = ("U_O", "U_O+S", "U_O+DI")


def noisy_sets(config: Config, subjects, name: str, model_index: int, run: int) -> dict[str, ImageSet]:
    """The added inputs of U_O+S and U_O+DI for one run: ``rq2_copies`` noisy copies of U_O each."""
    test = subjects.test
    relevant = subjects.relevant_mask(name, config.rq2_pixel_fraction)
    rng = np.random.default_rng([2, model_index, run])
    random_copies, relevant_copies = [], []
    for _ in range(config.rq2_copies):
        random_copies.append(gaussian_on_pixels(test.images, random_pixel_mask(relevant, rng), config.rq2_noise_std, rng))
        relevant_copies.append(gaussian_on_pixels(test.images, relevant, config.rq2_noise_std, rng))
    labels = np.tile(test.labels, config.rq2_copies)
    return {"S": ImageSet(np.concatenate(random_copies), labels, f"S(run {run})"),
            "DI": ImageSet(np.concatenate(relevant_copies), labels, f"DI(run {run})")}


def measure_model(config: Config, subjects, name: str, model_index: int, log: Log) -> tuple[list[dict], dict]:
    test = subjects.test
    criteria = subjects.criteria(name)
    base = criteria.score(test)
    values: dict[str, dict[str, list[float]]] = {}
    totals: dict[str, list[int]] = {}
    accuracy = {"U_O": [subjects.accuracy(name)], "S": [], "DI": []}
    classifier = subjects.idc_models[name].classifier()
    for run in range(config.rq2_runs):
        log(f"idc_rq2: {name} run {run + 1}/{config.rq2_runs}")
        added = noisy_sets(config, subjects, name, model_index, run)
        for key, data in added.items():
            accuracy[key].append(float((classifier.predict(data.images) == data.labels).mean()))
        scored = {"U_O": base, "U_O+S": base.merge(criteria.score(added["S"])),
                  "U_O+DI": base.merge(criteria.score(added["DI"]))}
        for criterion in base.criteria:
            for set_name, report in scored.items():
                values.setdefault(criterion, {}).setdefault(set_name, []).append(report.coverage[criterion])
        for m in config.rq2_top_m:
            idc = subjects.idc(name, m, run)
            original = idc.score(test)
            key = f"idc_{m}"
            totals.setdefault(key, []).append(original.total)
            for set_name, report in (("U_O", original), ("U_O+S", idc.score(added["S"], accumulate=original)),
                                     ("U_O+DI", idc.score(added["DI"], accumulate=original))):
                values.setdefault(key, {}).setdefault(set_name, []).append(report.idc)
    order = [f"idc_{m}" for m in config.rq2_top_m] + list(base.criteria)
    rows = [{"model": name, "criterion": criterion, **values[criterion],
             "combinations": totals.get(criterion)} for criterion in order]
    return rows, {key: [float(v) for v in runs] for key, runs in accuracy.items()}


def run(config: Config, subjects, log: Log) -> ExperimentResult:
    rows, accuracy = [], {}
    for index, name in enumerate(subjects.idc_models):
        model_rows, accuracy[name] = measure_model(config, subjects, name, index, log)
        rows.extend(model_rows)
    meta = {"runs": config.rq2_runs, "copies": config.rq2_copies, "test_inputs": len(subjects.test),
            "noise_std": config.rq2_noise_std, "pixel_fraction": config.rq2_pixel_fraction,
            "accuracy": accuracy}
    return ExperimentResult("idc_rq2", rows, meta, config.to_dict())
