"""``mlflow-di robustness``: a model and its compressed versions under severity-graded corruptions.

Each image, clean and under every chosen corruption (albumentations, see
:mod:`mlflow_di.robustness.corruptions`) at every chosen severity, goes through the original and
each compressed model. The run records, per corruption and severity, the original's accuracy and
each compressed model's accuracy and agreement with the original (equal top-1 labels), as
metrics, a table, heatmaps, an example grid and an HTML report. The gate reads
``robustness_agreement_min.<slug>`` (the worst cell's agreement) for ``--min-robustness-agreement``.
"""
from __future__ import annotations

import json
import re

import click

from mlflow_di.commands.options import (CommaList, Severities, device_option, json_out_option, preprocessing_option,
                                        seed_option)
from mlflow_di.commands.output_files import write_json_out

#: Run tag mapping each compressed model's gate key (models:/NAME/VERSION or its URI) to its metric slug.
COMPRESSED_TAG = "mlflow_di.robustness_compressed"


@click.command("robustness")
@click.option("--model-uri", required=True, help="The original model (any backend: models:/..., .onnx, .pt, keras:...).")
@click.option("--compressed", "compressed", multiple=True, metavar="URI",
              help="A compressed version to compare with the original (repeatable; any backend).")
@click.option("--data", required=True, help="Data spec of the labelled images, e.g. mnist-test:DIR[0:1000].")
@click.option("--corruptions", type=CommaList("mlflow_di.robustness.corruptions:CORRUPTIONS", "corruption", "NAME",
                                              extra=("all",)),
              default="all", show_default=True, help="Corruptions to apply, comma-separated (all: the whole catalogue).")
@click.option("--severities", type=Severities(), default="1,2,3,4,5", show_default=True,
              help="Severities to apply, 1 (mild) to 5 (strong).")
@click.option("--num-images", type=click.IntRange(1), default=1000, show_default=True, help="Use the first N images.")
@click.option("--batch", type=click.IntRange(1), default=256, show_default=True,
              help="Images corrupted and classified at a time (results do not depend on it).")
@seed_option
@json_out_option
@preprocessing_option
@device_option
def command(model_uri, compressed, data, corruptions, severities, num_images, batch, seed, json_out, preprocessing,
            device) -> None:
    """Accuracy of MODEL-URI and agreement of each COMPRESSED model with it under image corruptions."""
    from mlflow_di.data import load_images
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import datasets, registry, runs
    from mlflow_di.models.device import out_of_memory_as_user_error
    from mlflow_di.models.execution import context_tags
    from mlflow_di.models.loading import load_classifier
    from mlflow_di.models.reference import ModelRef
    from mlflow_di.robustness import CORRUPTIONS, run_suite

    names = tuple(CORRUPTIONS) if "all" in corruptions else corruptions
    compressed = tuple(uri for uri in compressed if uri.strip())  # MLproject passes "" when none is given
    if len(set(compressed)) != len(compressed):
        raise UserError("a --compressed model is named twice; give each once")
    refs = [ModelRef.parse(uri) for uri in (model_uri, *compressed)]
    models = [load_classifier(ref, preprocessing if number == 0 else None, device) for number, ref in enumerate(refs)]
    raw = load_images(data)
    images = models[0].preprocessing.prepare(raw)  # lazy: resized per batch if the model says so
    images = images.subset(slice(0, num_images), f"{images.name} (first {min(num_images, len(images))})")
    for role, model in zip(["original", *compressed], models):
        try:  # fail before any run starts when the images do not fit a model
            model.preprocessing.check_images(images.images[:1])
        except UserError as exc:
            raise UserError(f"{role} model: {exc}") from None
    images.check_labels(models[0].num_classes)
    slugs = metric_slugs([ref.short for ref in refs[1:]])
    keys = {registry.compressed_key(uri): slug for uri, slug in zip(compressed, slugs)}
    tags = {"mlflow_di.command": "robustness", **registry.model_version_tags(model_uri),
            COMPRESSED_TAG: json.dumps(keys, sort_keys=True)}
    if len(compressed) == 1:  # found by the same tags as a fuzz run of the pair
        tags.update(registry.compressed_model_tags(compressed[0]))
    run_name = f"robustness {refs[0].short}" + (f" vs {', '.join(r.short for r in refs[1:])}" if compressed else "")
    with runs.tracked_run(run_name, tags=tags) as log:
        log.tags(context_tags(models[1:]))  # where the compressed models' answers were computed
        log.params({"model_uri": model_uri, "compressed": ",".join(compressed) or "none", "data": data,
                    "num_images": len(images), "corruptions": ",".join(names),
                    "severities": ",".join(map(str, severities)), "seed": seed, "batch": batch,
                    "original_runs_on": models[0].provider})
        log.input(datasets.spec_dataset(raw.subset(slice(0, num_images)), data, first=num_images), "evaluation")
        click.echo(f"robustness on {images.name}: {len(names)} corruptions x {len(severities)} severities, "
                   f"{len(images)} images, {len(models)} model(s)")
        with out_of_memory_as_user_error("the robustness suite", batch):
            result = run_suite(models[0], models[1:], images, names, severities, seed=seed, batch=batch)
        summary = _summary(result, model_uri, compressed, slugs)
        log.metrics(_metrics(result, slugs))
        _log_artifacts(log, result, model_uri, compressed=compressed, slugs=slugs, images=images, summary=summary)
        _print_summary(result, compressed)
    write_json_out(summary, json_out)


