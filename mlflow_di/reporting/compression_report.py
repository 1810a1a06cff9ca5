"""A compressed export as its report shows it: where its figures were measured and what it buys on this
host, its metrics, the bounded search, the layers kept in float and why, per-class deviation, blame and
sensitivity, the layer-wise diagnosis. Pure: results in, one self-contained HTML page out (``mlflow-di
compress`` logs it as ``compress/report.html``).

``outcome`` is what one method produced (:class:`~mlflow_di.compression.outcome.Outcome`): the export's result, and
where they were made its bounded search, the fully quantized export it was compared with (``before``),
blame, sensitivity, diagnoses, notes and execution context.
"""
from __future__ import annotations

import json

SQNR_PLOT_LAYERS = 12  # the worst layers drawn in the SQNR bar plot


def compression_report(model_uri: str, name: str, result, metrics: dict, deviation, outcome) -> str:
    """Accuracy, agreement, size, what was quantized or pruned, per-class deviation and the layer-wise
    quantization diagnosis, as one self-contained page."""
    from mlflow_di.reporting import HtmlReport

    html = HtmlReport(f"{result.method} export of {model_uri}", subtitle=f"registered as {name}")
    percent = ("source_accuracy", "compressed_accuracy", "accuracy_drop", "sparsity", "max_class_accuracy_drop",
               "before_keep_float.compressed_accuracy", "before_keep_float.accuracy_drop",
               "before_keep_float.max_class_accuracy_drop")
    _runtime_section(html, metrics, outcome)  # first: every figure below was computed there
    html.section("Metrics").metrics({k: v for k, v in metrics.items() if not k.startswith("class_accuracy_drop.")},
                                    percent_keys=[k for k in percent if k in metrics])
    if outcome.search is not None:
        _search_section(html, outcome.search, result.params)
    if outcome.before is not None:
        _before_after_section(html, metrics, outcome)
    html.section("Parameters").code(json.dumps(result.params, indent=2, sort_keys=True))
    if result.quantized_ops:
        html.section("Quantized layers").table([{"layer": layer, "how": how} for layer, how in
                                                result.quantized_ops["quantized_layers"].items()])
    if deviation is not None:
        _deviation_section(html, deviation)
    if outcome.blame is not None:
        _blame_section(html, outcome.blame)
    if outcome.sensitivity is not None:
        _sensitivity_section(html, outcome.sensitivity)
    for diagnosis in outcome.diagnoses:
        _diagnosis_section(html, diagnosis)
    for note in outcome.notes:
        html.section("Layer-wise diagnosis on the triggers").paragraph(note)
    return html.render()


def _runtime_section(html, metrics: dict, outcome) -> None:
    """Where the figures were measured, host vs reference semantics, and what the export buys on this host."""
    if outcome.context is None:
        return
    html.section("Execution context and benefit on this host")
    html.paragraph(f"Measured with {outcome.context.describe()}.")
    if "reference.disagreements" in metrics:
        html.paragraph(
            "Host semantics: ONNX Runtime's default session, whose fused int8 kernels depend on the CPU. Reference "
            "semantics: the same file with graph optimizations off, the QDQ graph computed as written (the same on "
            f"every CPU). Disagreements with the source: {metrics['disagreements']} (host) vs "
            f"{metrics['reference.disagreements']} (reference); {metrics['host_only_disagreements']} images differ "
            f"only on this host, {metrics['reference_only_disagreements']} only under reference semantics.")
        if outcome.semantics_line:
            html.paragraph(f"WARNING: {outcome.semantics_line}.")
    if outcome.portability:
        html.paragraph(f"NOTE: {outcome.portability}.")
    if outcome.benefit is not None:
        benefit = outcome.benefit
        html.paragraph(f"Latency: ONNX Runtime CPU session, {benefit.export.threads} thread, median of "
                       f"{benefit.export.runs} runs after warm-up (b1 / b{benefit.export.batch}: milliseconds per call at "
                       f"batch 1 / {benefit.export.batch}), random inputs; peak MiB: the peak resident memory of a "
                       "process that loads only this model and runs it (ONNX Runtime included). Speedup: both models "
                       "timed in turns in one process, the median ratio of the pairs and its 95% interval; slower or "
                       f"faster only when the whole interval says so. {benefit.speed_line()}.")
        html.table(benefit.rows())
        if benefit.warning():
            html.paragraph(benefit.warning())


def _before_after_section(html, metrics: dict, outcome) -> None:
    how = ("chosen by the bounded search" if outcome.search is not None else
           f"--auto-keep-float {len(outcome.kept_float)}: the layers with the lowest scores on the evaluation data"
           if outcome.auto else "named with --keep-float")
    kept = ", ".join(outcome.kept_float) or "none (the search changed the recipe instead)"
    html.section("Layers kept in float").paragraph(f"Kept in float: {kept} ({how}). "
                                                   "The fully quantized export was measured on the same data:")
    rows = []
    for label, prefix, size in (("all layers int8", "before_keep_float.", outcome.before.size_bytes),
                                ("with layers in float", "", outcome.result.size_bytes)):
        if f"{prefix}compressed_accuracy" in metrics:
            rows.append({"export": label, "accuracy": f"{metrics[f'{prefix}compressed_accuracy']:.2%}",
                         "disagreements": metrics[f"{prefix}disagreements"], "size KiB": round(size / 1024, 1)})
        else:
            rows.append({"export": label, "size KiB": round(size / 1024, 1)})
    html.table(rows)


