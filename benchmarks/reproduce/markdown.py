"""Render the saved experiment results as REPRODUCTION.md: each table beside the paper's figures.

Every table is followed by a *trend check* computed from its own numbers (so the sentence is
true for whatever run produced them) and, for full-configuration results, by the investigation
notes in :mod:`benchmarks.reproduce.commentary`. Each section says exactly which settings
produced it and where they differ from the full configuration.
"""
from __future__ import annotations

import math
import os
import pathlib
import platform

from benchmarks.reproduce import EXPERIMENTS, commentary, paper
from benchmarks.reproduce.config import make_config
from benchmarks.reproduce.results import ExperimentResult, mean_std

CLASSIC = ("nc", "kmnc", "nbc", "snac", "tknc", "lsc", "dsc")
TITLES = {
    "idc_rq1": "IDC RQ1: important vs random neurons (paper Table 2)",
    "idc_rq2": "IDC RQ2: diversity of U_O, U_O+S, U_O+DI (paper Table 3)",
    "idc_paper_era": "IDC under the paper-era protocol: per class, reference LRP, comb_cov.py's pairing (paper Table 3)",
    "idc_sensitivity": "IDC sensitivity: relevance rule, clustering quirks and the size of U_O",
    "idc_classic": "Classic criteria on U_O: defaults, SADL's bucket rule, DeepImportance's layer set (paper Table 4, U_O row)",
    "idc_rq3": "IDC RQ3: adversarial and noise inputs (paper Table 4)",
    "idc_rq5": "IDC RQ5: IDC per layer (paper Table 5)",
    "idc_rq6": "IDC RQ6: retraining LeNet-5 with IDC-guided vs random inputs (the project site's RQ6)",
    "dflare_table4": "DFlare Table 4: DFlare, DFlare_D, DFlare_R, DiffChaser",
    "dflare_rq4": "DFlare RQ4: dissemination (mutated weights)",
}


# ------------------------------------------------------------------------------ formatting
def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def pct(value, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.{digits}f}"


def pct_ms(values, digits: int = 1) -> str:
    """Percent "mean (std)" of several runs, or the single value."""
    values = _finite(values if isinstance(values, (list, tuple)) else [values])
    if not values:
        return "-"
    mean, std = mean_std(values)
    return f"{100 * mean:.{digits}f}" if len(values) == 1 else f"{100 * mean:.{digits}f} ({100 * std:.{digits}f})"


def num_ms(values, digits: int = 2) -> str:
    values = _finite(values if isinstance(values, (list, tuple)) else [values])
    if not values:
        return "-"
    mean, std = mean_std(values)
    return f"{mean:,.{digits}f}" if len(values) == 1 else f"{mean:,.{digits}f} ({std:,.{digits}f})"


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _mean(values) -> float:
    return mean_std(values)[0]


# ------------------------------------------------------------------------------ settings
def settings_line(result: ExperimentResult) -> str:
    """The mode and every setting of this experiment that differs from the full configuration."""
    config = result.config
    full = make_config("full", shared=config["shared"]).to_dict()
    prefixes = {"idc_sensitivity": ("test_size",), "idc_classic": ("test_size",), "idc_paper_era": ("rq2_runs", "rq2_top_m"),
                "idc_rq1": ("rq1_",), "idc_rq2": ("rq2_",), "idc_rq3": ("rq3_",), "idc_rq5": ("rq5_", "rq2_"),
                "idc_rq6": ("rq6_", "fuzz_max"),
                "dflare_table4": ("fuzz_", "calibration", "prune", "diffchaser"),
                "dflare_rq4": ("rq4_", "fuzz_max", "fuzz_batch")}
    keys = [k for k in config if k.startswith(prefixes[result.name]) or k in ("analysis_size", "test_size")]
    if result.name.startswith("dflare") or result.name == "idc_rq6":
        keys = [k for k in keys if k not in ("analysis_size", "test_size")]
    differences = [f"`{k}={_show(config[k])}` (full: {_full_value(k, full)})" for k in keys
                   if _show(config[k]) != _show(full[k])]
    mode = config["mode"]
    command = result.meta.get("command")
    when = f"finished {result.finished}, {result.seconds / 60:.1f} min" + (f", by `{command}`" if command else "")
    if mode == "full" and not differences:
        return f"Configuration: **full** ({when})."
    what = "reduced from the full configuration" if mode == "full" else f"**{mode}** mode, not the full configuration"
    return f"Configuration: {what}: " + ", ".join(differences or ["(none)"]) + f" ({when})."


def _full_value(key: str, full: dict) -> str:
    if key.startswith("diffchaser_") and full[key] is None:
        same = "fuzz_seeds" if key.endswith("seeds") else "fuzz_runs"
        return f"as for the other strategies, `{full[same]}`"
    return f"`{_show(full[key])}`"


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# ------------------------------------------------------------------------------ sections
def idc_rq1(result: ExperimentResult) -> tuple[str, list[str]]:
    rows = []
    for r in result.rows:
        pool = f" (pool of {r['random_pool']})" if r["random_pool"] <= r["m"] else ""
        draws = r["random_draw_means"]
        rows.append([r["model"], f"{r['layer']} ({r['neurons']})", r["m"], f"{r['pixels_flipped']:.1f}",
                     f"{r['important_mean']:.3f} ({r['important_std']:.3f})",
                     f"{r['random_mean']:.3f} ({r['random_std']:.3f}){pool}",
                     f"{min(draws):.3f}-{max(draws):.3f}", f"{r['ratio']:.2f}", pct(r["share_important_larger"])])
    text = table(["model", "subject layer (neurons)", "m", "pixels flipped", "L2 change, important: mean (std)",
                  "L2 change, random: mean (std)", "random: per-draw means", "ratio", "% inputs important > random"],
                 rows)
    larger = [r for r in result.rows if r["ratio"] > 1]
    checks = [f"Important neurons' activations changed more than random neurons' for {len(larger)} of "
              f"{len(result.rows)} models (mean-change ratio {min(r['ratio'] for r in result.rows):.2f} to "
              f"{max(r['ratio'] for r in result.rows):.2f}); the paper reports the same direction."
              if result.rows else "No rows."]
    return text, checks


