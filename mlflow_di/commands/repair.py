"""``mlflow-di repair``: Drepair a compressed model from fuzz campaigns, and register the repaired model.

The head (:mod:`mlflow_di.repair`) is trained on the campaigns' seeds, triggers and fresh
mutants, cross-validated by seed, and appended to the compressed model: an ONNX export becomes
one ONNX graph (export + head), a TFLite model a pyfunc (the .tflite file + the head's weights).
The new version carries lineage tags (``mlflow_di.repairs``: the compressed model;
``mlflow_di.repair_campaigns``: the campaigns used) and the export's source tags, so ``fuzz``
and ``gate`` take it as they take any export.
"""
from __future__ import annotations

import json
import pathlib
import re
import tempfile

import click

from mlflow_di.commands.options import ModelName, device_option, json_out_option, seed_option
from mlflow_di.commands.output_files import write_json_out

RUN_ID = re.compile(r"^(?:runs:/)?([0-9a-f]{32})/?$")
#: Model references that name one model wherever repair runs (a campaign records anything else by name only).
MLFLOW_URIS = ("models:/", "runs:/")
#: Largest difference allowed between the registered ONNX graph and the engine (compressed model + head).
ONNX_TOLERANCE = 1e-4


@click.command("repair")
@click.option("--compressed", required=True, help="The compressed model to repair (models:/NAME/VERSION, .onnx, .tflite).")
@click.option("--campaign", "campaigns", required=True, multiple=True, metavar="RUN_OR_FOLDER|latest|all",
              help="A fuzz campaign of this compressed model: its folder, or the fuzz run (ID or runs:/ID) that "
                   "logged it; latest: the newest fuzz run against --compressed, a registered version; all: every "
                   "finished fuzz run against it. Repeatable.")
@click.option("--original", default=None,
              help="The original model, whose labels are the targets (default: the one the campaigns fuzzed, when "
                   "they recorded it as a models:/ or runs:/ URI; required for file and Keras models).")
@click.option("--eval-data", default=None, help="Labelled data spec for clean-test accuracy before/after, e.g. "
                                                "mnist:DIR[5000:].")
@click.option("--register-as", type=ModelName(), default=None,
              help="Registered model name (default: <compressed name>-repaired).")
@click.option("--folds", type=click.IntRange(2), default=None,
              help="Cross-validation folds (split by seed). Default: 5, or one per triggering seed (leave one "
                   "seed out) when the campaigns have 2-4.")
@click.option("--mutants", type=click.IntRange(0), default=8, show_default=True,
              help="Fresh mutants of each triggering seed added as (mostly agreeing) examples.")
