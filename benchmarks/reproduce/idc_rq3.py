"""IDC RQ3 (paper Table 4): do adversarial inputs raise IDC more than Gaussian noise does?

For each LeNet: U_O alone, then U_O plus one set of FGSM, BIM, JSMA, C&W (ART, see
:mod:`benchmarks.reproduce.attacks`) or Gaussian-noise inputs made from the first U_O inputs.
IDC_6, IDC_8 and the classic criteria of each union. The sets have different sizes (C&W is
slow), so the table also gives IDC_6 of U_O plus only the first ``rq3_cw_inputs`` inputs of each
set, for each m: a size-matched comparison. ``paper_era_idc_m``: the same unions under the
paper-era protocol (per class, reference LRP and clustering, comb_cov.py's pairing; see
:mod:`benchmarks.reproduce.idc_paper_era`), as the paper's Table 4 script measured them.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.data import ImageSet

from benchmarks.reproduce.attacks import ATTACKS, attack_inputs, cached_attack_set
from benchmarks.reproduce.config import Config
from benchmarks.reproduce.results import ExperimentResult, Log


def measure_model(config: Config, subjects, name: str, cache_dir, log: Log) -> list[dict]:
    model = subjects.idc_models[name]
    test = subjects.test
    criteria = subjects.criteria(name)
    base = criteria.score(test)
    idcs = {m: subjects.idc(name, m, 0) for m in config.rq3_top_m}
    originals = {m: idc.score(test) for m, idc in idcs.items()}
    matched = min(config.rq3_cw_inputs, *(attack_inputs(a, config) for a in ATTACKS))
    traces = subjects.reference_traces(name)
    test_values = traces.values(test.images)

    def paper_era(values, labels) -> dict[str, float]:
        return {f"paper_era_idc_{m}": traces.idc(values, labels, m, 0)["paper_era"] for m in config.rq3_top_m}

    rows = [{"model": name, "set": "U_O", "inputs": len(test), "success_float": None, "success": None,
             "seconds": 0.0, **{f"idc_{m}": r.idc for m, r in originals.items()}, **base.coverage,
             **{f"matched_idc_{m}": r.idc for m, r in originals.items()}, **paper_era(test_values, test.labels)}]
    for attack in ATTACKS:
        n = min(attack_inputs(attack, config), len(test))
        log(f"idc_rq3: {name} {attack} on {n} inputs")
        made = cached_attack_set(attack, model, test.images[:n], config, cache_dir)
        added = ImageSet(made.images, test.labels[:n], attack)
        row = {"model": name, "set": f"U_O+{attack}", "inputs": n, "success_float": made.success_float,
               "success": made.success, "seconds": made.seconds}
        for m, idc in idcs.items():
            row[f"idc_{m}"] = idc.score(added, accumulate=originals[m]).idc
        row.update(base.merge(criteria.score(added)).coverage)
        for m, idc in idcs.items():
            row[f"matched_idc_{m}"] = idc.score(added.subset(slice(0, matched)), accumulate=originals[m]).idc
        row.update(paper_era(np.concatenate([test_values, traces.values(added.images)]),
                             np.concatenate([test.labels, added.labels])))
        rows.append(row)
    return rows


def run(config: Config, subjects, log: Log, cache_dir=None) -> ExperimentResult:
    rows = []
    for name in subjects.idc_models:
        rows.extend(measure_model(config, subjects, name, cache_dir or subjects.work_dir / "attacks", log))
    matched = min(config.rq3_cw_inputs, *(attack_inputs(a, config) for a in ATTACKS))
    meta = {"test_inputs": len(subjects.test), "matched_inputs": matched, "top_m": list(config.rq3_top_m),
            "attack_inputs": {a: min(attack_inputs(a, config), len(subjects.test)) for a in ATTACKS}}
    return ExperimentResult("idc_rq3", rows, meta, config.to_dict())
