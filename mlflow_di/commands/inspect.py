"""``mlflow-di inspect``: what a layer's units (and IDC's important neurons) respond to, logged to MLflow.

DeepBase-style deep neural inspection (see :mod:`mlflow_di.inspection`): every unit of ``--layer``
(or only IDC's important neurons) is scored against hypotheses (class indicators, ink, contrast,
edges, centre of mass, stroke thickness, pieces of ink, closed loops, and the user's own) with
the chosen affinity measures, in one streamed pass that stops once the scores are known to
``--tolerance``. With ``--coverage`` naming a coverage run, IDC's important neurons are labelled
with their strongest hypotheses, and that run's report gets a section showing them.
"""
from __future__ import annotations

import click

from mlflow_di.commands.options import (CommaList, FiniteFloat, batch_size_option, device_option, json_out_option,
                                        preprocessing_option, seed_option)
from mlflow_di.commands.output_files import write_json_out

EXAMPLE_UNITS = 3  # units per hypothesis shown with their most activating inputs


@click.command("inspect")
@click.option("--model-uri", required=True, help="PyTorch model: models:/NAME/VERSION, runs:/..., a .pt file, keras:ARCH:FILE.")
@click.option("--data", "data_spec", required=True, help="Data spec of the inputs to inspect on, e.g. mnist-train:DIR.")
@click.option("--layer", default=None, help="Layer whose units to inspect (default: IDC's layer with --coverage, "
                                            "else the last hidden layer before the logits).")
@click.option("--units", type=click.Choice(["all", "important"]), default="all", show_default=True,
              help="Score every unit of the layer, or only IDC's important neurons.")
@click.option("--coverage", "coverage", default=None, metavar="RUN_ID|FOLDER|latest",
              help="A coverage run (or a folder saved by it) whose IDC important neurons to label; latest: the "
                   "newest coverage run of MODEL-URI, a registered version.")
@click.option("--top-m", type=click.IntRange(1), default=6, show_default=True,
              help="Important neurons to find when no --coverage is given and --units important.")
@click.option("--importance-inputs", type=click.IntRange(10), default=2000, show_default=True,
              help="Inputs (the first of --data) IDC's importance analysis uses when no --coverage is given.")
@click.option("--hypotheses", "hypothesis_specs", multiple=True, default=("builtin",), show_default=True,
              metavar="builtin|MODULE:ATTRIBUTE",
              help="Hypotheses to test: the built-in ones and/or a module's list; repeat to combine.")
@click.option("--measures", type=CommaList("mlflow_di.inspection.measures:MEASURES", "measures", "MEASURE"),
              default="pearson,spearman,mi,probe", show_default=True, help="Affinity measures.")
@click.option("--tolerance", type=FiniteFloat(0, min_open=True), default=0.1, show_default=True,
              help="Stop reading data once every score's confidence interval is narrower than this.")
@click.option("--confidence", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=0.95, show_default=True,
              help="Confidence of the intervals.")
@click.option("--early-stop/--no-early-stop", default=True, show_default=True,
              help="Stop once the scores have converged, or read all of --data.")
