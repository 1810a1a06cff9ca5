"""``mlflow-di compress``: compressed ONNX exports of a model, registered with their lineage.

One MLflow run and one registered version per method. Each run logs the accuracy of source
and export on the evaluation data, their top-1 disagreements there, and both sizes; the
version and the logged model carry lineage tags (source URI/version, method, parameters).
On the evaluation data each run also logs the per-class deviation (original label x compressed
label matrix, per-class accuracy drop, ``max_class_accuracy_drop`` for the gate) and the deviation
accuracy hides: ``disagreement_rate`` (for the gate), the flips either way, the KL divergence of
the export's probabilities from the source's and both models' top-1/top-2 margins. The run of a selective
method (one its declaration says can keep layers in float) logs the layer-wise quantization diagnosis (SQNR
per tensor, float vs QDQ model; on the evaluation data and, with ``--triggers``, on a fuzz campaign's
triggers); with ``--keep-float``
or ``--auto-keep-float`` it registers an export with those layers left in float and reports the
fully quantized export's figures next to it (``before_keep_float.*``). With
``--max-accuracy-drop``/``--max-disagreement-rate`` it searches for the export with the fewest
layers in float that meets those bounds on the evaluation data, verifies it on ``--holdout-data``
(:mod:`mlflow_di.compression.bounded`) and logs every export the search measured.
"""
from __future__ import annotations

import json
import pathlib
import tempfile
from typing import TYPE_CHECKING

import click

from mlflow_di.commands.method_options import help_sections, method_click_options, method_settings
from mlflow_di.commands.options import (CommaList, DeclaredOptionsCommand, FiniteFloat, LayerNames, ModelName,
                                        RuntimeList, device_option, preprocessing_option)
from mlflow_di.compression.declarations import method_help, methods_that
from mlflow_di.models.runtimes import runtime_help

if TYPE_CHECKING:
    from mlflow_di.compression.export_record import CompressionSource, SourceBenefit
    from mlflow_di.compression.outcome import Outcome
    from mlflow_di.compression.selection import HeldOut, Selection


@click.command("compress", cls=DeclaredOptionsCommand, sections=help_sections, declared=method_click_options)
@click.option("--model-uri", required=True, help="Source PyTorch model (models:/NAME/VERSION, a .pt file, keras:ARCH:FILE).")
@click.option("--method", "methods", required=True,
              type=CommaList("mlflow_di.compression.declarations:METHODS", "compression method", "METHOD"),
              help=f"One or more compression methods, comma-separated: {method_help()}.")
@click.option("--calib-data", default=None,
              help="Data spec the methods that need calibration calibrate on (e.g. mnist-train:DIR[0:500]).")
@click.option("--eval-data", default=None, help="Data spec to compare accuracies on (default: --calib-data).")
@click.option("--amount", type=FiniteFloat(0.0, 1.0, max_open=True), default=0.3, show_default=True,
              help=f"Pruning fraction, for the methods that prune ({', '.join(methods_that('prunes'))}; their "
                   "summaries in --method say of what).")
@click.option("--register-as", type=ModelName(), default=None, help="Registered model name (default: <source>-<method>).")
@click.option("--keep-float", type=LayerNames(), default=None, metavar="LAYER[,LAYER...]",
              help="Leave these layers (PyTorch module names, e.g. conv2.0) in float.")
@click.option("--auto-keep-float", type=click.IntRange(0), default=0, show_default=True, metavar="K",
              help="Leave the K layers with the lowest activation SQNR (see the report) in float.")
@click.option("--triggers", type=click.Path(file_okay=False), default=None, metavar="CAMPAIGN_DIR",
              help="Also diagnose the quantization layer by layer on this fuzz campaign's triggers.")
@click.option("--diagnosis-images", type=click.IntRange(0), default=256, show_default=True,
              help="Images (the first ones) of the evaluation data and of the triggers for the layer-wise diagnosis; 0 "
                   "skips it. Memory grows with it (all activations of a batch are kept).")
@click.option("--max-accuracy-drop", type=FiniteFloat(0.0, 1.0), default=None, metavar="FRACTION",
              help="Register the export with the fewest layers in float whose accuracy on --eval-data is at most this "
                   "much below the source's (0.01 = 1 point); verified on --holdout-data. Other methods ignore it.")
@click.option("--max-disagreement-rate", type=FiniteFloat(0.0, 1.0), default=None, metavar="FRACTION",
              help="As --max-accuracy-drop, for the fraction of --eval-data images on which the export's top-1 differs "
                   "from the source's.")
