"""A compressed export as the console shows it once its run is logged: where it was registered, its
accuracy and deviation next to the source's, size, the layers quantized or kept in float, the
execution context and what the export buys on this host, the layer-wise diagnosis, the bounded search,
sensitivity and blame. Pure: figures in, lines out (``mlflow-di compress`` echoes them).

``outcome`` is what one method produced (:class:`~mlflow_di.compression.outcome.Outcome`);
``declared`` is the method's :class:`~mlflow_di.compression.methods.MethodDeclaration` (what it is
says why its file may be no smaller than its source's).
"""
from __future__ import annotations


def points_change(change: float) -> str:
    """An accuracy change in words a reader cannot misread: ``0.06 points lower``, ``0.16 points higher``, ``no change``."""
    points = round(abs(change) * 100, 2)
    return "no change" if points == 0 else f"{points:.2f} points {'higher' if change > 0 else 'lower'}"


def size_notes(declared, result, metrics: dict) -> list[str]:
    """Why a compressed file can be no smaller than its source, said where it happens."""
    notes = []
    if declared.prunes:
        notes.append(f"gzipped {metrics['compressed_gzip_bytes'] / 1024:.1f} KiB: ONNX stores pruned weights dense, "
                     "so pruning saves space once the file is compressed (or with a sparse runtime), not on disk")
    elif declared.integer and result.size_bytes >= result.source_size_bytes:
        notes.append("the int8 file is not smaller: in a model this small, the added Quantize/DequantizeLinear "
                     "nodes and their scales outweigh the 4x smaller weights")
    return notes


def _spread(metrics: dict, name: str, points: bool = False) -> str:
    """``; 95% CI 0.33%-2.33%`` (points: ``-0.08 to +2.25 pts``) from ``NAME_low``/``NAME_high``, "" without them."""
    if f"{name}_low" not in metrics:
        return ""
    low, high = metrics[f"{name}_low"], metrics[f"{name}_high"]
    if points:
        return f"; drop 95% CI {low * 100:+.2f} to {high * 100:+.2f} pts"
    return f" (95% CI {low:.2%}-{high:.2%})"


def summary_lines(declared, name: str, version, metrics: dict, outcome, deviation=None) -> list[str]:
    """The export's summary: registered as ``models:/name/version`` (``version`` None: not registered, it
    the held-out data does not show it meets its bounds), then its figures, one line each."""
    result = outcome.result
    lines = [f"{declared.name:<17} -> " + (f"models:/{name}/{version}" if version is not None else
                                           "not registered: the held-out data does not show it meets its bounds")]
    if "source_accuracy" in metrics:
        lines.append(f"  accuracy {metrics['source_accuracy']:.2%} -> {metrics['compressed_accuracy']:.2%} "
                     f"({points_change(-metrics['accuracy_drop'])}{_spread(metrics, 'accuracy_drop', points=True)}), "
                     f"top-1 differs on {metrics['disagreements']} of {metrics['eval_images']} images"
                     f"{_spread(metrics, 'disagreement_rate')}")
        lines.append(f"  flips: right->wrong {metrics['flips_right_to_wrong']:.2%}, wrong->right "
                     f"{metrics['flips_wrong_to_right']:.2%}; KL(source || export) mean {metrics['kl_divergence']:.4f} "
                     f"(max {metrics['kl_divergence_max']:.3f}); top-1/top-2 margin {metrics['margin_original']:.3f} "
                     f"-> {metrics['margin_compressed']:.3f}")
    lines.append(f"  size {result.source_size_bytes / 1024:.1f} KiB -> {result.size_bytes / 1024:.1f} KiB"
                 + (f", sparsity {result.sparsity:.1%}" if result.sparsity is not None else ""))
    lines.extend(f"  {line}" for line in size_notes(declared, result, metrics))
    if result.quantized_ops:
        quantized = result.quantized_ops["quantized_layers"]
        lines.append("  quantized layers: "
                     + "; ".join(f"{layer.removesuffix('.weight')} ({how})" for layer, how in quantized.items()))
        if result.quantized_ops["float_layers"]:
            lines.append(f"  left in float: {', '.join(result.quantized_ops['float_layers'])}")
    if deviation is not None and deviation["worst"] is not None:
        worst = deviation["worst"]
        if worst.accuracy_drop > 0:
            lines.append(f"  largest class accuracy drop: class {worst.label} {worst.original_accuracy:.2%} -> "
                         f"{worst.compressed_accuracy:.2%} ({worst.images} images)")
        else:
            lines.append("  no class lost accuracy")
    lines += _runtime_lines(metrics, outcome) + _diagnosis_lines(metrics, outcome)
    if outcome.search is not None:
        lines += _search_lines(outcome.search, result.params)
    if outcome.sensitivity is not None:
        lines += _sensitivity_lines(outcome.sensitivity)
    if outcome.blame is not None:
        lines.append(_blame_line(outcome.blame))
    return lines


