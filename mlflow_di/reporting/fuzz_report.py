"""A fuzz campaign as its run, its report and its console show it: the summary, the metrics, the
per-seed rows, the HTML report of one campaign and the parent report of several exports fuzzed in
one call. Pure: results in, dictionaries, rows and HTML out (``mlflow-di fuzz`` logs and prints them).
"""
from __future__ import annotations

#: the summary's figures logged as metrics and shown in the report's summary table
SUMMARY_METRICS = ("success_rate", "mean_queries", "median_queries", "mean_seconds", "triggers", "seeds",
                   "already_deviating", "fuzzed", "timed_out_seeds", "interval_confidence")
#: summary keys logged as metrics beside them: the 95% intervals the gate judges (success_rate_low, ...)
INTERVAL_PREFIXES = ("success_rate_", "mean_queries_")
#: summary keys logged as metrics besides SUMMARY_METRICS: the triggers' distances and the realism budget's counts
REALISM_PREFIXES = ("trigger_", "realistic_", "realism_", "mean_original_passes")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def incomplete_note(summary: dict) -> str:
    """What a campaign cut short by its time limit means, in one sentence."""
    return (f"{plural(summary['timed_out_seeds'], 'seed')} of {summary['fuzzed']} stopped at --timeout (CPU "
            "seconds) before their query budget; no trigger on them is not evidence that none exists (raise "
            "--timeout, or let --max-queries bind)")


def realism_note(summary: dict) -> str:
    """One sentence: how many triggers are within the realism budget (the report's flag, the printed summary)."""
    from mlflow_di.fuzz.realism import Constraint

    budget = Constraint(max_linf=summary["realism_max_linf"], min_ssim=summary["realism_min_ssim"])
    return (f"{summary['realistic_triggers']} of {plural(summary['triggers'], 'trigger')} within the realism budget "
            f"({budget.describe()}): realistic success rate {summary['realistic_success_rate']:.1%}")


def summarize(result, confidence: float = 0.95) -> dict:
    """What a campaign's run, report and console say about it: the summary's figures with their intervals at
    ``confidence``, the seeds stopped at --timeout, the triggers' distances and realism, the original's passes,
    DeepXplore's coverage."""
    from mlflow_di.fuzz.realism import Constraint, campaign_budget, distance_summary, realism_summary
    from mlflow_di.fuzz.results import sample_intervals

    s = result.summary
    own = (result.config.strategy_options or {}).get("constraint")  # DeepXplore's is a name, not a budget
    budget = campaign_budget(Constraint(**own) if isinstance(own, dict) else None)
    realism = realism_summary(result.records, s.fuzzed, budget)
    return {"success_rate": s.success_rate, "mean_queries": s.mean_queries, "median_queries": s.median_queries,
            "mean_seconds": s.mean_seconds, "triggers": s.triggers, "seeds": s.seeds,
            "already_deviating": s.already_deviating, "fuzzed": s.fuzzed, "strategy": s.strategy,
            # seeds stopped by --timeout (CPU seconds) before their query budget: their "no trigger" is no evidence
            "timed_out_seeds": sum(str(r.stop) == "timeout" for r in result.records),
            "complete": result.complete, **distance_summary(result.records), **original_passes(result.records),
            **realism, **sample_intervals(result.records, realism["realistic_triggers"], confidence),
            "interval_confidence": confidence,
            **({"neuron_coverage": result.neuron_coverage} if result.neuron_coverage is not None else {}),
            "operators": {name: {"selected": o.selected, "accepted": o.accepted, "triggered": o.triggered}
                          for name, o in s.operators.items()}}


def original_passes(records) -> dict:
    """``mean_original_passes``: the original's forward plus backward passes per fuzzed seed, for the
    strategies that use its gradients (boundary); their ``queries`` count the compressed model only."""
    counted = [r.original_passes for r in records if r.original_passes is not None and not r.already_deviating]
    return {"mean_original_passes": float(sum(counted) / len(counted))} if counted else {}


def run_metrics(summary: dict, class_rows: list[dict]) -> dict:
    """What a campaign's run records as metrics: the summary, trigger realism, and success by class."""
    metrics = {k: v for k, v in summary.items()
               if (k in SUMMARY_METRICS or k.startswith(REALISM_PREFIXES) or k.startswith(INTERVAL_PREFIXES))
               and v is not None}
    if "host_only_triggers" in summary:
        metrics["host_only_triggers"] = summary["host_only_triggers"]
    for row in class_rows:
        metrics[f"class_success_rate.{row['class']}"] = row["success_rate"]
    for role, value in (summary.get("neuron_coverage") or {}).items():  # deepxplore: NC reached per model
        metrics[f"neuron_coverage.{role}"] = value
    return metrics