@click.option("--max-realistic-success-rate", type=FiniteFloat(0.0, 1.0), default=None, metavar="FRACTION",
              help="As --max-accuracy-drop, for the fraction of --fuzz-seeds seeds on which a boundary search (the "
                   "source's gradients, 200 queries to the export per seed) finds a trigger no pixel of which moves "
                   "more than 32 levels from its seed.")
@click.option("--fuzz-seeds", type=click.IntRange(1), default=50, show_default=True, metavar="N",
              help="With --max-realistic-success-rate: the first N images of --eval-data (search) and of "
                   "--holdout-data (verification) are fuzzed against each candidate.")
@click.option("--holdout-data", default=None, metavar="SPEC",
              help="Data spec the bounded export is verified on: images the search did not see "
                   "(e.g. mnist-test:DIR[5000:10000] with --eval-data mnist-test:DIR[0:5000]).")
@click.option("--semantics", type=click.Choice(["host", "reference", "both"]), default="host", show_default=True,
              help="Which answers a bound judges: host (ONNX Runtime's kernels on this CPU), reference (the QDQ "
                   "graph as written, the same on every CPU) or both. Both are always measured and logged.")
@click.option("--benefit/--no-benefit", default=True, show_default=True,
              help="Measure latency (batch 1 and 64, median of 20 runs, 1 thread), throughput, size and peak "
                   "memory of each export and of its source on this host.")
@click.option("--sensitivity", is_flag=True, default=False,
              help="Per layer, the error of quantizing only its weights vs only its input (simulated) and the "
                   "disagreements of an export quantizing it alone / all layers but it (two exports a layer).")
@click.option("--runtime", "runtimes", type=RuntimeList(), default=None,
              help=f"Runtimes each export is scored on, the first one's figures as the export's own, the others' "
                   f"beside them (runtime.NAME.*): {runtime_help()}.")
@preprocessing_option
@device_option
def command(model_uri, methods, calib_data, eval_data, amount, register_as, keep_float, auto_keep_float, triggers,
            diagnosis_images, preprocessing, max_accuracy_drop=None, max_disagreement_rate=None, holdout_data=None,
            sensitivity=False, max_realistic_success_rate=None, fuzz_seeds=50, device="cpu", semantics="host",
            benefit=True, runtimes=None, **method_values) -> list[str]:
    """Export MODEL-URI as compressed ONNX models, register each, and record lineage.

    Export, quantization and pruning run on the CPU; --device is where the source and the exports
    are evaluated. Returns the registered versions' URIs (for callers such as the demo)."""
    from mlflow_di.compression.export_record import CompressionSource, SourceBenefit
    from mlflow_di.compression.selection import Selection, labelled_split, source_probabilities
    from mlflow_di.data import load_images
    from mlflow_di.fuzz import load_campaign
    from mlflow_di.mlflow_edge import registry
    from mlflow_di.mlflow_edge.evidence_tags import evidence_line, evidence_tags, searched_on
    from mlflow_di.models.loading import load_torch_model, resolve
    from mlflow_di.models.reference import ModelRef

    _check_options(methods, calib_data, register_as, keep_float=keep_float, auto_keep_float=auto_keep_float,
                   triggers=triggers, sensitivity=sensitivity, diagnosis_images=diagnosis_images)
    bounds = _bounds(methods, max_accuracy_drop, max_disagreement_rate,
                     max_realistic_success_rate=max_realistic_success_rate, holdout_data=holdout_data,
                     keep_float=keep_float, auto_keep_float=auto_keep_float, diagnosis_images=diagnosis_images)
    trigger_images = load_campaign(triggers).triggers if triggers else None  # --triggers' campaign
    ref = ModelRef.parse(model_uri)
    resolved = resolve(ref)
    source = load_torch_model(resolved, preprocessing)
    graph = str(resolved.path) if resolved.format.graph else None
    keep_float = _kept_float(source, methods, keep_float, auto_keep_float)
    settings = method_settings(methods, method_values)
    prepare = source.preprocessing.prepare  # lazy: resized per batch if the model says so
    raw_calib = load_images(calib_data) if calib_data else None
    raw_eval = load_images(eval_data) if eval_data else raw_calib
    calib = prepare(raw_calib) if raw_calib is not None else None
    evaluation = prepare(raw_eval) if eval_data else calib
    inputs = _inputs(raw_calib, raw_eval)
    evidence = evidence_tags(eval_data, raw_calib, raw_eval)
    if evidence_line(evidence):
        click.echo(f"NOTE: {evidence_line(evidence)}")
    source_tags = registry.model_version_tags(model_uri)
    original = source_probabilities(source, evaluation, device)  # once: exports and pruning work on copies
    held_out = _held_out(source, holdout_data, inputs, device) if bounds is not None else None
    if held_out is not None:
        held_out.require_provable(bounds, fuzz_seeds)  # one line before any export, when it could never show a bound
        evidence = searched_on(evidence, held_out.images.name)
    splits = (labelled_split(evaluation, original), held_out.split if held_out else None) \
        if bounds is not None or sensitivity else ()
    selection = Selection(tuple(keep_float or ()), auto_keep_float, diagnosis_images, trigger_images=trigger_images,
                          triggers_folder=triggers, graph=graph, bounds=bounds, sensitivity=sensitivity,
                          fuzz_seeds=fuzz_seeds, splits=splits, settings=settings, semantics=semantics, benefit=benefit,
                          held_out=held_out, runtimes=tuple(runtimes or ()))
    with tempfile.TemporaryDirectory(prefix="mlflow-di-compress-") as scratch:
        compressed = CompressionSource(source, ref, source_tags, lineage=_lineage(ref, source_tags), probabilities=original,
                                       benefit=SourceBenefit(source, pathlib.Path(scratch), graph), device=device)
        outcomes = [_compress_one(compressed, method, register_as or f"{ref.base_name}-{method}", amount=amount,
                                  calib=calib, evaluation=evaluation, selection=selection, inputs=inputs,
                                  evidence=evidence) for method in methods]
    return _registered(outcomes)