def idc_rq2(result: ExperimentResult, paper_era: ExperimentResult | None = None) -> tuple[str, list[str]]:
    """RQ2's table; with the paper-era results, their U_O figure beside each IDC row (same model and m)."""
    era = {(r["model"], f"idc_{r['top_m']}"): r["paper_era"] for r in (paper_era.rows if paper_era else [])}
    rows = []
    for r in result.rows:
        paper_value = paper.IDC_UO.get((r["model"], r["criterion"]))
        combos = f"{int(_mean(r['combinations'])):,}" if r.get("combinations") else ""
        era_value = era.get((r["model"], r["criterion"]))
        rows.append([r["model"], _criterion_name(r["criterion"]), combos, pct_ms(r["U_O"]), pct_ms(r["U_O+S"]),
                     pct_ms(r["U_O+DI"]), "" if era_value is None else pct_ms(era_value),
                     "" if paper_value is None else f"{paper_value:.1f}"])
    text = table(["model", "criterion", "combinations", "U_O %", "U_O+S %", "U_O+DI %",
                  "paper-era protocol U_O % (next section)", "paper U_O %"], rows)
    accuracy = result.meta.get("accuracy", {})
    if accuracy:
        text += "\n\nModel accuracy on the sets (mean over runs): " + "; ".join(
            f"{name} U_O {pct(_mean(a['U_O']))}%, S {pct(_mean(a['S']))}%, DI {pct(_mean(a['DI']))}%"
            for name, a in accuracy.items()) + "."
    return text, rq2_checks(result)


def _criterion_name(criterion: str) -> str:
    return f"IDC_{criterion.split('_')[1]}" if criterion.startswith("idc_") else criterion.upper()


def rq2_checks(result: ExperimentResult) -> list[str]:
    idc_rows = [r for r in result.rows if r["criterion"].startswith("idc_")]
    di_over_s = [r for r in idc_rows if _mean(r["U_O+DI"]) > _mean(r["U_O+S"])]
    s_over_o = [r for r in idc_rows if _mean(r["U_O+S"]) > _mean(r["U_O"])]
    checks = [f"IDC: U_O+DI > U_O+S in {len(di_over_s)} of {len(idc_rows)} (model, m) rows and U_O+S > U_O in "
              f"{len(s_over_o)} of {len(idc_rows)} (the paper: DI > S > O)."]
    monotone = []
    for model in dict.fromkeys(r["model"] for r in idc_rows):
        values = [_mean(r["U_O"]) for r in idc_rows if r["model"] == model]
        monotone.append(f"{model} {' > '.join(pct(v) for v in values)}%"
                        + ("" if all(a > b for a, b in zip(values, values[1:])) else " (not decreasing)"))
    checks.append("IDC on U_O as m grows: " + "; ".join(monotone) + ".")
    compared = [(r, paper.IDC_UO[(r["model"], r["criterion"])]) for r in idc_rows
                if (r["model"], r["criterion"]) in paper.IDC_UO]
    if compared:
        checks.append("Against the paper's U_O figures (ours / paper): " + "; ".join(
            f"{r['model']} {_criterion_name(r['criterion'])} {pct(_mean(r['U_O']))} / {value:.1f}"
            for r, value in compared) + ".")
    classic = [r for r in result.rows if not r["criterion"].startswith("idc_")]
    di_over_s_classic = [r["criterion"].upper() for r in classic if _mean(r["U_O+DI"]) > _mean(r["U_O+S"])]
    checks.append(f"Classic criteria with U_O+DI > U_O+S: {len(di_over_s_classic)} of {len(classic)} "
                  f"(model, criterion) rows.")
    return checks


STAGE_HEADERS = {
    "pooled": "pooled (the product) %",
    "per_class": "per class, mean (`--per-class`) %",
    "reference": "per class, reference LRP and clustering %",
    "paper_era": "paper-era: + comb_cov.py pairing %",
}


def idc_paper_era(result: ExperimentResult) -> tuple[str, list[str]]:
    from benchmarks.reproduce.idc_paper_era import EXTENDED, STAGES

    rows = []
    for r in result.rows:
        figure = paper.IDC_UO.get((r["model"], f"idc_{r['top_m']}"))
        rows.append([r["model"], r["layer"], r["top_m"]] + [pct_ms(r[stage]) for stage in STAGES]
                    + ["" if figure is None else f"{figure:.1f}"]
                    + [pct_ms(r[key]) if r.get(key) else "" for key in EXTENDED])
    text = table(["model", "layer", "m"] + [STAGE_HEADERS[s] for s in STAGES] + ["paper U_O %"]
                 + ["paper-era U_O+S %", "paper-era U_O+DI %"], rows)
    smallest = min((r["top_m"] for r in result.rows), default=None)
    first = [r for r in result.rows if r["top_m"] == smallest]
    if first:
        text += ("\n\nPaper-era IDC per class (mean over seeds), m = " + str(first[0]["top_m"]) + ": " + "; ".join(
            f"{r['model']} " + " ".join(pct(v, 0) for v in r["paper_era_per_class"]) for r in first)
            + " (classes 0-9, %).")
    return text, paper_era_checks(result)