def metric_slugs(names: list[str]) -> list[str]:
    """MLflow-legal, distinct metric name parts for the compressed models (never ``original``)."""
    slugs: list[str] = []
    for name in names:
        base = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")[:60] or "compressed"
        slug, number = base, 2
        while slug in slugs or slug == "original":
            slug, number = f"{base}_{number}", number + 1
        slugs.append(slug)
    return slugs


def _metrics(result, slugs: list[str]) -> dict:
    """Headline metrics, then one per cell: ``accuracy.MODEL.CORRUPTION.SEVERITY`` and
    ``agreement.SLUG.CORRUPTION.SEVERITY`` (MODEL: ``original`` or a compressed model's slug)."""
    metrics = {"robustness_clean_accuracy": result.clean_accuracy, "robustness_accuracy_mean": result.accuracy_mean,
               "images": result.images}
    if result.summary:
        metrics["robustness_agreement_mean"] = sum(s.agreement_mean for s in result.summary) / len(result.summary)
        metrics["robustness_agreement_min"] = min(s.agreement_min for s in result.summary)
    for slug, s in zip(slugs, result.summary):
        metrics.update({f"robustness_clean_accuracy.{slug}": s.clean_accuracy,
                        f"robustness_clean_agreement.{slug}": s.clean_agreement,
                        f"robustness_accuracy_mean.{slug}": s.accuracy_mean,
                        f"robustness_agreement_mean.{slug}": s.agreement_mean,
                        f"robustness_agreement_min.{slug}": s.agreement_min,
                        f"robustness_agreement_min.{slug}_low": s.agreement_min_low,
                        f"robustness_agreement_min.{slug}_high": s.agreement_min_high,
                        f"robustness_agreement_min.{slug}_n": result.images})
    for cell in result.cells:
        where = f"{cell.corruption}.{cell.severity}"
        metrics[f"accuracy.original.{where}"] = cell.accuracy
        for slug, accuracy, agreement in zip(slugs, cell.compressed_accuracy, cell.agreement):
            metrics[f"accuracy.{slug}.{where}"] = accuracy
            metrics[f"agreement.{slug}.{where}"] = agreement
    return metrics


def _summary(result, model_uri: str, compressed, slugs: list[str]) -> dict:
    return {"model_uri": model_uri, "data": result.data, "images": result.images,
            "corruptions": result.corruptions, "severities": result.severities,
            "clean_accuracy": result.clean_accuracy, "accuracy_mean": result.accuracy_mean,
            "compressed": [{"uri": uri, "slug": slug, **s.to_dict()}
                           for uri, slug, s in zip(compressed, slugs, result.summary)]}


def _rows(result, slugs: list[str]) -> list[dict]:
    rows = []
    for cell in [None, *result.cells]:
        row = {"corruption": "clean" if cell is None else cell.corruption, "severity": 0 if cell is None else cell.severity,
               "original_accuracy": round(result.clean_accuracy if cell is None else cell.accuracy, 4)}
        accuracies = result.clean_compressed_accuracy if cell is None else cell.compressed_accuracy
        agreements = result.clean_agreement if cell is None else cell.agreement
        for slug, accuracy, agreement in zip(slugs, accuracies, agreements):
            row[f"{slug}_accuracy"] = round(accuracy, 4)
            row[f"{slug}_agreement"] = round(agreement, 4)
        rows.append(row)
    return rows


