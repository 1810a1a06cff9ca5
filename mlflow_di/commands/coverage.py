"""``mlflow-di coverage``: IDC and the classic criteria of a model on test data, logged to MLflow.

Fits once on the training data (importance analysis, clustering, criteria statistics), logs the
fitted coverage model straight away (so a later failure never loses it), then scores each test
set in turn, accumulating: ``--test-data orig --test-data augmented`` reports the coverage of
the original set and of both together.
"""
from __future__ import annotations

import tempfile

import click
import mlflow
import numpy as np

from mlflow_di import report as rp
from mlflow_di import tracking
from mlflow_di.commands.options import json_out_option, preprocessing_option, seed_option
from mlflow_di.data import ImageSet, load_images
from mlflow_di.errors import UserError
from mlflow_di.coverage.suite import ALL_CRITERIA, CoverageResult, CoverageSuite, growth_curve, parse_criteria
from mlflow_di.models.loading import load_torch_model
from mlflow_di.registry import model_version_tags

HEATMAP_INPUTS = 8


def parse_clusters(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"--clusters must be integers separated by commas, e.g. 2,3,4 (got '{text}')") from None
    if not values or min(values) < 1:
        raise UserError(f"--clusters must be positive integers, e.g. 2,3,4 (got '{text}')")
    return values


def parse_layers(layer: str | None, layers: str | None):
    if layer and layers:
        raise UserError("give either --layer NAME or --layers all|NAME,NAME, not both")
    if layers:
        return "all" if layers.strip() == "all" else [n.strip() for n in layers.split(",") if n.strip()]
    return [layer] if layer else None


@click.command("coverage")
@click.option("--model-uri", required=True, help="PyTorch model: models:/NAME/VERSION, runs:/..., a .pt file, keras:ARCH:FILE.")
@click.option("--train-data", required=True, help="Data spec for the importance analysis, e.g. mnist:DIR[0:5000].")
@click.option("--test-data", required=True, multiple=True,
              help="Data spec of the test set; repeat to accumulate (original, then augmented sets).")
@click.option("--layer", default=None, help="Subject layer for IDC (default: the last hidden layer before the logits).")
@click.option("--layers", default=None, metavar="all|NAME,NAME", help="IDC for several layers ('all': every hidden layer).")
@click.option("--top-m", type=click.IntRange(1), default=6, show_default=True, help="Number of important neurons.")
@click.option("--clusters", default="2,3,4", show_default=True, help="Candidate cluster counts per neuron.")
@click.option("--rule", default="epsilon", show_default=True, help="LRP rule: epsilon, z, zplus, alpha1beta0.")
@click.option("--criteria", default=",".join(ALL_CRITERIA), show_default=True, help="Criteria to measure.")
@click.option("--all-inputs", is_flag=True, help="Analyse all training inputs, not only those the model classifies correctly.")
@click.option("--reference-quirks", is_flag=True,
              help="Cluster as DeepImportance's code does (drop zeros, round centroids) instead of as the paper says.")
@seed_option
@json_out_option
@preprocessing_option
def command(model_uri, train_data, test_data, layer, layers, top_m, clusters, rule, criteria, all_inputs,
            reference_quirks, seed, json_out, preprocessing) -> None:
    """Measure how well test data covers MODEL-URI's important neurons (IDC) and the classic criteria."""
    criteria = parse_criteria(criteria)
    suite = CoverageSuite(criteria, layers=parse_layers(layer, layers), top_m=top_m, clusters=parse_clusters(clusters),
                          rule=rule, only_correct=not all_inputs, seed=seed, reference_quirks=reference_quirks)
    model = load_torch_model(model_uri, preprocessing)
    train = load_images(train_data)
    tests = [load_images(spec) for spec in test_data]
    for data in (train, *tests):  # fail before any run starts when the data does not fit the model
        model.preprocessing.check_images(data.images[:1])
    tags = {"mlflow_di.command": "coverage", **model_version_tags(model_uri)}
    with tracking.tracked_run("coverage", tags=tags):
        tracking.log_params({"model_uri": model_uri, "train_data": train_data, "test_data": " + ".join(test_data),
                           "layers": layers or layer or "default", "top_m": top_m, "clusters": clusters, "rule": rule,
                           "criteria": ",".join(criteria), "only_correct": not all_inputs,
                           "reference_quirks": reference_quirks, "seed": seed})
        click.echo(f"fitting on {train.name} ({len(train)} images) ...")
        suite.fit(model, train)
        _log_fitted(suite)
        results = _score_all(suite, model, tests)
        final = results[-1]
        mlflow.log_metrics(final.metrics())
        summary = dict(final.summary(), sets=[r.summary() for r in results])
        mlflow.log_dict(summary, "coverage/summary.json")
        _log_review_artifacts(suite, model, tests[0], results)
    tracking.write_json(summary, json_out)
    _print_summary(final)