def paper_era_checks(result: ExperimentResult) -> list[str]:
    from benchmarks.reproduce.idc_paper_era import STAGES

    compared = [(r, paper.IDC_UO[(r["model"], f"idc_{r['top_m']}")]) for r in result.rows
                if (r["model"], f"idc_{r['top_m']}") in paper.IDC_UO]
    checks = ["No cell has a paper figure to compare with (tiny mode or other models)."]
    if compared:
        gaps = {stage: [abs(100 * _mean(r[stage]) - value) for r, value in compared] for stage in STAGES}
        closest = min(STAGES, key=lambda s: _mean(gaps[s]))
        checks = [f"Mean absolute gap to the paper's {len(compared)} U_O figures, in points: " + "; ".join(
            f"{STAGE_HEADERS[s].rstrip(' %')} {_mean(gaps[s]):.1f} (max {max(gaps[s]):.1f})" for s in STAGES)
            + f". Closest: {STAGE_HEADERS[closest].rstrip(' %')}."]
        checks.append("Cell by cell (paper-era / paper): " + "; ".join(
            f"{r['model']} IDC_{r['top_m']} {pct(_mean(r['paper_era']))} / {value:.1f}" for r, value in compared) + ".")
    lowered = [r for r in result.rows if _mean(r["paper_era"]) < _mean(r["reference"])]
    checks.append(f"The pairing lowers per-class IDC in {len(lowered)} of {len(result.rows)} (model, m) rows.")
    extended = [r for r in result.rows if r.get("paper_era_U_O+DI")]
    if extended:
        di = [r for r in extended if _mean(r["paper_era_U_O+DI"]) > _mean(r["paper_era_U_O+S"])]
        s_o = [r for r in extended if _mean(r["paper_era_U_O+S"]) > _mean(r["paper_era"])]
        checks.append(f"Under the paper-era protocol, U_O+DI > U_O+S in {len(di)} of {len(extended)} rows and "
                      f"U_O+S > U_O in {len(s_o)} of {len(extended)} (the paper: DI > S > O).")
    return checks


def idc_sensitivity(result: ExperimentResult) -> tuple[str, list[str]]:
    sizes = result.meta["sizes"]
    m = result.meta["top_m"]
    rows = []
    for r in result.rows:
        figure = paper.IDC_UO.get((r["model"], f"idc_{m}"))
        rows.append([r["model"], r["variant"], r["layer"], ", ".join(str(n) for n in r["important_neurons"]),
                     ", ".join(str(k) for k in r["clusters"]), f"{r['combinations']:,}"]
                    + [pct(r["idc"][str(s)]) for s in sizes] + ["" if figure is None else f"{figure:.1f}"])
    header = ["model", "settings", "layer", "important neurons", "k per neuron", "combinations (INCC)"] + \
        [f"IDC_{m} %, first {s:,} of U_O" for s in sizes] + [f"paper IDC_{m} %"]
    checks = []
    models = list(dict.fromkeys(r["model"] for r in result.rows))
    for model in models:
        variants = [r for r in result.rows if r["model"] == model]
        if len(variants) < 2:
            continue
        same_neurons = variants[0]["important_neurons"] == variants[1]["important_neurons"]
        checks.append(f"{model}: the z-rule with reference clustering picks {'the same' if same_neurons else 'different'} "
                      f"important neurons, {variants[0]['combinations']:,} vs {variants[1]['combinations']:,} "
                      "combinations; "
                      f"IDC_{m} grows from {pct(variants[0]['idc'][str(sizes[0])])}% to "
                      f"{pct(variants[0]['idc'][str(sizes[-1])])}% as U_O grows from {sizes[0]:,} to {sizes[-1]:,} inputs.")
    return table(header, rows), checks


CLASSIC = ("nc", "kmnc", "nbc", "snac", "tknc", "lsc", "dsc")


def idc_classic(result: ExperimentResult) -> tuple[str, list[str]]:
    rows = []
    for r in result.rows:
        rows.append([r["model"], r["setting"], ", ".join(r["layers"]), ", ".join(r["sa_layers"])]
                    + [pct(r["coverage"][c]) for c in CLASSIC])
        figures = paper.CLASSIC_UO.get(r["model"])
        if figures and r["setting"] == "reference layers":
            rows.append([r["model"], "**paper (Table 4)**", "", ""] + [f"{figures[c]:.1f}" for c in CLASSIC])
    text = table(["model", "setting", "layers counted", "SA layer"] + [f"{c.upper()} %" for c in CLASSIC], rows)
    checks = []
    for r in result.rows:
        figures = paper.CLASSIC_UO.get(r["model"])
        if figures:
            gaps = [abs(100 * r["coverage"][c] - figures[c]) for c in CLASSIC]
            checks.append(f"{r['model']} {r['setting']}: largest gap to the paper {max(gaps):.1f} points "
                          f"({CLASSIC[gaps.index(max(gaps))].upper()}), mean {sum(gaps) / len(gaps):.1f}.")
    return text, checks or ["No paper row to compare with."]