def seed_rows(result) -> list[dict]:
    from mlflow_di import reporting as rp

    rows = []
    for r in result.records:
        labels = r.trigger_labels or r.seed_labels
        probabilities = r.trigger_probabilities or r.seed_probabilities
        distances = r.trigger_distances or {}
        rows.append({"seed": r.index, "label": r.label, "success": r.success, "stop": getattr(r.stop, "value", r.stop),
                     "queries": r.queries, "seconds": round(r.seconds, 4), "original_label": labels[0],
                     "compressed_label": labels[1], "original_top1": round(float(probabilities[0]), 4),
                     "compressed_top1": round(float(probabilities[1]), 4),
                     **{key: distances.get(key) for key in ("l0", "l2", "linf", "ssim", "ssim_whole")},
                     "operators": rp.operator_summary(r.operators),
                     **({"model_labels": ",".join(map(str, r.model_labels)), "target_model": r.target_model}
                        if r.model_labels is not None else {})})
    return rows


def realism_section(html, result, summary: dict) -> None:
    """The triggers' distances to their seeds as distributions, right under the summary, with a
    warning when most triggers are outside the realism budget (noise, not a finding to act on)."""
    from mlflow_di.fuzz.realism import distribution_rows, mostly_noise

    html.section("How realistic the triggers are")
    if mostly_noise(summary["realistic_triggers"], summary["triggers"]):
        html.verdict(False, f"{realism_note(summary)}. Most triggers are noise-like: a reviewer would not call them "
                            "the same image. Rerun with --min-ssim / --max-linf to search inside a budget.",
                     word="NOISE")
    else:
        html.paragraph(realism_note(summary) + ".")
    html.table(distribution_rows(result.records), caption=(
        "over the triggers: ssim = structural similarity to the seed (1 = identical; needs 11x11 images), "
        "ssim_whole = the same with windows on every pixel (sees the image's border), linf = "
        "largest change in 8-bit levels, l2 = Euclidean distance of pixel/255, l0 = pixels changed"))


def parent_realism_section(html, compressed: list[str], summaries: list[dict]) -> None:
    """The realism of every campaign's triggers, first thing a reviewer sees in the parent report, with
    the same NOISE box as a campaign's own report when most of all the triggers are noise-like."""
    from mlflow_di.fuzz.realism import mostly_noise

    triggers = sum(summary["triggers"] for summary in summaries)
    realistic = sum(summary.get("realistic_triggers", 0) for summary in summaries)
    html.section("How realistic the triggers are")
    if triggers and mostly_noise(realistic, triggers):
        html.verdict(False, f"{realistic} of {plural(triggers, 'trigger')} over all {len(summaries)} campaigns are "
                            "within the realism budget. Most triggers are noise-like: a reviewer would not call them "
                            "the same image. Rerun with --min-ssim / --max-linf to search inside a budget.",
                     word="NOISE")
    for number, (uri, summary) in enumerate(zip(compressed, summaries), start=1):
        html.paragraph(f"#{number} {uri}: " + (realism_note(summary) if summary["triggers"] else "no trigger") + ".")


def trigger_grid_pages(result) -> list:
    from mlflow_di import reporting as rp

    by_index = {r.index: r for r in result.records}
    records = [by_index[int(i)] for i in result.trigger_indices]
    return rp.trigger_grid_pages(result.trigger_seeds, result.triggers,
                                 original_labels=[r.trigger_labels[0] for r in records],
                                 compressed_labels=[r.trigger_labels[1] for r in records],
                                 true_labels=[r.label for r in records],
                                 notes=[f"{r.queries} queries" for r in records],
                                 operators=[rp.operator_summary(r.operators) for r in records])