def _score_all(suite: CoverageSuite, model, tests: list[ImageSet]) -> list[CoverageResult]:
    results: list[CoverageResult] = []
    for test in tests:
        click.echo(f"scoring {test.name} ({len(test)} images) ...")
        results.append(suite.score(test, accumulate=results[-1] if results else None))
    return results


def _log_fitted(suite: CoverageSuite) -> None:
    with tempfile.TemporaryDirectory(prefix="mlflow-di-coverage-") as folder:
        suite.save(folder)
        mlflow.log_artifacts(folder, "coverage/model")
    rows = suite.important_neurons_table()
    if rows:
        mlflow.log_table({key: [row[key] for row in rows] for key in rows[0]}, "coverage/important_neurons.json")


def _log_review_artifacts(suite: CoverageSuite, model, test: ImageSet, results: list[CoverageResult]) -> None:
    """PNGs and tables the MLflow UI previews, and one self-contained HTML report with all of it."""
    final = results[-1]
    html = rp.HtmlReport(f"Coverage of {model.name}", subtitle=f"test data: {final.data}")
    html.verdict(None, _headline(final))
    html.section("Metrics").metrics(final.metrics(), percent_keys=[k for k in final.metrics()
                                                                   if k not in ("idc_covered", "idc_total")])
    if final.primary is not None:
        curves = {r.data: growth_curve(r.idc[final.primary]) for r in results}
        growth = rp.coverage_growth_plot(curves, title=f"IDC growth over the test inputs (layer {final.primary})")
        mlflow.log_image(growth, "coverage/idc_growth.png")
        html.section("IDC growth").image(growth, "covered combinations after each test input")
        if len(final.idc) > 1:
            per_layer = rp.bar_plot({layer: r.idc for layer, r in final.idc.items()}, "IDC per layer")
            mlflow.log_image(per_layer, "coverage/idc_per_layer.png")
            html.image(per_layer, "IDC per layer")
        html.section("Important neurons").table(suite.important_neurons_table())
        heatmaps = _heatmaps(suite, model, test)
        mlflow.log_image(heatmaps, "coverage/relevance_heatmaps.png")
        html.section("Relevance heatmaps").image(heatmaps, "input-pixel LRP relevance (red: for, blue: against the decision)")
    if final.criteria is not None:
        bars = rp.bar_plot(final.criteria.coverage, "Classic coverage criteria")
        mlflow.log_image(bars, "coverage/criteria.png")
        html.section("Classic criteria").image(bars, "fractions of each criterion's cells covered")
        _log_surprise(final)
    mlflow.log_text(html.render(), "coverage/report.html")


def _headline(result: CoverageResult) -> str:
    if result.primary is None:
        return ", ".join(f"{k.upper()} {v:.1%}" for k, v in result.metrics().items())
    main = result.idc[result.primary]
    return f"IDC {main.idc:.1%}: {main.covered} of {main.total} combinations of layer {main.layer}'s important neurons covered"


def _heatmaps(suite: CoverageSuite, model, test: ImageSet) -> np.ndarray:
    from mlflow_di.coverage.relevance import input_relevance

    images = test.images[:HEATMAP_INPUTS]
    rule = suite.rule
    relevance = input_relevance(model.module, model.to_tensor(images), rule=rule, progress=False)
    predicted = model.classifier().predict(images)
    return rp.relevance_heatmaps(images, relevance, labels=predicted)


def _log_surprise(result: CoverageResult) -> None:
    report = result.criteria
    columns = {"input": list(range(report.num_inputs))}
    for name, values in (("lsa", report.lsa), ("dsa", report.dsa)):
        if values is not None:
            columns[name] = [None if not np.isfinite(v) else float(v) for v in values]
    if len(columns) > 1:
        mlflow.log_table(columns, "coverage/surprise.json")


def _print_summary(result: CoverageResult) -> None:
    click.echo(f"coverage of {result.data}:")
    if result.primary is not None:
        for layer, report in result.idc.items():
            click.echo(f"  IDC {layer:<14} {report.idc:7.2%}  ({report.covered}/{report.total} combinations, "
                       f"neurons {list(report.important_neurons)}, clusters {list(report.clusters_per_neuron)})")
    if result.criteria is not None:
        for name, value in result.criteria.coverage.items():
            click.echo(f"  {name.upper():<18} {value:7.2%}")