@seed_option
@json_out_option
@preprocessing_option
@device_option
@batch_size_option
def command(model_uri, data_spec, layer, units, coverage, top_m, importance_inputs, hypothesis_specs, measures,
            tolerance, confidence, early_stop, seed, json_out, preprocessing, device, batch_size) -> None:
    """Find which hypotheses MODEL-URI's hidden units respond to (DeepBase affinity)."""
    from mlflow_di.commands.coverage import check_layers, model_on_data
    from mlflow_di.coverage.activations import default_layer
    from mlflow_di.inspection import Inspection
    from mlflow_di.mlflow_edge import datasets, registry, runs
    from mlflow_di.mlflow_edge.run_artifacts import coverage_idc
    from mlflow_di.models.device import describe_device, out_of_memory_as_user_error

    ref, coverage, model, raw, data = model_on_data(model_uri, coverage, data_spec, preprocessing, device)
    hypotheses = _hypotheses(hypothesis_specs, data)
    fitted_idc = coverage_idc(coverage, model) if coverage else None
    layer = layer or (fitted_idc.layers_[0] if fitted_idc is not None else default_layer(model.module))
    check_layers(model, [layer], top_m if units == "important" and fitted_idc is None else 1)
    query = Inspection(hypotheses, measures=measures, tolerance=tolerance, confidence=confidence,
                       early_stop=early_stop, batch_size=batch_size, seed=seed, progress=True)
    query.check()
    tags = {"mlflow_di.command": "inspect", **registry.model_version_tags(model_uri)}
    with runs.tracked_run(f"inspect {ref.short}", tags=tags) as log:
        log.params({"model_uri": model_uri, "data": data_spec, "layer": layer, "units": units,
                    "coverage": coverage or "", "hypotheses": ",".join(h.name for h in hypotheses),
                    "measures": ",".join(measures), "tolerance": tolerance, "confidence": confidence,
                    "early_stop": early_stop, "seed": seed, "device": describe_device(model.device),
                    "batch_size": batch_size})
        log.input(datasets.spec_dataset(raw), "inspection")
        with out_of_memory_as_user_error("inspect", batch_size):
            important = _important_neurons(fitted_idc, model, data, layer=layer, units=units, top_m=top_m,
                                           importance_inputs=importance_inputs, seed=seed)
            selected = important if units == "important" else None
            groups = {"important": important} if important is not None else {}
            click.echo(f"inspecting layer {layer} on {data.name} ({len(data)} images, {len(hypotheses)} hypotheses, "
                       f"{','.join(measures)}) on {describe_device(model.device)} ...")
            result = query.run(model, data, layer, units=selected, groups=groups)
        labels = result.unit_labels(important) if important is not None else []
        log.metrics(_metrics(result))
        log.json({**result.summary(), "important_neurons": labels}, "inspection/summary.json")
        log.json(result.to_dict(), "inspection/result.json")
        log.table(result.table(), "inspection/affinity.json")
        if labels:
            log.table(labels, "inspection/important_neurons.json")
        _log_report(log, result, data, model.name, labels)
    if labels and coverage and not _is_folder(coverage):
        _label_coverage_run(coverage, labels, result)
    write_json_out({**result.summary(), "important_neurons": labels, "table": result.table()}, json_out)
    _print_summary(result, labels)


def _hypotheses(specs, data) -> list:
    import numpy as np

    from mlflow_di.inspection import builtin_hypotheses, load_hypotheses

    out = []
    for spec in specs:  # repeated names are refused by Inspection.check, before any run starts
        out.extend(builtin_hypotheses(np.unique(data.labels)) if spec == "builtin" else load_hypotheses(spec))
    return out


def _is_folder(value: str) -> bool:
    import os

    return os.path.isdir(value)


def _important_neurons(fitted_idc, model, data, layer, units, top_m, importance_inputs, seed):
    """IDC's important neurons of ``layer``: from the coverage run, or fitted on the first inputs of ``data``."""
    from mlflow_di.errors import UserError

    if fitted_idc is not None:
        if layer not in fitted_idc.fitted_layers_:
            raise UserError(f"the coverage run measured IDC on layer(s) {', '.join(fitted_idc.layers_)}, not '{layer}'; "
                            f"leave out --layer or give one of those")
        return [int(n) for n in fitted_idc.fitted_layers_[layer].important_neurons]
    if units != "important":
        return None
    from mlflow_di.coverage.idc import ImportanceDrivenCoverage

    analysis = data.subset(slice(0, importance_inputs), f"{data.name}[0:{importance_inputs}]")
    click.echo(f"finding the {top_m} important neurons of {layer} on {analysis.name} ({len(analysis)} images) ...")
    idc = ImportanceDrivenCoverage(layers=layer, top_m=top_m, seed=seed).fit(model, analysis)
    return [int(n) for n in idc.fitted_layers_[layer].important_neurons]


def _metrics(result) -> dict:
    """How much data was read, and per hypothesis the strongest unit score of the ranking measure."""
    import math

    metrics = {"inputs_read": result.n_inputs, "inputs_available": result.n_available,
               "converged": float(result.converged)}
    measure = result.unit_measure
    if measure:
        for hypothesis in result.hypotheses:
            top = result.top_units(hypothesis, 1)
            if top and math.isfinite(top[0][1]):
                metrics[f"{measure}_max_abs/{hypothesis}"] = abs(top[0][1])
    if "probe" in result.scores:
        for g, group in enumerate(result.groups):
            for h, hypothesis in enumerate(result.hypotheses):
                value = float(result.scores["probe"][g, h])
                if math.isfinite(value):
                    metrics[f"probe_{group}/{hypothesis}"] = value
    return metrics