def campaign_report(result, original: str, compressed: str, summary: dict, rows: list[dict], by_class: list[dict],
                    pages: list) -> str:
    """One campaign's HTML report: the verdict line (INCOMPLETE when seeds stopped at --timeout), the
    summary, the triggers' realism (a NOISE box when most are noise-like), the neuron coverage a
    white-box campaign reached, the trigger grid ``pages``, the label-pair heatmap, success by class,
    operators and per-seed rows."""
    from mlflow_di import reporting as rp
    from mlflow_di.fuzz.per_class import trigger_matrix

    html = rp.HtmlReport(f"Differential fuzzing: {original} vs {compressed}",
                         subtitle=f"{summary['strategy']} on {result.config.data}, seed {result.config.seed}")
    html.verdict(None, f"{plural(summary['triggers'], 'triggering input')} from {plural(summary['fuzzed'], 'seed')} "
                       f"(success rate {summary['success_rate']:.1%}); "
                       f"{plural(summary['already_deviating'], 'seed')} already deviated"
                       + (f". INCOMPLETE: {incomplete_note(summary)}" if summary["timed_out_seeds"] else ""))
    html.section("Summary").metrics({k: summary[k] for k in SUMMARY_METRICS}, percent_keys=["success_rate"])
    if summary.get("host_only_triggers"):
        html.paragraph(f"{plural(summary['host_only_triggers'], 'trigger')} of {summary['triggers']} flip only under "
                       "this host's ONNX Runtime kernels: the same export run with reference semantics (the QDQ graph "
                       "as written) gives the original's label on them (seed indices: "
                       f"{', '.join(map(str, summary['host_only_trigger_indices'][:50]))}). See the run's "
                       "mlflow_di.runtime.* tags for the CPU.")
    if summary["triggers"]:
        realism_section(html, result, summary)
    if summary.get("neuron_coverage"):
        coverage = {f"neuron_coverage.{role}": value for role, value in summary["neuron_coverage"].items()}
        html.section("Neuron coverage reached").metrics(coverage, percent_keys=list(coverage), caption=(
            f"NC (threshold {result.config.strategy_options.get('threshold')}) of each model over the seeds and the "
            "triggers; one query is one generated input through every model (a forward and backward pass each)"))
    if pages:
        html.section("Triggers").gallery(pages, "every trigger: seed | trigger | amplified difference, with both "
                                                "models' labels, the operators applied and the perturbation size")
        matrix = trigger_matrix(result.records)
        html.section("Triggers by label pair").image(rp.heatmap(
            matrix, [f"original {i}" for i in range(len(matrix))], [f"compressed {j}" for j in range(len(matrix))],
            "labels of the triggering inputs", symmetric=False, colorbar_label="triggers"),
            "row: the original's label on the trigger; column: the compressed model's")
    html.section("By class").table(by_class, caption="seeds by their true label: how often and how quickly a "
                                                     "deviation was found")
    operators = [{"operator": name, **counts} for name, counts in summary["operators"].items()]
    if operators:
        html.section("Operators").table(operators)
    html.section("Per-seed results").table(rows)
    return html.render()


def comparison_report(original: str, compressed: list[str], results: list, summaries: list, comparison: dict,
                      fooling_page=None) -> str:
    """The parent report of one call fuzzing several exports: sharing, the realism of every campaign
    (with the NOISE box), the side-by-side table (exports numbered #k) and the triggers that fool
    every export (``fooling_page``, when any)."""
    from mlflow_di import reporting as rp

    metrics = comparison["metrics"]
    html = rp.HtmlReport(f"Differential fuzzing: {original} vs {len(compressed)} compressed models",
                         subtitle=f"{summaries[0]['strategy']} on {results[0].config.data}, seed {results[0].config.seed}")
    shared = (f"; the original evaluated {metrics['original_inputs_shared']} images instead of "
              f"{metrics['original_inputs_separate']} ({metrics['original_inputs_saved_fraction']:.1%} saved by sharing "
              "its calls)" if metrics["original_inputs_separate"] else "")
    html.verdict(None, f"{metrics['triggers_fooling_all']} of {metrics['triggers_total']} triggers fool every "
                       f"compressed model{shared}")
    parent_realism_section(html, compressed, summaries)
    html.section("Side by side").table(side_by_side(comparison["rows"]), caption=(
        "one campaign per compressed model (each in its own child run, numbered # here), a column each; 'fools #k': "
        "the share of the campaign's triggers on which export #k also disagrees with the original"))
    if metrics["original_inputs_separate"]:  # a white-box walk shares no batched calls of the original
        html.section("Sharing the original's calls").metrics(metrics, percent_keys=["original_inputs_saved_fraction"])
    if fooling_page is not None:
        legend = "; ".join(f"#{number} = {uri}" for number, uri in enumerate(compressed, start=1))
        html.section("Triggers that fool every compressed model").image(
            fooling_page, f"seed | trigger (at most 24 rows); {legend}")
    return html.render()


def side_by_side(rows: list[dict]) -> list[dict]:
    """The exports' rows turned a column each (``#1 models:/...``), one row per figure: a few exports then fit the
    narrow preview pane of the MLflow UI (515 px at 1280 with its assistant open), where twelve figure columns
    scrolled sideways."""
    from mlflow_di.reporting.html import format_value

    percent = {"success_rate", "realistic_success_rate"}
    figures = [key for key in rows[0] if key not in ("#", "compressed")] if rows else []
    return [{"figure": key, **{f"#{row['#']} {row['compressed']}": format_value(row[key], key in percent or
                                                                               key.startswith("fools"))
                               for row in rows}} for key in figures]


def fooling_all_page(results: list, comparison: dict):
    """The picture of the triggers that fool every export (seed | trigger, labelled with the export
    #k it was found against), None when there is none."""
    import numpy as np

    from mlflow_di import reporting as rp

    if not comparison["fools_all"].any():
        return None
    seeds = np.concatenate([result.trigger_seeds for result in results])[comparison["fools_all"]]
    triggers = np.concatenate([result.triggers for result in results])[comparison["fools_all"]]
    sources = [number for number, result in enumerate(results, start=1) for _ in range(len(result.triggers))]
    sources = [number for number, fools in zip(sources, comparison["fools_all"]) if fools]
    return rp.labelled_image_rows([np.stack(pair) for pair in zip(seeds, triggers)],
                                  [f"found against #{number}" for number in sources])