@click.option("--hidden", type=click.IntRange(1), default=32, show_default=True, help="Hidden units of the head.")
@click.option("--epochs", type=click.IntRange(1), default=400, show_default=True, help="Full-batch training steps.")
@seed_option
@json_out_option
@device_option
def command(compressed, campaigns, original, eval_data, register_as, folds, mutants, hidden, epochs, seed, json_out,
            device) -> str:
    """Train a repair head for COMPRESSED on fuzz campaigns, report how well it repairs, and register the result.

    Returns the registered version's URI."""
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import datasets, models, registry, runs
    from mlflow_di.models.execution import context_tags
    from mlflow_di.models.loading import load_classifier, resolve
    from mlflow_di.models.reference import ModelRef
    from mlflow_di.repair import HeadSettings, repair, training_set
    from mlflow_di.repair.evaluate import choose_folds

    loaded = _load_campaigns([run for spec in campaigns for run in _recorded_campaigns(compressed, spec)])
    campaigns, fuzzed = [spec for spec, _ in loaded], [c for _, c in loaded]
    compressed_ref = ModelRef.parse(compressed)
    _check_campaigns_compressed(loaded, compressed_ref.uri)
    original = original or _campaigns_original(loaded)
    original_ref = ModelRef.parse(original)
    source = resolve(compressed_ref)
    if not source.format.repairable:
        raise UserError(f"'{compressed}' is a {source.kind} model; repair registers ONNX (one graph) and TFLite "
                        "(pyfunc) compressed models")
    compressed_model = load_classifier(compressed_ref, device=device)
    original_model = load_classifier(original_ref, device=device)
    raw_test, test = _held_out(eval_data, compressed_model, fuzzed)
    data = training_set(fuzzed, original_model, compressed_model, mutants_per_seed=mutants, seed=seed)
    folds = choose_folds(data.counts()["seeds"], folds)
    settings = HeadSettings(hidden=hidden, epochs=epochs, seed=seed)
    lineage = _lineage(compressed, campaigns)
    name = register_as or f"{compressed_ref.base_name}-repaired"
    tags = {"mlflow_di.command": "repair", **registry.model_version_tags(original),
            **registry.compressed_model_tags(compressed)}
    with runs.tracked_run(f"repair {compressed_ref.short}", tags=tags) as log:
        log.tags(context_tags([compressed_model]))  # where the compressed model's answers were computed
        log.params({"compressed": compressed, "original": original, "campaigns": json.dumps(list(campaigns)),
                    "eval_data": eval_data or "none", "folds": folds, "mutants": mutants, "hidden": hidden,
                    "epochs": epochs, "seed": seed, "register_as": name})
        if raw_test is not None:
            log.input(datasets.spec_dataset(raw_test), "evaluation")
        result, head, _ = repair(fuzzed, original_model, compressed_model, settings, folds=folds,
                                 mutants_per_seed=mutants, seed=seed, test_data=test, data=data)
        with tempfile.TemporaryDirectory(prefix="mlflow-di-repair-") as scratch:
            info, check = _log_repaired(source, compressed_model, head, name=name, lineage=lineage,
                                        scratch=pathlib.Path(scratch), campaigns=fuzzed, device=device)
        metrics = _metrics(result)
        if check is not None:
            metrics["onnx_max_abs_diff"] = check
        log.metrics(metrics, model_id=getattr(info, "model_id", None))
        log.json(result.to_dict(), "repair/result.json")
        # registered last, once its figures are logged: a repair stopped before registers nothing
        version = models.register_logged_model(info, name, lineage)
        log.text(_report(compressed, name, version.version, result), "repair/report.html")
    uri = f"models:/{name}/{version.version}"
    _print_summary(uri, result, f"{source.format.title} graph" if source.format.graph else "pyfunc")
    write_json_out({"registered": uri, **result.to_dict()}, json_out)
    return uri


def _held_out(eval_data: str | None, compressed_model, fuzzed: list) -> tuple:
    """(the raw --eval-data set, prepared for the compressed model), both None without it; a one-line
    UserError when it shares images with the campaigns' seeds, which the head trains on."""
    from mlflow_di.data import load_images
    from mlflow_di.errors import UserError
    from mlflow_di.repair.dataset import shared_seed_images

    if not eval_data:
        return None, None
    raw_test = load_images(eval_data)
    test = compressed_model.preprocessing.prepare(raw_test)
    shared = shared_seed_images(test.images, fuzzed)
    if shared:
        seeds = ", ".join(sorted({c.config.data for c in fuzzed}))
        raise UserError(f"--eval-data shares {shared} images with the campaigns' seeds ({seeds}), which the head "
                        "trains on; give held-out data, e.g. digits[900:1300] for seeds from digits[1300:]")
    return raw_test, test


def _recorded_campaigns(compressed: str, spec: str) -> list[str]:
    """``spec`` itself, or for ``latest`` / ``all`` the newest / every finished fuzz run against the
    registry version ``compressed``."""
    from mlflow_di.mlflow_edge import gate_evidence, registry

    if spec not in ("latest", "all"):
        return [spec]
    tags = registry.compressed_model_tags(compressed) if registry.registry_ref(compressed) else {}
    return gate_evidence.recorded_run_ids("--campaign", spec, "fuzz", "success_rate", tags, compressed,
                                          max_results=1 if spec == "latest" else 1000)


def _load_campaigns(specs) -> list:
    """(spec, CampaignResult) of each distinct campaign: a folder or run given twice counts once
    (its seeds would weigh twice in training), with a note."""
    loaded, seen = [], {}
    for spec in specs:
        key = _campaign_key(spec)
        if key in seen:
            click.echo(f"note: --campaign '{spec}' is the campaign '{seen[key]}' again; using it once", err=True)
            continue
        seen[key] = spec
        loaded.append(_load_campaign(spec))
    return loaded


def _campaign_key(spec: str) -> str:
    """What a --campaign names: the resolved folder, or the run ID."""
    folder = pathlib.Path(spec).expanduser()
    if folder.is_dir():
        return f"folder:{folder.resolve()}"
    match = RUN_ID.match(spec.strip())
    return f"run:{match.group(1)}" if match else spec