def idc_rq3(result: ExperimentResult) -> tuple[str, list[str]]:
    ms = result.meta.get("top_m", [6, 8])
    matched = result.meta.get("matched_inputs")
    header = ["model", "set", "inputs", "attack success % (float / uint8)", "made in s"] + [f"IDC_{m} %" for m in ms] + \
        [c.upper() + " %" for c in CLASSIC] + [f"IDC_{m} %, U_O + first {matched}" for m in ms]
    era = [m for m in ms if all(f"paper_era_idc_{m}" in r for r in result.rows)]
    header += [f"paper-era IDC_{m} %" for m in era]
    rows = []
    for r in result.rows:
        success = "" if r["success"] is None else (
            f"{pct(r['success_float'])} / {pct(r['success'])}" if r["success_float"] is not None else f"- / {pct(r['success'])}")
        made = "" if r["set"] == "U_O" else f"{r['seconds']:.0f}"
        rows.append([r["model"], r["set"], f"{r['inputs']:,}", success, made] + [pct(r[f"idc_{m}"]) for m in ms]
                    + [pct(r.get(c)) for c in CLASSIC] + [pct(r.get(f"matched_idc_{m}")) for m in ms]
                    + [pct(r[f"paper_era_idc_{m}"]) for m in era])
    checks = [check for m in ms for check in rq3_checks(result, m)]
    return table(header, rows), checks + [check for m in era for check in rq3_checks(result, m, "paper_era_idc")]


def rq3_checks(result: ExperimentResult, m: int, prefix: str = "idc") -> list[str]:
    """Per model: each set's IDC_m gain over U_O and which adversarial sets beat the Gaussian one
    (``prefix`` "paper_era_idc": under the paper-era protocol, which has no size-matched column)."""
    checks = []
    key, matched_key = f"{prefix}_{m}", f"matched_idc_{m}"
    label = f"IDC_{m}" if prefix == "idc" else f"paper-era IDC_{m}"
    for model in dict.fromkeys(r["model"] for r in result.rows):
        rows = {r["set"]: r for r in result.rows if r["model"] == model}
        base = rows["U_O"][key]
        gauss = rows.get("U_O+gauss")
        adversarial = {s: r for s, r in rows.items() if s not in ("U_O", "U_O+gauss")}
        if gauss is None or not adversarial:
            continue
        above = [s.split("+")[1].upper() for s, r in adversarial.items() if r[key] > gauss[key]]
        text = (f"{model} {label} gain over U_O: " + ", ".join(
            f"{s.split('+')[1].upper()} {pct(r[key] - base)}" for s, r in rows.items() if s != "U_O")
            + f" points; adversarial sets above the Gaussian set: {len(above)} of {len(adversarial)} "
            f"({', '.join(above) or 'none'})")
        if prefix == "idc":
            above_matched = [s.split("+")[1].upper() for s, r in adversarial.items()
                             if r.get(matched_key, 0) > gauss.get(matched_key, 0)]
            text += f"; size-matched: {len(above_matched)} of {len(adversarial)} ({', '.join(above_matched) or 'none'})"
        checks.append(text + ".")
    return checks


def idc_rq5(result: ExperimentResult) -> tuple[str, list[str]]:
    era = all(r.get("paper_era_U_O") for r in result.rows)
    rows = [[r["model"], r["layer"], r["m"], f"{int(_mean(r['combinations'])):,}", pct_ms(r["U_O"]),
             pct_ms(r["U_O+DI"]), num_ms(r.get("correlation", []), 2), num_ms(r.get("ink_correlation", []), 2)]
            + ([pct_ms(r["paper_era_U_O"]), pct_ms(r["paper_era_U_O+DI"])] if era else [])
            for r in result.rows]
    checks = []
    for model in dict.fromkeys(r["model"] for r in result.rows):
        values = [(r["layer"], _mean(r["U_O"])) for r in result.rows if r["model"] == model]
        rising = all(b[1] >= a[1] for a, b in zip(values, values[1:]))
        checks.append(f"{model}: IDC on U_O by layer " + ", ".join(f"{layer} {pct(v)}" for layer, v in values)
                      + (" (rises with depth)" if rising else " (does not rise steadily with depth)") + ".")
    if era:
        for model in dict.fromkeys(r["model"] for r in result.rows):
            values = [(r["layer"], _mean(r["paper_era_U_O"])) for r in result.rows if r["model"] == model]
            checks.append(f"{model}, paper-era protocol: " + ", ".join(f"{layer} {pct(v)}" for layer, v in values) + ".")
    return table(["model", "layer", "m", "combinations", "U_O %", "U_O+DI %", "important neurons' mean abs. correlation",
                  "mean abs. correlation with ink"] + (["paper-era U_O %", "paper-era U_O+DI %"] if era else []),
                 rows), checks


RQ6_MEASURES = (("clean", "clean test"), ("corrupted", "corrupted test, mean of corruptions"),
                ("mutants", "mutated test"), ("triggers", "DFlare triggers"))