def _log_artifacts(log, result, model_uri: str, compressed, slugs: list[str], images, summary: dict) -> None:
    """Result JSON, per-cell table, heatmaps, an example grid and the HTML report."""
    from mlflow_di import reporting as rp
    from mlflow_di.robustness import example_rows
    from mlflow_di.robustness.corruptions import describe

    log.json(result.to_dict(), "robustness/result.json")
    rows = _rows(result, slugs)
    log.table(rows, "robustness/cells.json")
    severities = [str(s) for s in result.severities]
    html = rp.HtmlReport(f"Robustness: {model_uri}" + (f" vs {', '.join(compressed)}" if compressed else ""),
                         subtitle=f"{len(result.corruptions)} corruptions x {len(severities)} severities on "
                                  f"{result.data}, seed {result.seed}")
    html.verdict(None, _headline(result, compressed))
    html.section("Summary").metrics({"clean accuracy (original)": result.clean_accuracy,
                                     "mean accuracy under corruption (original)": result.accuracy_mean},
                                    percent_keys=["clean accuracy (original)",
                                                  "mean accuracy under corruption (original)"])
    if summary["compressed"]:
        html.table([{"compressed": c["uri"], "clean_agreement": c["clean_agreement"], "agreement_mean": c["agreement_mean"],
                     "agreement_min": c["agreement_min"], "worst cell": f"{c['worst_corruption']} {c['worst_severity']}",
                     "clean_accuracy": c["clean_accuracy"], "accuracy_mean": c["accuracy_mean"]}
                    for c in summary["compressed"]],
                   percent_columns=["clean_agreement", "agreement_mean", "agreement_min", "clean_accuracy",
                                    "accuracy_mean"])
    html.section("Heatmaps")
    for slug, uri, k in zip(slugs, compressed, range(len(compressed))):
        picture = rp.heatmap(result.grid("agreement", k), result.corruptions, severities,
                             f"agreement with the original: {uri}", symmetric=False, colorbar_label="agreement",
                             annotate=".1%")
        log.image(picture, f"robustness/agreement_{slug}.png")
        html.image(picture, f"{uri}: share of images with the original's top-1 label, per corruption and severity")
    picture = rp.heatmap(result.grid("accuracy"), result.corruptions, severities, f"accuracy: {model_uri}",
                         symmetric=False, colorbar_label="accuracy", annotate=".1%")
    log.image(picture, "robustness/accuracy_original.png")
    html.image(picture, "the original's accuracy per corruption and severity")
    grid = rp.labelled_image_rows(example_rows(images.images[0], result.corruptions, result.severities, result.seed),
                                  result.corruptions)
    log.image(grid, "robustness/examples.png")
    html.section("Examples").image(grid, "the first image clean, then at each severity " + ", ".join(severities))
    html.section("Per corruption and severity").table(rows)
    html.section("Corruptions").table(describe(result.corruptions, result.severities, images.image_shape))
    log.text(html.render(), "robustness/report.html")


def _headline(result, compressed) -> str:
    text = f"original: clean accuracy {result.clean_accuracy:.1%}, {result.accuracy_mean:.1%} on average under corruption"
    for uri, s in zip(compressed, result.summary):
        text += (f"; {uri}: agreement {s.clean_agreement:.1%} clean, {s.agreement_mean:.1%} mean, worst "
                 f"{s.agreement_min:.1%} ({s.worst_corruption} {s.worst_severity})")
    return text


def _print_summary(result, compressed) -> None:
    click.echo(f"original: clean accuracy {result.clean_accuracy:.2%}, mean under corruption {result.accuracy_mean:.2%}")
    for uri, s in zip(compressed, result.summary):
        click.echo(f"{uri}: agreement clean {s.clean_agreement:.2%}, mean {s.agreement_mean:.2%}, worst "
                   f"{s.agreement_min:.2%} ({s.worst_corruption} severity {s.worst_severity}); accuracy clean "
                   f"{s.clean_accuracy:.2%}, mean under corruption {s.accuracy_mean:.2%}")