def _lineage(ref, source_tags: dict) -> dict:
    """The lineage tags every export records of its source (its URI, registered name and version)."""
    return {"mlflow_di.source_uri": ref.uri,
            "mlflow_di.source_name": source_tags.get("mlflow_di.model_name", ref.base_name),
            "mlflow_di.source_version": source_tags.get("mlflow_di.model_version", "")}


def _registered(outcomes: list) -> list[str]:
    """The registered versions' URIs; after every method (the others are registered), one line for the
    exports that missed a bound on held-out data."""
    misses = [miss for _, miss in outcomes if miss]
    if misses:
        from mlflow_di.errors import UserError

        raise UserError("; ".join(misses))
    return [uri for uri, _ in outcomes]


def _check_options(methods, calib_data, register_as, keep_float, auto_keep_float, triggers, sensitivity,
                   diagnosis_images) -> None:
    """One-line UserErrors for options that do not go together."""
    from mlflow_di.errors import UserError

    calibrated = methods_that("needs_calibration", methods)
    if calibrated and not calib_data:
        raise UserError(f"{calibrated[0]} needs calibration data: pass --calib-data SPEC (e.g. mnist-train:DIR[0:500])")
    if register_as and len(methods) > 1:
        raise UserError("--register-as names one model; with several methods leave it out (names are <source>-<method>)")
    if (keep_float or auto_keep_float or triggers or sensitivity) and not methods_that("selective", methods):
        raise UserError("--keep-float, --auto-keep-float, --triggers and --sensitivity apply to "
                        f"{' or '.join(methods_that('selective'))} only; add it to --method (got {','.join(methods)})")
    if auto_keep_float and not diagnosis_images:
        raise UserError("--auto-keep-float ranks layers by the diagnosis; leave --diagnosis-images above 0")


def _kept_float(source, methods, keep_float, auto_keep_float):
    """--keep-float's layers (``all``: every prunable layer), checked against the model."""
    from mlflow_di.compression.methods import check_keep_float

    if keep_float == "all":
        from mlflow_di.compression.prune import prunable_layers

        keep_float = [name for name, _ in prunable_layers(source.module)]
    check_keep_float(source.module, (methods_that("selective", methods) or methods)[0], keep_float or (), auto_keep_float)
    return keep_float


def _bounds(methods, max_accuracy_drop, max_disagreement_rate, max_realistic_success_rate, holdout_data, keep_float,
            auto_keep_float, diagnosis_images):
    """The bounds a bounded export must meet (None when none is asked for), or a UserError on a combination
    that cannot work."""
    from mlflow_di.compression.bounded import Bounds
    from mlflow_di.errors import UserError

    bounds = Bounds(max_accuracy_drop, max_disagreement_rate, max_realistic_success_rate)
    if not bounds.active:
        if holdout_data:
            raise UserError("--holdout-data verifies a bounded export; add --max-accuracy-drop, --max-disagreement-rate "
                            "or --max-realistic-success-rate")
        return None
    if not methods_that("selective", methods):
        raise UserError("--max-accuracy-drop, --max-disagreement-rate and --max-realistic-success-rate choose which "
                        f"layers {' or '.join(methods_that('selective'))} keeps in float; add it to --method (got "
                        f"{','.join(methods)})")
    if keep_float or auto_keep_float:
        raise UserError("a bounded export chooses the layers kept in float itself; drop --keep-float/--auto-keep-float")
    if not diagnosis_images:
        raise UserError("the bounded search ranks layers by the diagnosis; leave --diagnosis-images above 0")
    if not holdout_data:
        raise UserError("a bounded export is verified on images the search does not see: pass --holdout-data SPEC "
                        "(e.g. --eval-data mnist-test:DIR[0:5000] --holdout-data mnist-test:DIR[5000:10000])")
    return bounds