def _paired(result: ExperimentResult, arm: str, other: str, measure: str) -> list[float]:
    """Per training seed: ``arm``'s value minus ``other``'s (same seed)."""
    by = {(r["arm"], r["seed"]): r[measure] for r in result.rows}
    return [by[(arm, s)] - by[(other, s)] for s in dict.fromkeys(r["seed"] for r in result.rows)
            if (arm, s) in by and (other, s) in by]


def _points(values, digits: int = 2) -> str:
    """Percentage-point differences: mean (std) [min, max]."""
    values = _finite(values)
    if not values:
        return "-"
    mean, std = mean_std(values)
    spread = f" ({100 * std:.{digits}f}) [{100 * min(values):+.{digits}f}, {100 * max(values):+.{digits}f}]" \
        if len(values) > 1 else ""
    return f"{100 * mean:+.{digits}f}{spread}"


def idc_rq6(result: ExperimentResult) -> tuple[str, list[str]]:
    m = result.meta
    arms = [a for a in ("baseline", "random", "guided") if any(r["arm"] == a for r in result.rows)]
    names = {"baseline": "training split alone", "random": f"+ {m['K']:,} random mutants",
             "guided": f"+ {m['K']:,} IDC-guided inputs"}
    rows = []
    for arm in arms:
        records = [r for r in result.rows if r["arm"] == arm]
        rows.append([names[arm], f"{records[0]['train_inputs']:,}", ", ".join(str(r["seed"]) for r in records)]
                    + [pct_ms([r[key] for r in records], 2) for key, _ in RQ6_MEASURES]
                    + [num_ms([r["train_seconds"] for r in records], 0)])
    ref = m["reference_model"]
    rows.append([f"guiding model, not retrained: {m['guide'].rstrip(',')}", "", ""]
                + [pct(ref[key], 2) for key, _ in RQ6_MEASURES] + [""])
    text = table(["training set", "inputs", "training seeds"] + [f"{label} %" for _, label in RQ6_MEASURES]
                 + ["training s"], rows)
    pairs = [("guided", "baseline"), ("random", "baseline"), ("guided", "random")]
    diff_rows = [[f"{a} - {b}"] + [_points(_paired(result, a, b, key)) for key, _ in RQ6_MEASURES]
                 for a, b in pairs if a in arms and b in arms]
    text += ("\n\nDifferences between arms, paired by training seed, in percentage points: mean (std over seeds) "
             "[min, max]:\n\n" + table(["arms"] + [label for _, label in RQ6_MEASURES], diff_rows))
    corruptions = m.get("corruptions", [])
    corruption_rows = [[names[arm]] + [pct_ms([r["per_corruption"][c] for r in result.rows if r["arm"] == arm], 2)
                                       for c in corruptions] for arm in arms]
    text += (f"\n\nAccuracy % per corruption (severity {m['severity']}), mean (std) over training seeds:\n\n"
             + table(["training set"] + corruptions, corruption_rows))
    g, t = m["generation"], m["triggers"]
    c = g["coverage"]
    text += (f"\n\nAugmentation: K = {m['K']:,} inputs per augmented arm ({100 * m['K'] / m['train_inputs']:.1f}% of the "
             f"{m['train_inputs']:,} training inputs), from {len(g['kept_per_run'])} generation runs keeping "
             f"{min(g['kept_per_run'])}-{max(g['kept_per_run'])} inputs each (chain length 1/2/3 operators: "
             f"{'/'.join(str(d) for d in g['depths'])}; random mutants that kept needing a redraw: {g['random_fallbacks']}). "
             f"IDC of the guiding model ({c['layer']}, {c['total']} combinations) covered by: the training split "
             f"{c['training_split']}, "
             f"the seeds {c['seeds']}, the guided set alone {c['guided']}, the random set alone {c['random']}; training split + "
             f"guided {c['training_plus_guided']}, + random {c['training_plus_random']} (combinations outside the training "
             f"split's: guided {c['guided_outside_training']}, random {c['random_outside_training']}). "
             f"Time: IDC fit {g['fit_seconds']:.0f} s, guided generation {g['generation_seconds']:.0f} s, random set "
             f"{g['random_seconds']:.0f} s. DFlare triggers: {t['triggers']} from {t['seeds']} seeds "
             f"({t['already_deviating']} already deviating; success {pct(t['success_rate'])}%, mean "
             f"{t['mean_queries']:.0f} queries, {t['seconds']:.0f} s); `{t['pair']}`: {t['description']}. The "
             f"retrained models classify the triggers' seeds (the clean test images they come from) correctly "
             f"{pct(min(r['trigger_seeds'] for r in result.rows), 1)}-{pct(max(r['trigger_seeds'] for r in result.rows), 1)}% "
             "of the time.")
    return text, rq6_checks(result)


def rq6_checks(result: ExperimentResult) -> list[str]:
    checks = ["'Beyond seed noise' below means: the paired difference has the same sign on every training seed "
              "and its mean exceeds twice its standard error."]
    for key, label in RQ6_MEASURES:
        diffs = _finite(_paired(result, "guided", "random", key))
        if not diffs:
            continue
        mean, std = mean_std(diffs)
        noise = [abs(v) for arm in ("baseline", "random", "guided")
                 for v in [mean_std([r[key] for r in result.rows if r["arm"] == arm])[1]] if not math.isnan(v)]
        same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
        beyond = len(diffs) > 1 and abs(mean) > 2 * std / math.sqrt(len(diffs)) and same_sign
        sign = ("no difference on any seed" if not any(diffs) else
                "same sign on every seed" if same_sign else "sign changes between seeds")
        checks.append(f"{label}: guided - random {100 * mean:+.2f} points over {len(diffs)} seed(s) ({sign}; "
                      f"largest per-arm seed std {100 * max(noise, default=0):.2f} points) "
                      f"-> {'beyond' if beyond else 'within'} seed noise.")
    return checks