def _search_section(html, search, params: dict) -> None:
    """The bounded search: the bounds, every export it measured, its choice in both names, the held-out check."""
    held_out = search.held_out
    html.section("Bounded export")
    kept = ", ".join(search.kept_float) or "none (every layer quantized)"
    html.paragraph(f"Bounds: {search.bounds.describe()}, judged with {params.get('semantics', 'host')} semantics. "
                   f"Recipe: {search.recipe} (tried: {', '.join(search.recipes_tried)}). Kept in float: {kept}. The "
                   f"search measured {search.exports} exports on the evaluation data (recipes first, then each layer "
                   f"alone in float, which ranks them: {', '.join(search.ranking)}), and verified its choice on "
                   "held-out images:")
    missed = search.held_out_failures
    verdict = "meets the bounds" if not missed else "MISSES " + "; ".join(missed)
    html.paragraph(f"Held out: {held_out.describe(upper_bound=True)} (the upper bound: of the disagreement rate, "
                   f"one-sided Clopper-Pearson). The choice {verdict} there.")
    html.table(search.rows())
    if search.kept_float:
        html.paragraph("To reproduce this export with ONNX Runtime's quantizer, exclude these nodes "
                       "(PyTorch module -> ONNX node):")
        html.table([{"module": module, "ONNX node": node}
                    for module, node in zip(params["kept_float"], params["nodes_to_exclude"])])
        settings = {key: params[key] for key in ("activations", "weights", "reduce_range", "per_channel",
                                                 "calibration") if key in params}
        html.code(f"quantize_static(..., nodes_to_exclude={params['nodes_to_exclude']!r})  # recipe: {settings}")


def _blame_section(html, found) -> None:
    from mlflow_di.compression.blame import WITHIN_USUAL
    from mlflow_di.reporting.plots import bar_plot

    html.section("Blame per trigger")
    html.paragraph(
        f"For each of the campaign's {len(found.triggers)} triggers, the first layer (in graph order) where the "
        f"fully quantized export's activations part from the float model's by more than they usually do: more "
        f"than the {found.quantile:.0%} quantile of that tensor's relative error on {found.usual_images} evaluation "
        f"images. '{WITHIN_USUAL}': no tensor exceeded it. By chance alone, {found.false_alarm_rate:.1%} of the "
        "evaluation images exceed some tensor's usual error: a layer's share well above that is a finding.")
    counts = found.counts()
    shares = {layer: count / len(found.triggers) for layer, count in counts.items()}
    html.image(bar_plot(shares, "Triggers blamed on each layer", percent=True))
    html.table(found.rows())


def _sensitivity_section(html, found) -> None:
    html.section("Layer sensitivity: weights vs activations, alone vs all but one")
    html.paragraph(
        f"Weight-only / activation-only: the model in PyTorch with only this layer's weights (int8 per channel) or "
        f"only its input (int8 per tensor, calibrated range) rounded, on {found.simulated_images} evaluation images: "
        "the logits' SQNR against the float model (dB, higher is better) and the images whose top-1 changes. "
        f"Quantized alone / all but this one: ONNX Runtime exports quantizing only this layer, or every layer but "
        f"this one, and their top-1 disagreements with the original on {found.images} images (every layer "
        f"quantized: {found.all_int8_disagreements}). A layer whose 'all but' count is far below that is one to "
        "keep in float; weight-only far below activation-only says its weights, not its input range, cost the most.")
    html.table(found.rows())


def _deviation_section(html, deviation) -> None:
    import numpy as np

    from mlflow_di.deviation import matrix_rows
    from mlflow_di.reporting.plots import heatmap

    matrix = deviation["matrix"]
    html.section("Per-class deviation on the evaluation data")
    html.paragraph("Rows: the source model's top-1 label; columns: the export's. The diagonal counts agreement; "
                   "every other cell counts inputs the export moved from the row's class to the column's.")
    html.table(matrix_rows(matrix))
    off_diagonal = matrix.astype(float)
    np.fill_diagonal(off_diagonal, np.nan)
    if np.nansum(off_diagonal) > 0:
        names = [str(i) for i in range(len(matrix))]
        html.image(heatmap(off_diagonal, names, names, "Disagreements: source label (row) -> export label (column)",
                           symmetric=False, colorbar_label="images"), "diagonal (agreement) greyed out")
    html.paragraph("Accuracy per true class; a drop on a class with few images is noisy.")
    html.table([c.to_row() for c in deviation["classes"]])


def _diagnosis_section(html, diagnosis) -> None:
    from mlflow_di.reporting.plots import bar_plot

    what = "evaluation data" if diagnosis.data == "eval" else "fuzz triggers"
    html.section(f"Layer-wise quantization diagnosis on the {what}")
    html.paragraph(
        f"SQNR in dB (higher is better, ~6 dB per bit) of the QDQ int8 model against the float model it was "
        f"quantized from, on {diagnosis.images} images. sqnr_db: the float model's tensor vs the QDQ model's "
        "(error accumulated up to there); qdq_sqnr_db: the QDQ model's tensor just before vs after its own "
        "quantize/dequantize pair (blank where the quantizer folded a ReLU into that pair). A layer's score is "
        "the lowest sqnr_db of the activations it produces; --auto-keep-float K keeps the K lowest in float.")
    scores = diagnosis.layer_scores()
    if scores:
        worst = dict(list(scores.items())[:SQNR_PLOT_LAYERS])
        html.image(bar_plot(worst, f"Layer score (lowest activation SQNR) on the {what}, worst first",
                            percent=False, ylabel="SQNR dB"))
    html.table(diagnosis.rows())