def _load_campaign(spec: str):
    """(spec, CampaignResult) for a campaign folder or the fuzz run that logged one."""
    from mlflow_di.errors import UserError
    from mlflow_di.fuzz import load_campaign

    folder = pathlib.Path(spec).expanduser()
    if folder.is_dir():
        return spec, load_campaign(folder)
    match = RUN_ID.match(spec.strip())
    if match is None:
        raise UserError(f"--campaign '{spec}' is neither a campaign folder nor a fuzz run (a 32-character run ID "
                        "or runs:/ID)")
    from mlflow_di.mlflow_edge.models import download_campaign

    return spec, load_campaign(download_campaign(match.group(1)))


def _campaigns_original(loaded) -> str:
    from mlflow_di.errors import UserError

    originals = sorted({campaign.config.original for _, campaign in loaded})
    if len(originals) != 1:
        raise UserError(f"the campaigns fuzzed different original models ({', '.join(originals)}); "
                        "pass --original to say which one's labels to repair towards")
    chosen = originals[0]
    if not chosen.startswith(MLFLOW_URIS):
        # A file or Keras model is recorded by its display name only (a file's basename): resolving it
        # here could load (unpickle) whatever file of that name lies in the current folder.
        raise UserError(f"the campaigns fuzzed the original model '{chosen}', which is not an MLflow URI; "
                        "pass --original with the model's path (or models:/ URI)")
    click.echo(f"original model: {chosen} (the one the campaigns fuzzed)")
    return chosen


def _check_campaigns_compressed(loaded, compressed: str) -> None:
    """Refuse a campaign that fuzzed another compressed model (models:/ and runs:/ URIs compared
    exactly, files by their names: a campaign records a file model by its basename only)."""
    from mlflow_di.errors import UserError

    for spec, campaign in loaded:
        fuzzed = campaign.config.compressed
        if fuzzed.startswith(MLFLOW_URIS) or compressed.startswith(MLFLOW_URIS):
            same = fuzzed == compressed
        else:
            same = pathlib.PurePath(fuzzed).name == pathlib.PurePath(compressed).name
        if not same:
            raise UserError(f"--campaign '{spec}' fuzzed the compressed model '{fuzzed}', not --compressed "
                            f"'{compressed}'; repair a model with campaigns of that model")


def _lineage(compressed: str, campaigns) -> dict:
    """Version tags of the repaired model: what it repairs, from which campaigns, and the export's source."""
    import mlflow_di
    from mlflow_di.mlflow_edge import registry

    tags = {"mlflow_di.repairs": compressed, "mlflow_di.repair_campaigns": json.dumps(list(campaigns)),
            "mlflow_di.method": "drepair", "mlflow_di.version": mlflow_di.__version__}
    if registry.registry_ref(compressed) is not None:
        version = registry.resolve_version(compressed)
        tags["mlflow_di.repairs"] = registry.version_uri(version)
        inherited = {k: v for k, v in (version.tags or {}).items()
                     if k in ("mlflow_di.source_uri", "mlflow_di.source_name", "mlflow_di.source_version")}
        tags.update(inherited)
        if "mlflow_di.method" in (version.tags or {}):
            tags["mlflow_di.method"] = f"{version.tags['mlflow_di.method']}+drepair"
    return tags


def _log_repaired(source, compressed_model, head, name: str, lineage: dict, scratch: pathlib.Path, campaigns,
                  device):
    """Log (not register) the repaired model; for ONNX, also the largest difference between ONNX
    Runtime's outputs and the engine's (compressed model + head) on the campaigns' triggers,
    refused (a UserError, nothing registered) above ONNX_TOLERANCE."""
    import dataclasses

    import numpy as np

    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import models
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.repair.onnx_graph import append_head

    if not source.format.graph:
        return models.log_repaired_pyfunc(source.path, head, compressed_model.preprocessing, lineage), None
    path = append_head(source.path, head, compressed_model.preprocessing, scratch / f"{name}.onnx",
                       {"repairs": lineage["mlflow_di.repairs"]})
    repaired = OnnxClassifier(path, name=name, device=device)
    probe = np.concatenate([c.triggers[:32] for c in campaigns])
    check = float(np.max(np.abs(repaired.predict_proba(probe) - head(compressed_model.predict_proba(probe)))))
    if not check <= ONNX_TOLERANCE:  # NaN fails too
        raise UserError(f"the repaired ONNX graph differs from the compressed model + head by up to {check:.3g} "
                        f"(more than {ONNX_TOLERANCE:g}) on the campaigns' triggers; nothing registered")
    preprocessing = dataclasses.replace(compressed_model.preprocessing, output="probabilities")
    return models.log_onnx_model(path, preprocessing, lineage), check