def _stopping_line(result) -> str:
    widest = result.history[-1][1] if result.history else float("nan")
    if result.converged and result.n_inputs < result.n_available:
        return (f"read {result.n_inputs} of {result.n_available} inputs: every {result.confidence:.0%} interval was "
                f"narrower than {result.tolerance:g} (widest {widest:.3f}), so the rest was not needed")
    state = "every interval is" if result.converged else f"the widest interval is {widest:.3f}, not"
    return f"read all {result.n_inputs} inputs; {state} narrower than {result.tolerance:g}"


def _log_report(log, result, data, model_name, labels) -> None:
    from mlflow_di import reporting as rp

    html = rp.HtmlReport(f"Inspection of {model_name}, layer {result.layer}", subtitle=f"data: {result.data}")
    html.verdict(None, _stopping_line(result))
    if labels:
        html.section("What IDC's important neurons respond to").table(labels)
    for measure in result.measures:
        plot = rp.heatmap(result.scores[measure], result.rows_of(measure), result.hypotheses,
                          title=f"{measure} affinity: layer {result.layer}", symmetric=measure in ("pearson", "spearman"),
                          colorbar_label=measure)
        log.image(plot, f"inspection/heatmap_{measure}.png")
        html.section(f"Affinity: {measure}").image(plot, _measure_caption(measure))
    examples = _examples(result, data)
    if examples is not None:
        log.image(examples, "inspection/top_units_examples.png")
        html.section("Top units per hypothesis").image(
            examples, f"per hypothesis, the {EXAMPLE_UNITS} units with the strongest {result.unit_measure} and the "
                      f"inputs that activate each most")
    html.section("Hypotheses").table([{"hypothesis": h, "meaning": d} for h, d in zip(result.hypotheses,
                                                                                        result.descriptions)])
    html.section("Convergence").table([{"inputs read": n, "widest interval": w} for n, w in result.history])
    log.text(html.render(), "inspection/report.html")


def _measure_caption(measure: str) -> str:
    return {"pearson": "Pearson correlation of each unit with each hypothesis (grey: undefined, a constant unit)",
            "spearman": "Spearman rank correlation of each unit with each hypothesis",
            "mi": "mutual information (nats) between each unit's and each hypothesis' binned values",
            "probe": "cross-validated probe score of each unit group: balanced accuracy (categorical) or R^2"}[measure]


def _examples(result, data):
    """Rows of (hypothesis, unit) with the unit's most activating inputs, or None without a per-unit measure."""
    from mlflow_di import reporting as rp

    if result.unit_measure is None:
        return None
    rows, captions = [], []
    for hypothesis in result.hypotheses:
        for unit, score in result.top_units(hypothesis, EXAMPLE_UNITS):
            positions = result.top_inputs[result.units.index(unit)]
            positions = positions[positions >= 0]
            rows.append(data.images[positions])
            captions.append(f"{hypothesis}: unit {unit} ({score:+.2f})")
    return rp.labelled_image_rows(rows, captions, max_rows=len(rows)) if rows else None


def _label_coverage_run(run_id: str, labels: list[dict], result) -> None:
    """Add the labels to the coverage run: a table, and a section in its report (when it has one)."""
    import json

    from mlflow_di import reporting as rp
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge.run_artifacts import add_text_artifact, download_run_folder

    add_text_artifact(run_id, json.dumps(labels, indent=2), "coverage/important_neuron_labels.json")
    try:
        report = download_run_folder(run_id, "coverage/report.html")
    except UserError:
        click.echo(f"coverage run {run_id} has no report; its labels are in coverage/important_neuron_labels.json")
        return
    section = rp.HtmlReport("").section("What the important neurons respond to (mlflow-di inspect)")
    section.paragraph(f"Strongest hypotheses by {result.unit_measure}, on {result.n_inputs} inputs of {result.data}.")
    section.table(labels)
    page = report.read_text(encoding="utf-8")
    add_text_artifact(run_id, rp.insert_sections(page, section.fragment(), "mlflow-di inspect"), "coverage/report.html")
    click.echo(f"labelled the important neurons in coverage run {run_id}'s report")


def _print_summary(result, labels) -> None:
    click.echo(_stopping_line(result))
    for hypothesis in result.hypotheses:
        top = ", ".join(f"unit {u} ({s:+.2f})" for u, s in result.top_units(hypothesis, 2))
        click.echo(f"  {hypothesis:<18} {result.unit_measure or ''}: {top}")
    for row in labels:
        click.echo(f"  important neuron {row['neuron']}: {row['strongest']}")