def _held_out(source, holdout_data: str, inputs: dict, device) -> HeldOut:
    """The bounded search's held-out images with the source's answers (recorded as the run's held-out input)."""
    from mlflow_di.compression.selection import HeldOut
    from mlflow_di.data import load_images
    from mlflow_di.mlflow_edge import datasets

    raw_held_out = load_images(holdout_data)
    inputs["held-out"] = datasets.spec_dataset(raw_held_out)
    return HeldOut.measure(source, source.preprocessing.prepare(raw_held_out), device)


def _inputs(raw_calib, raw_eval) -> dict:
    """{context: dataset} of the data as the specs load them, each read once for all methods' runs."""
    from mlflow_di.mlflow_edge import datasets

    inputs = {}
    if raw_calib is not None:
        inputs["calibration"] = datasets.spec_dataset(raw_calib)
    if raw_eval is not None:
        inputs["evaluation"] = inputs["calibration"] if raw_eval is raw_calib else datasets.spec_dataset(raw_eval)
    return inputs


def _compress_one(source: CompressionSource, method: str, name: str, amount: float, calib, evaluation,
                  selection: Selection, inputs: dict, evidence: dict) -> tuple[str | None, str]:
    """One method's run and registered export, named ``name``; ``evidence``: the provenance tags of its figures
    (:mod:`~mlflow_di.mlflow_edge.evidence_tags`). Returns (the registered version's URI, ""), or (None, why)
    for a bounded export that misses a bound on its held-out data: such an export is never registered (its
    file and figures stay in the run's artifacts)."""
    import mlflow_di
    from mlflow_di.compression.export_record import export_metrics, export_params, other_runtimes
    from mlflow_di.compression.declarations import method_declaration
    from mlflow_di.mlflow_edge import models, runs
    from mlflow_di.reporting.compression_report import compression_report

    declared = method_declaration(method)
    selection = selection.scored_also_on(declared.made_for)
    with tempfile.TemporaryDirectory(prefix="mlflow-di-compress-") as scratch:
        tags = {"mlflow_di.command": "compress", "mlflow_di.method": method, **source.tags, **evidence}
        with runs.tracked_run(f"compress {source.ref.short} {method}", tags=tags) as log:
            log.inputs((dataset, context) for context, dataset in inputs.items()
                       if context != "calibration" or declared.needs_calibration)
            outcome = _export_keeping_search(log, source.model, method, calib=calib, evaluation=evaluation,
                                             amount=amount, scratch=pathlib.Path(scratch), selection=selection)
            result = outcome.result
            log.params({"model_uri": source.ref.uri, "method": method,
                        **export_params(declared, amount, calib, outcome, selection),
                        "eval_data": evaluation.name if evaluation is not None else "none"})
            compressed = selection.primary_runtime.open(result.path, None, f"{name} ({method})", source.device)
            context = compressed.execution_context
            log.tags(context.tags())
            outcome = outcome.measured_with(context, _benefit(source.benefit, result) if selection.benefit else None)
            metrics, deviation, outcome = export_metrics(method, name, source.probabilities, compressed=compressed,
                                                         evaluation=evaluation, outcome=outcome, selection=selection,
                                                         device=source.device)
            judged_on = other_runtimes(selection, compressed, source.probabilities, evaluation, source.device)
            metrics.update(judged_on.metrics)
            log.tags(judged_on.tags)
            log.json(result.to_dict(), "compress/result.json")
            _log_tables(log, deviation, outcome)
            log.text(compression_report(source.ref.uri, name, result, metrics, deviation, outcome), "compress/report.html")
            if outcome.search is not None and outcome.search.held_out_failures:
                log.metrics(metrics, dataset=inputs.get("evaluation"))
                log.tags({"mlflow_di.held_out": "missed"})
                log.folder(_alone(result.path, pathlib.Path(scratch) / "unregistered"), "compress/export")
                _echo_summary(declared, name, None, metrics=metrics, deviation=deviation, outcome=outcome, judged_on=judged_on)
                return None, _miss_line(method, outcome.search, selection.held_out.images.name, log.run_id)
            lineage = {**source.lineage, "mlflow_di.method": method,
                       "mlflow_di.params": json.dumps(result.params, sort_keys=True),
                       "mlflow_di.version": mlflow_di.__version__, **outcome.context.tags(), **judged_on.tags,
                       **(outcome.benefit.tags() if outcome.benefit is not None else {})}
            info = models.log_onnx_model(result.path, compressed.preprocessing, lineage)
            # logged once the export is a LoggedModel, so they are its own metrics too (its page in the UI),
            # and before it is registered: a compress stopped in between registers nothing
            log.metrics(metrics, model_id=getattr(info, "model_id", None), dataset=inputs.get("evaluation"))
            version = models.register_logged_model(info, name, lineage)
        _echo_summary(declared, name, version.version, metrics=metrics, deviation=deviation, outcome=outcome, judged_on=judged_on)
    return f"models:/{name}/{version.version}", ""