def _runtime_lines(metrics: dict, outcome) -> list[str]:
    """Where the figures were measured, host vs reference semantics, and what the export buys on this host."""
    if outcome.context is None:
        return []
    lines = [f"  runtime: {outcome.context.describe()}"]
    if "reference.disagreements" in metrics:
        lines.append(f"  host vs reference semantics: top-1 differs on {metrics['disagreements']} vs "
                     f"{metrics['reference.disagreements']} images ({metrics['host_only_disagreements']} only on "
                     "this host)")
    if outcome.semantics_line:
        lines.append(f"  WARNING: {outcome.semantics_line}")
    if outcome.portability:
        lines.append(f"  NOTE: {outcome.portability}")
    if outcome.benefit is not None:
        benefit = outcome.benefit
        lines.append(f"  latency {benefit.source.latency_b1_ms:.3f} -> {benefit.export.latency_b1_ms:.3f} ms (batch 1), "
                     f"{benefit.source.latency_batch_ms:.2f} -> {benefit.export.latency_batch_ms:.2f} ms (batch "
                     f"{benefit.export.batch}); peak memory {benefit.source.peak_memory_mib:.1f} -> "
                     f"{benefit.export.peak_memory_mib:.1f} MiB")
        lines.append(f"  {benefit.speed_line()}")
        if benefit.warning():
            lines.append(f"  {benefit.warning()}")
    return lines


def _search_lines(search, params: dict) -> list[str]:
    """The bounded search: what it measured and kept in float, its figures on the search and held-out data."""
    kept = ", ".join(f"{module} (ONNX node {node})" for module, node in
                     zip(params.get("kept_float", []), params.get("nodes_to_exclude", []))) or "none"
    return [f"  bounded search ({search.bounds.describe()}, {params.get('semantics', 'host')} semantics): "
            f"{search.exports} exports measured; recipe {search.recipe} (tried {', '.join(search.recipes_tried)}); "
            f"kept in float: {kept}",
            f"  search data: {search.chosen.search.describe()}",
            f"  held out: {search.held_out.describe(upper_bound=True)}",
            *(f"  FAIL: the held-out data does not show the chosen export meets a bound: {missed}"
              for missed in search.held_out_failures)]


def _blame_line(found) -> str:
    """The layers most triggers are blamed on, and how often evaluation images exceed some layer's usual error."""
    total = len(found.triggers)
    return (f"  blame on {total} triggers: " + ", ".join(f"{layer} {count / total:.0%}"
                                                         for layer, count in list(found.counts().items())[:4])
            + f" (by chance, {found.false_alarm_rate:.0%} of evaluation images exceed some layer's usual error)")


def _sensitivity_lines(found) -> list[str]:
    """The three layers whose float copy helps most, and each layer's weight-only vs activation-only error."""
    helpful = sorted((row for row in found.layers if row.all_but_disagreements is not None),
                     key=lambda row: (row.all_but_disagreements, row.layer))[:3]
    return [f"  sensitivity (every layer int8: {found.all_int8_disagreements} disagreements of {found.images}): "
            + ", ".join(f"{row.layer} in float -> {row.all_but_disagreements}" for row in helpful),
            "  weight-only / activation-only logits SQNR: "
            + ", ".join(f"{row.layer} {row.weight_only_sqnr_db:.1f}/{row.activation_only_sqnr_db:.1f} dB"
                        for row in found.layers)]


def _diagnosis_lines(metrics: dict, outcome) -> list[str]:
    """The worst layers of each diagnosis, its notes, and the layers kept in float next to the all-int8 export."""
    lines = []
    for diagnosis in outcome.diagnoses:
        worst = list(diagnosis.layer_scores().items())[:3]
        lines.append(f"  lowest activation SQNR on {diagnosis.data} ({diagnosis.images} images): "
                     + ", ".join(f"{layer} {score:.1f} dB" for layer, score in worst))
    lines.extend(f"  {note}" for note in outcome.notes)
    if outcome.before is not None:
        lines.append(f"  kept in float: {', '.join(outcome.kept_float) or 'none (the search changed the recipe)'}")
        if "before_keep_float.compressed_accuracy" in metrics:
            lines.append(f"  all layers int8: accuracy {metrics['before_keep_float.compressed_accuracy']:.2%}, top-1 "
                         f"differs on {metrics['before_keep_float.disagreements']} images, "
                         f"size {outcome.before.size_bytes / 1024:.1f} KiB")
    return lines


def runtime_lines(judged_on, metrics: dict) -> list[str]:
    """One line per runtime the export was also scored on (``compress --runtime A,B``): where, its
    disagreement with the source and its accuracy drop with their intervals, and on how many images its top-1
    differs from the first runtime's (:class:`~mlflow_di.compression.export_record.OtherRuntimes`)."""
    lines = []
    for choice, context in judged_on.contexts.items():
        prefix = f"runtime.{choice.slug}."
        figures = {key.removeprefix(prefix): value for key, value in metrics.items() if key.startswith(prefix)}
        line = f"  on {context.describe()}"
        if "disagreements" in figures:
            line += (f": top-1 differs from the source on {figures['disagreements']} of {figures['eval_images']} "
                     f"images{_spread(figures, 'disagreement_rate')}, accuracy "
                     f"{points_change(-figures['accuracy_drop'])}{_spread(figures, 'accuracy_drop', points=True)}")
        if "top1_differs_from_first" in figures:
            line += (f"; differs from {judged_on.primary} on {figures['top1_differs_from_first']} images (largest "
                     f"probability difference {figures['max_probability_difference']:.3g})")
        lines.append(line)
    return lines