def dflare_table4(result: ExperimentResult) -> tuple[str, list[str]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in result.rows:
        groups.setdefault((r["pair"], r["strategy"]), []).append(r)
    rows = []
    for (pair, strategy), records in groups.items():
        figure = paper.DFLARE_TABLE4.get((pair, strategy)) or f"avg.: {paper.DFLARE_AVERAGES.get(strategy, '')}"
        rows.append([pair, strategy, len(records), f"{records[0]['fuzzed']} ({records[0]['already_deviating']})",
                     pct_ms([r["success_rate"] for r in records]),
                     num_ms([r["mean_queries"] for r in records], 1), num_ms([r["mean_seconds"] for r in records], 3),
                     num_ms([r["median_queries"] for r in records], 0), num_ms([r["wall_seconds"] for r in records], 0),
                     figure])
    text = table(["pair", "strategy", "runs", "seeds fuzzed (already deviating)", "success % mean (std)",
                  "queries / trigger mean (std)", "s / trigger mean (std)", "median queries", "campaign wall s",
                  "paper"], rows)
    pairs = result.meta.get("pairs", {})
    if pairs:
        text += "\n\n" + "\n".join(f"- `{name}`: {description}" for name, description in pairs.items())
    return text, table4_checks(groups)


def table4_checks(groups: dict) -> list[str]:
    checks = []
    for pair in dict.fromkeys(p for p, _ in groups):
        def queries(strategy):
            records = groups.get((pair, strategy))
            return _mean([r["mean_queries"] for r in records]) if records else math.nan

        def success(strategy):
            records = groups.get((pair, strategy))
            return _mean([r["success_rate"] for r in records]) if records else math.nan

        base = queries("dflare-paper")
        parts = [f"DFlare (paper) success {pct(success('dflare-paper'))}%"]
        for strategy in ("dflare-paper-d", "dflare-paper-r", "dflare-d-bug", "diffchaser", "dflare"):
            if (pair, strategy) not in groups:
                continue
            ratio = queries(strategy) / base if base > 0 else math.nan
            ratio_text = "no trigger found" if math.isnan(ratio) else f"{ratio:.2f}x the paper DFlare's queries"
            parts.append(f"{strategy} {ratio_text} (success {pct(success(strategy))}%)")
        checks.append(f"`{pair}`: " + ", ".join(parts) + ".")
    checks.append("Paper: DiffChaser needs ~140x DFlare's queries on average (DFlare uses ~0.7% of them), "
                  "DFlare_D ~55x with lower success, DFlare_R ~1.05x. The paper's DFlare_D comes from the reference code's "
                  "never-accepting bug (`dflare-d-bug`); a working no-novelty ablation is `dflare-paper-d`.")
    return checks


def dflare_rq4(result: ExperimentResult, markdown_path: pathlib.Path, out: pathlib.Path) -> tuple[str, list[str]]:
    percents = sorted({r["percent"] for r in result.rows})
    rows = []
    for p in percents:
        records = [r for r in result.rows if r["percent"] == p]
        rows.append([f"{p}%", len(records), pct_ms([r["seed_agreement"] for r in records]),
                     pct_ms([r["success_rate"] for r in records]), num_ms([r["mean_queries"] for r in records], 1),
                     num_ms([r["mean_seconds"] for r in records], 4)])
    text = table(["weights mutated", "runs", "seeds agreeing before fuzzing %", "success %",
                  "queries / trigger mean (std)", "s / trigger mean (std)"], rows)
    r = result.meta.get("pearson", {})
    text += ("\n\nPearson's r against x: queries " + _r(r.get("queries_of_means")) + ", seconds "
             + _r(r.get("seconds_of_means")) + " (over the per-x means); over all campaigns: queries "
             + _r(r.get("queries_all_campaigns")) + ", seconds " + _r(r.get("seconds_all_campaigns")) + ".")
    plot = out / pathlib.Path(result.meta.get("plot", "")).name
    if plot.is_file():
        text += f"\n\n![DFlare RQ4]({pathlib.Path(os.path.relpath(plot, markdown_path.parent)).as_posix()})"
    q = r.get("queries_of_means")
    checks = [f"Queries per deviation {'fall' if q is not None and q < 0 else 'do not fall'} as x grows "
              f"(r = {_r(q)}); the paper reports r about -0.97."]
    return text, checks


def _r(value) -> str:
    return "undefined" if value is None else f"{value:+.2f}"


# ------------------------------------------------------------------------------ document
def render(results: dict[str, ExperimentResult | None], markdown_path: pathlib.Path, command: str,
           out: pathlib.Path) -> str:
    """The whole REPRODUCTION.md text for the results saved in ``out``."""
    modes = sorted({r.config["mode"] for r in results.values() if r is not None})
    parts = [
        "# Reproducing the IDC and DFlare papers with mlflow-di",
        "",
        f"Rendered by `{command}` (from the repository root, `.venv/bin/python`); each section names the command "
        "that produced it; re-render from the saved results with `--render-only`. Every table comes from a real run "
        "recorded in the results folder; "
        f"modes present: {', '.join(modes) or 'none'}. Machine: {os.cpu_count()} cores ({platform.machine()}), "
        "shared with other jobs, so seconds are noisy; torch/ONNX Runtime/TFLite threads as in each configuration. "
        "The minutes in a section's configuration line are those of the command that wrote it: attack sets and "
        "DFlare campaigns that an earlier command with the same settings had finished were reused (their own "
        "times are in the tables).",
        "",
        _data_paragraph(results),
        "",
        f"**Paper figures.** IDC: {paper.IDC_SOURCE}. DFlare: {paper.DFLARE_SOURCE}. Only figures found in the "
        "papers' text are shown as numbers; where a table's figures could not be found, the paper's stated trend "
        "is given and the section says so.",
    ]
    for name in EXPERIMENTS:
        result = results.get(name)
        parts += ["", f"## {TITLES[name]}", ""]
        if result is None:
            parts.append("Not run yet in this results folder.")
            continue
        parts += [settings_line(result), "", _method(result), ""]
        text, checks = (dflare_rq4(result, markdown_path, out) if name == "dflare_rq4"
                        else idc_rq2(result, results.get("idc_paper_era")) if name == "idc_rq2"
                        else globals()[name](result))
        parts += [text, "", "**Trend check (computed from the table):** " + " ".join(checks)]
        if name in paper.IDC_TRENDS and name != "idc_sensitivity":
            parts += ["", f"**Paper:** {paper.IDC_TRENDS[name]}."]
        elif name == "dflare_rq4":
            parts += ["", f"**Paper:** {paper.DFLARE_RQ4}."]
        note = commentary.NOTES.get(name) if result.config["mode"] == "full" else None
        if note:
            parts += ["", "**Where we agree or differ, and why:** " + note]
    return "\n".join(parts) + "\n"


def _data_paragraph(results: dict) -> str:
    configs = [r.config for r in results.values() if r is not None]
    if any(c["mode"] == "tiny" for c in configs):
        return ("**Data.** Tiny mode: scikit-learn's 8x8 digits and a small CNN trained on them for a few epochs; "
                "the numbers only show that the harness runs, they say nothing about the papers.")
    # the sizes of the IDC tables' sets (RQ6 and the DFlare experiments do not use them)
    idc = [r.config for name, r in results.items() if r is not None and name.startswith("idc_") and name != "idc_rq6"]
    analysis = sorted({c["analysis_size"] for c in idc}) or [60_000]
    tests = sorted({c["test_size"] for c in idc}) or [10_000]
    seeds = sorted({r.config["fuzz_seeds"] for n, r in results.items() if r is not None and n.startswith("dflare")}) or [500]
    return ("**Data.** The analysis (\"training\") set for importance analysis, clustering and the criteria's bounds "
            f"is the **first {' / '.join(f'{n:,}' for n in analysis)} images of the 60,000-image MNIST training split**, "
            f"and the test set **U_O is the last {' / '.join(f'{n:,}' for n in tests)} images of the 10,000-image test "
            "split**" + (" (all of it, as in the paper)" if tests == [10_000] else "") + ". DFlare's seeds are "
            f"the first {' / '.join(str(n) for n in seeds)} test images (the paper: 500 test images). Reference models: "
            "the DeepImportance LeNet-1/4/5 (Keras HDF5 ported to PyTorch) and the DFlare LeNet-1/5 with their TFLite "
            "versions, from ../shared.")


def _method(result: ExperimentResult) -> str:
    """One paragraph on how the experiment was run (from its own settings)."""
    c, m = result.config, result.meta
    if result.name == "idc_rq1":
        return (f"Inputs: {m['inputs']}; per input, {m['pixels']} flipped ({m['perturbation']}, as DeepImportance's "
                f"Table 2 script). IDC fitted with m = {c['rq1_top_m']} on the analysis set; random neurons: "
                f"{m['random_draws']} draws of m others of the same layer. Values: L2 norm of the change of the m "
                "neurons' activations (conv neuron = channel mean), mean (std) over inputs (and draws).")
    if result.name == "idc_rq2":
        return (f"{m['runs']} runs (noise redrawn, IDC's k-means reseeded); U_O+S and U_O+DI add {m['copies']} noisy "
                f"copies of each of the {m['test_inputs']:,} U_O inputs: Gaussian noise (std {m['noise_std']:.0f} "
                f"of 255) on the top {m['pixel_fraction']:.0%} pixels by |input LRP| (DI) or as many random other "
                "pixels (S). IDC on the default subject layer (LeNet-1 conv2, LeNet-4 fc1, LeNet-5 fc2); classic "
                "criteria over conv1, conv2, fc1, fc2 with DeepImportance's settings. Values: mean (std) over runs.")
    if result.name == "idc_classic":
        return (f"Bounds, SA traces and buckets from `{m['analysis']}`, scored on U_O (`{m['test']}`). NC threshold 0.75 on "
                "per-input min-max scaled outputs, KMNC 1,000 sections, TKNC k = 3, LSC/DSC 1,000 buckets up to 2,000 / 2; "
                "`sadl` buckets start at the test set's minimum SA (Kim et al.'s rule); the reference layer set adds the "
                "pooling layers and the softmax output (and LeNet-5's separate logits layer) and takes the SA layer the "
                "reference's script takes.")
    if result.name == "idc_paper_era":
        return (f"IDC_m of U_O (`{m['test']}`, {m['test_inputs']:,} inputs) on the default subject layer, each column "
                "adding one ingredient of the paper-era Table 3 scripts (`TABLE3_VALIDATION_MNIST.py -C c` with "
                "`coverages/comb_cov.py` of the DeepImportance repository's first commit) to the one before: pooled "
                "over all classes (the product); per class, analysis and test inputs filtered by label, mean over the "
                "classes (the product's `coverage --per-class`); per class with the reference relevance (the "
                "reference LRP: no ReLU after conv layers, plain z-rule, signed sum over the class's correctly "
                "classified analysis inputs) and the reference clustering (zeros dropped, fewer than 10 values -> "
                "centroid 0, centroids rounded to 2 decimals); and finally comb_cov.py's pairing of neurons with "
                "centroids (centroids stored in ascending neuron order, test activations read in relevance order). "
                f"Values: mean (std) over {m['runs']} k-means seeds (the reference's k-means was unseeded).")
    if result.name == "idc_sensitivity":
        return (f"IDC with m = {m['top_m']} on the default subject layer, fitted on the analysis set (k-means seed 0) with the "
                "package's defaults and with the z-rule (conv ReLUs kept) and the reference code's clustering quirks; "
                "scored on growing prefixes of U_O.")
    if result.name == "idc_rq3":
        sizes = ", ".join(f"{a.upper()} {n:,}" for a, n in m["attack_inputs"].items())
        cw = (f"C&W: max_iter {c['rq3_cw_max_iter']}, initial_const {c['rq3_cw_initial_const']:g} (reference 1000 and "
              "1e-2, see the notes below)")
        return (f"Each set is made from the first U_O inputs ({sizes}); attacks by ART with DeepImportance's "
                f"hyperparameters (FGSM eps 0.3; BIM eps 0.3, step 0.05, 10 iterations; JSMA theta 1, gamma 1; {cw}); "
                f"Gaussian: std {c['rq3_gauss_std']:.1f} of 255 on every pixel (DeepImportance's `add_wn_all`). "
                "Adversarial floats were converted back to raw uint8 images by rounding x*255 (the attack success "
                "before and after is shown). IDC fitted once (k-means seed 0).")
    if result.name == "idc_rq5":
        return (f"One IDC model per hidden layer (m = {m['top_m']}, fewer where a layer is narrower), "
                f"{m['runs']} run(s); U_O+DI as in RQ2. Values: mean (std) over runs.")
    if result.name == "idc_rq6":
        return (f"IDC_{c['rq6_top_m']} (layer {m['generation']['coverage']['layer']}) of {m['guide'].rstrip(',')}, "
                "fitted on the first "
                f"{c['rq6_idc_fit']:,} images of `{m['train_data']}`, guides `generate` (mutants kept only when the model "
                f"keeps the seed's label and a new combination is covered) from {c['rq6_seed_sets']} disjoint sets of "
                f"{c['rq6_seed_set_size']} training images (the first {c['rq6_seed_sets'] * c['rq6_seed_set_size']:,}), "
                f"{c['rq6_budget']} mutants each; the random set holds, for each guided input, one label-preserving "
                "mutant of the same seed with as many operators drawn from the same catalogue, without coverage "
                f"feedback. `{m['arch']}` retrained from scratch ({c['rq6_epochs']} epochs, Adadelta lr 1.0, rho 0.95, "
                f"batch 256, Keras init) on each training set with training seeds {_show(c['rq6_train_seeds'])}. "
                f"Test inputs: the first {m['test_inputs']:,} of `{m['test_data']}` clean, under each of "
                f"{len(m['corruptions'])} corruptions at severity {m['severity']} and as mild mutants (one chain of 1-3 "
                "generation operators, no oracle); DFlare triggers labelled with their seeds' true labels. "
                "Values: accuracy, mean (std) over training seeds."
                + ("" if c["mode"] == "tiny" else " Like the IDC tables above, this experiment uses the 60,000-image "
                   "MNIST training split (IDC analysis, seeds, retraining) and the 10,000-image test split."))
    if result.name == "dflare_table4":
        limit = f", at most {m['max_queries']} queries" if m.get("max_queries") else ""
        capped = {s: q for s, q in (m.get("max_queries_by_strategy") or {}).items() if q != m.get("max_queries")}
        limit += "".join(f"; {s} at most {q} queries" for s, q in capped.items())
        plans = m.get("plan") or {}
        budget = "; ".join(f"{s}: {seeds} seeds x {runs} run(s)" for s, (seeds, runs) in plans.items()) or \
            f"{m['seeds']} seeds x {m['runs']} run(s)"
        return (f"Budget per pair: {budget} (the first test images as seeds; run r uses campaign seed r); per-seed "
                f"timeout {m['timeout']:g} s{limit}, 64 seeds in lockstep. "
                "Mean over runs of each campaign's success rate and mean queries/seconds per triggering input "
                "(std over runs in brackets). Seconds are each seed's share of the campaign's CPU time on this "
                "loaded 2-core machine, not the paper's GPU wall time.")
    return (f"DFlare (timeout {m['timeout']:g} s) against the original on {m['seeds']} seeds, {m['runs']} run(s) "
            f"(each run: new mutants and campaign seed); mutants scale x% of {m['source']}'s weight elements by "
            f"1 +/- {m['scale']:g}.")