def _alone(path, folder: pathlib.Path) -> pathlib.Path:
    """A folder holding only the file ``path`` (what is logged of an export that is not registered)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, folder / pathlib.Path(path).name)
    return folder


def _miss_line(method: str, search, held_out_data: str, run_id: str) -> str:
    """Why a bounded export was not registered, in one line."""
    return (f"the {method} export the bounded search chose meets its bounds on the search data "
            f"({search.chosen.search.describe()}) but the held-out data {held_out_data} does not show that it meets "
            "them: "
            f"{'; '.join(search.held_out_failures)}; not registered (its file and figures are in run {run_id}, "
            "compress/export); loosen the bound, or give the search more data (--eval-data)")


def _export_keeping_search(log, source, method, calib, evaluation, amount, scratch, selection) -> Outcome:
    """:func:`~mlflow_di.compression.outcome.export_outcome`; a bounded search that finds no export logs what
    it measured before it fails."""
    from mlflow_di.compression.bounded import UnreachableBounds
    from mlflow_di.compression.outcome import export_outcome

    try:
        return export_outcome(source, method, calib, evaluation=evaluation, amount=amount, scratch=scratch, selection=selection)
    except UnreachableBounds as unreachable:
        _log_search(log, unreachable.search)
        raise


def _benefit(baseline: SourceBenefit, result):
    """The export's :class:`~mlflow_di.models.benefit.Comparison` with its source, or None (with a
    warning) when it could not be measured."""
    from mlflow_di.errors import UserError

    try:
        return baseline.compare(result.path)
    except UserError as exc:  # the export itself is sound: say why its speed is unknown and go on
        click.echo(f"  WARNING: no latency figures for the {result.method} export: {exc} (gate --min-speedup will "
                   "say it was not measured)")
        return None


def _log_search(log, search) -> None:
    log.json(search.to_dict(), "compress/bounded_search.json")
    log.table(search.rows(), "compress/bounded_search_table.json")


def _log_tables(log, deviation, outcome: Outcome) -> None:
    """Per-class deviation and the layer-wise diagnosis as MLflow tables and JSON."""
    from mlflow_di.deviation import matrix_rows

    if deviation is not None:
        log.table(matrix_rows(deviation["matrix"]), "compress/deviation_matrix.json")
        log.table([c.to_row() for c in deviation["classes"]], "compress/per_class_accuracy.json")
    if outcome.search is not None:
        _log_search(log, outcome.search)
    if outcome.blame is not None:
        log.json(outcome.blame.to_dict(), "compress/blame.json")
        log.table(outcome.blame.rows(), "compress/blame_table.json")
    if outcome.sensitivity is not None:
        log.json(outcome.sensitivity.to_dict(), "compress/sensitivity.json")
        log.table(outcome.sensitivity.rows(), "compress/sensitivity_table.json")
    for diagnosis in outcome.diagnoses:
        log.table(diagnosis.rows(), f"compress/sqnr_{diagnosis.data}.json")
        log.json(diagnosis.to_dict(), f"compress/diagnosis_{diagnosis.data}.json")


def _echo_summary(declared, name: str, version, metrics: dict, deviation, outcome: Outcome, judged_on) -> None:
    """The export's summary on the console (:func:`~mlflow_di.reporting.compression_console.summary_lines`)."""
    from mlflow_di.reporting.compression_console import runtime_lines, summary_lines

    for line in summary_lines(declared, name, version, metrics, outcome, deviation) + runtime_lines(judged_on, metrics):
        click.echo(line)