def _metrics(result) -> dict:
    metrics = {}
    for prefix, counts in (("cv", result.cross_validation.pooled), ("cv_paper", result.cross_validation.paper_kinds)):
        values = counts.to_dict()
        for key in ("repair_ratio", "inducing_ratio", "improvement", "deviating", "agreeing", "deviations_after"):
            if values[key] is not None:
                metrics[f"{prefix}_{key}"] = values[key]
    metrics.update({f"training_{k}": v for k, v in result.training_set.items()})
    clean = result.clean
    if clean is not None:
        metrics.update(source_accuracy=clean.original_accuracy, compressed_accuracy=clean.compressed_accuracy,
                       repaired_accuracy=clean.repaired_accuracy,
                       accuracy_drop=clean.original_accuracy - clean.repaired_accuracy,
                       eval_images=clean.images, clean_deviations_before=clean.deviations.deviating,
                       clean_deviations_after=clean.deviations.deviations_after, **clean.intervals)
        for key in ("repair_ratio", "inducing_ratio", "improvement"):
            value = getattr(clean.deviations, key)
            if value is not None:
                metrics[f"clean_{key}"] = value
    return metrics


def _report(compressed: str, name: str, version, result) -> str:
    from mlflow_di.reporting import HtmlReport

    cv = result.cross_validation
    html = HtmlReport(f"Drepair of {compressed}", subtitle=f"registered as models:/{name}/{version}")
    pooled = cv.pooled.to_dict()
    html.verdict(None, f"{result.folds}-fold cross-validation by seed: repaired {cv.pooled.repaired} of "
                       f"{cv.pooled.deviating} held-out deviations, induced {cv.pooled.induced} new ones on "
                       f"{cv.pooled.agreeing} agreeing inputs")
    html.section("Cross-validation (pooled over the held-out folds)").metrics(
        pooled, percent_keys=["repair_ratio", "inducing_ratio", "improvement"])
    html.section("Seeds and triggers only (the paper's kinds of input)").metrics(
        cv.paper_kinds.to_dict(), percent_keys=["repair_ratio", "inducing_ratio", "improvement"])
    html.section("Per fold").table([{"fold": i + 1, **c.to_dict()} for i, c in enumerate(cv.folds)])
    if result.clean is not None:
        clean = result.clean
        html.section(f"Clean test data ({clean.data})").metrics(
            {"original_accuracy": clean.original_accuracy, "compressed_accuracy": clean.compressed_accuracy,
             "repaired_accuracy": clean.repaired_accuracy, **{f"deviations_{k}": v for k, v in
                                                              clean.deviations.to_dict().items()}},
            percent_keys=["original_accuracy", "compressed_accuracy", "repaired_accuracy"])
    html.section("Training set").metrics(result.training_set)
    html.section("Head settings").code(json.dumps(result.settings.to_dict(), indent=2))
    html.paragraph("Repair ratio: share of deviating inputs whose repaired label is the original's. Inducing ratio: "
                   "share of agreeing inputs whose repaired label now differs from the original's. Improvement: "
                   "(deviations before - deviations after) / deviations before.")
    return html.render()


def _percent(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _print_summary(uri: str, result, form: str) -> None:
    cv = result.cross_validation.pooled
    click.echo(f"repaired model -> {uri} ({form})")
    click.echo(f"  {result.folds}-fold CV by seed on {result.training_set['seeds']} seeds: repair ratio "
               f"{_percent(cv.repair_ratio)} ({cv.repaired}/{cv.deviating}), inducing ratio "
               f"{_percent(cv.inducing_ratio)} ({cv.induced}/{cv.agreeing}), improvement {_percent(cv.improvement)}")
    clean = result.clean
    if clean is not None:
        click.echo(f"  clean accuracy on {clean.images} images: original {clean.original_accuracy:.2%}, compressed "
                   f"{clean.compressed_accuracy:.2%}, repaired {clean.repaired_accuracy:.2%}; deviations from the "
                   f"original {clean.deviations.deviating} -> {clean.deviations.deviations_after}")
