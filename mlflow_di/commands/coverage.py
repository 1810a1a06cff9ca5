"""``mlflow-di coverage``: IDC and the classic criteria of a model on test data, logged to MLflow.

Fits once on the training data (importance analysis, clustering, criteria statistics), logs the
fitted coverage model straight away (so a later failure never loses it), then scores each test
set in turn, accumulating: ``--test-data orig --test-data augmented`` reports the coverage of
the original set and of both together. ``--per-class`` adds IDC fitted and scored for each class
on its own (on all test sets together), to show which classes the test data exercises least.
``--workers N`` runs the passes over the images on a pool of Ray actors (``coverage/distributed.py``)
and merges their partial results here: the numbers are those of ``--workers 0``.
"""
from __future__ import annotations

import contextlib
import tempfile
import typing

import click

from mlflow_di.commands.options import (RAY_OPTIONS, ClusterCounts, CommaList, LayerNames, LazyChoice, SectionedCommand,
                                        SettingAssignment, WritablePath, batch_size_option, device_option,
                                        json_out_option, preprocessing_option, ray_options, seed_option)
from mlflow_di.commands.output_files import write_json_out

HEATMAP_INPUTS = 8
#: ``--idc-resamples`` by default (mlflow_di.coverage.idc.RESAMPLES, kept here so that --help imports no torch)
IDC_RESAMPLES = 50


@click.command("coverage", cls=SectionedCommand, sections=(
    ("Ray options (--workers N)", lambda param: param.name in RAY_OPTIONS + ("trace_dir",)),))
@click.option("--model-uri", required=True, help="PyTorch model: models:/NAME/VERSION, runs:/..., a .pt file, keras:ARCH:FILE.")
@click.option("--train-data", required=True, help="Data spec for the importance analysis, e.g. mnist-train:DIR[0:5000].")
@click.option("--test-data", required=True, multiple=True,
              help="Data spec of the test set; repeat to accumulate (original, then augmented sets).")
@click.option("--layer", default=None, help="Subject layer for IDC (default: the last hidden layer before the logits).")
@click.option("--layers", type=LayerNames(), default=None, help="IDC for several layers ('all': every hidden layer).")
@click.option("--top-m", type=click.IntRange(1), default=6, show_default=True, help="Number of important neurons.")
@click.option("--clusters", type=ClusterCounts(), default="2,3,4", show_default=True,
              help="Candidate cluster counts per neuron (each at least 2).")
@click.option("--rule", type=LazyChoice("mlflow_di.coverage.relevance:RULES", "rule", in_help=False),
              default="epsilon", show_default=True, help="LRP rule (epsilon, z, zplus or alpha1beta0).")
@click.option("--criteria", type=CommaList("mlflow_di.coverage.suite:KNOWN_CRITERIA", "criteria", "CRITERION"),
              default=None, help="Criteria to measure (default: IDC and every classic criterion).")
@click.option("--criterion-setting", "criterion_settings", multiple=True, metavar="FIELD=VALUE",
              type=SettingAssignment("mlflow_di.coverage.criteria:criterion_settings", "criterion setting"),
              help="A criterion's own setting, e.g. kmnc_sections=100 (repeat for several); its declaration gives the "
                   "range and default.")
@click.option("--all-inputs", is_flag=True, help="Analyse all training inputs, not only those the model classifies correctly.")
@click.option("--reference-quirks", is_flag=True,
              help="Cluster as DeepImportance's code does (drop zeros, round centroids) instead of as the paper says.")
@click.option("--idc-resamples", type=click.IntRange(0), default=IDC_RESAMPLES, show_default=True,
              help="Bootstrap resamples of the training data IDC's importance and clusters are refitted on, for the "
                   "95% interval of reachable IDC (what the gate judges); 0: none, and the gate cannot decide "
                   "--min-idc. Each costs one clustering of the important neurons.")
@click.option("--per-class", type=click.BOOL, is_flag=False, flag_value=True, default=False, metavar="[true|false]",
              help="Also fit and score IDC for each class on its own (inputs filtered by label) and point out "
                   "the least covered classes; alone it means true.")
@seed_option
@json_out_option
@preprocessing_option
@device_option
@batch_size_option
@ray_options("the passes over the images: each loads the model and the data once and computes whole batches")
@click.option("--trace-dir", type=WritablePath("dir"), default=None,
              help="With --workers: folder for the workers' Parquet trace files (per-input rows the driver reads "
                   "back); on a cluster of several machines, one every node shares (default: a temporary folder).")
def command(model_uri, train_data, test_data, layer, layers, top_m, clusters, rule, criteria, criterion_settings, all_inputs,
            reference_quirks, per_class, seed, json_out, preprocessing, device, batch_size, workers, ray_address,
            cpus_per_worker, gpus_per_worker, trace_dir, idc_resamples: int = IDC_RESAMPLES) -> None:
    """Measure how well test data covers MODEL-URI's important neurons (IDC) and the classic criteria."""
    from mlflow_di.coverage.suite import ALL_CRITERIA, CoverageSuite, parse_criteria
    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import datasets, registry, runs
    from mlflow_di.models.device import describe_device, out_of_memory_as_user_error
    from mlflow_di.models.loading import load_torch_model
    from mlflow_di.models.reference import ModelRef

    if layer and layers:
        raise UserError("give either --layer NAME or --layers all|NAME,NAME, not both")
    criteria = criteria or ALL_CRITERIA
    if per_class and "idc" not in criteria:
        raise UserError("--per-class needs idc among --criteria; add idc to --criteria or leave out --per-class")
    passes = _passes(workers, ray_address, cpus_per_worker, gpus=gpus_per_worker, trace_dir=trace_dir, per_class=per_class,
                     specs=[train_data, *test_data])
    ref = ModelRef.parse(model_uri)
    model = load_torch_model(ref, preprocessing, device)
    subject_layers = layers or ([layer] if layer else None)
    if "idc" in criteria:
        check_layers(model, subject_layers, top_m)
    suite = CoverageSuite(criteria, layers=subject_layers, top_m=top_m, clusters=clusters, rule=rule,
                          only_correct=not all_inputs, seed=seed, reference_quirks=reference_quirks,
                          criterion_settings=dict(criterion_settings) or None, batch_size=batch_size,
                          resamples=idc_resamples)
    raw_train, raw_tests, train, tests = _data(model, train_data, test_data)
    tags = {"mlflow_di.command": "coverage", **registry.model_version_tags(model_uri)}
    model_id = registry.logged_model_id(model_uri)
    with runs.tracked_run(f"coverage {ref.short}", tags=tags) as log:
        lineage = [datasets.spec_dataset(raw) for raw in (raw_train, *raw_tests)]
        log.inputs(zip(lineage, ["training"] + ["test"] * len(raw_tests)))
        log.params({"model_uri": model_uri, "train_data": train_data, "test_data": " + ".join(test_data),
                    "layers": _layers_param(layers, layer), "top_m": top_m, "clusters": ",".join(map(str, clusters)),
                    "rule": rule, "criteria": ",".join(parse_criteria(criteria)), "only_correct": not all_inputs,
                    "reference_quirks": reference_quirks, "per_class": per_class, "seed": seed,
                    "idc_resamples": idc_resamples,
                    "device": describe_device(model.device), "batch_size": batch_size,
                    "workers": workers, **({"ray_address": ray_address} if workers else {}),
                    **{f"criterion_setting.{field}": value for field, value in criterion_settings}})
        where = (f"on {workers} Ray worker{'s' if workers > 1 else ''} ({ray_address})" if workers
                 else f"on {describe_device(model.device)}")
        click.echo(f"fitting on {train.name} ({len(train)} images) {where} ...")
        with out_of_memory_as_user_error("coverage", batch_size), (passes or contextlib.nullcontext()):
            suite.fit(model, train, passes=passes)
            _log_fitted(log, suite)
            results = _score_all(suite, tests, passes)
            by_class = _per_class_idc(suite, model, train, tests) if per_class else None
        final = results[-1]
        _log_metrics(log, final, by_class, model_id, lineage[-1], passes)
        _log_growth(log, results)
        summary = dict(final.summary(), sets=[r.summary() for r in results])
        if by_class is not None:
            summary.update(by_class.metrics(), per_class=by_class.to_dict())
        log.json(summary, "coverage/summary.json")
        _log_review_artifacts(log, suite, model, tests[0], results, by_class)
    write_json_out(summary, json_out)
    _print_summary(final, by_class)


def _log_metrics(log, final, by_class, model_id, dataset, passes) -> None:
    """The run's metrics: the last test set's coverage (and per-class IDC), linked to the model and the data, and
    the Ray passes' figures (``ray.batches``, ``ray.batches_on_restarted_workers``; none for ``--workers 0``) with a
    line when a worker was lost."""
    log.metrics({**final.metrics(), **(by_class.metrics() if by_class else {})}, model_id=model_id, dataset=dataset)
    if passes is None:
        return
    stats = passes.stats
    batches = sum(one["batches"] for one in stats)
    again = sum(one["batches_on_restarted_workers"] for one in stats)
    log.metrics({"ray.batches": batches, "ray.batches_on_restarted_workers": again})
    if again:
        click.echo(f"a Ray worker was lost and restarted: {again} of {batches} batches ran on a restarted worker "
                   "(the results are the same)")


#: Most points of the ``idc_growth`` step metric (a long test set is sampled evenly, its last input kept).
GROWTH_POINTS = 200


def _data(model, train_data: str, test_data: list[str]) -> tuple:
    """(raw training set, raw test sets, and both prepared as the model's raw-image step says), checked
    against the model before any run starts."""
    from mlflow_di.data import load_images

    raw_train, raw_tests = load_images(train_data), [load_images(spec) for spec in test_data]
    train = model.preprocessing.prepare(raw_train)  # lazy: resized per batch if the model says so
    tests = [model.preprocessing.prepare(raw) for raw in raw_tests]
    for data in (train, *tests):  # fail before any run starts when the data does not fit the model
        model.preprocessing.check_images(data.images[:1])
        data.check_labels(model.classifier().num_classes)
    return raw_train, raw_tests, train, tests


def _log_growth(log, results: list) -> None:
    """IDC of the subject layer after each test input as the step metric ``idc_growth`` (step: inputs seen,
    over the test sets in order: each set's curve counts the sets before it)."""
    import numpy as np

    from mlflow_di.coverage.suite import growth_curve

    primary = results[-1].primary
    if primary is None:
        return
    curve = np.concatenate([growth_curve(result.idc[primary]) for result in results])
    if not len(curve):
        return
    steps = np.unique(np.linspace(1, len(curve), min(GROWTH_POINTS, len(curve))).round().astype(int))
    log.metric_series("idc_growth", {int(step): float(curve[step - 1]) for step in steps})


def _layers_param(layers, layer) -> str:
    if isinstance(layers, (list, tuple)):
        return ",".join(layers)
    return layers or layer or "default"


class ModelOnData(typing.NamedTuple):
    """What ``inspect`` and ``generate`` start from: the model, the coverage run they read (``latest``
    resolved to its id, or None), and the data as the spec loads it (``raw``) and as the model takes it."""

    ref: object
    coverage: str | None
    model: object
    raw: object
    data: object


def model_on_data(model_uri: str, coverage: str | None, data_spec: str, preprocessing, device) -> ModelOnData:
    """Load ``model_uri`` on ``device``, resolve its coverage run, and load and prepare ``data_spec`` for it
    (checked against the model's input on its first image)."""
    from mlflow_di.data import load_images
    from mlflow_di.mlflow_edge.run_artifacts import latest_coverage
    from mlflow_di.models.loading import load_torch_model
    from mlflow_di.models.reference import ModelRef

    ref = ModelRef.parse(model_uri)
    coverage = latest_coverage(coverage, model_uri)
    model = load_torch_model(ref, preprocessing, device)
    raw = load_images(data_spec)
    data = model.preprocessing.prepare(raw)
    model.preprocessing.check_images(data.images[:1])
    return ModelOnData(ref, coverage, model, raw, data)


def check_layers(model, layers, top_m: int) -> None:
    """Fail before any run starts when a named layer is not in the model or ``top_m`` exceeds its neurons."""
    from mlflow_di.coverage.activations import default_layer
    from mlflow_di.errors import UserError

    if layers == "all":
        return  # every hidden layer; a narrower one uses all its neurons
    infos = {info.name: info for info in model.describe_layers()}
    for name in layers or [default_layer(model.module)]:
        if name not in infos:
            raise UserError(f"layer '{name}' is not in {model.name}; its layers: {', '.join(n for n in infos if n)} "
                            f"(see `mlflow-di describe`)")
        if infos[name].neurons and top_m > infos[name].neurons:
            raise UserError(f"--top-m {top_m} exceeds the {infos[name].neurons} neurons of layer '{name}'; "
                            f"give --top-m {infos[name].neurons} or less")


def _passes(workers: int, address: str, cpus: float, gpus: float, trace_dir, per_class: bool, specs: list):
    """None (the passes in this process) for ``--workers 0``, else the Ray pool; what it cannot do is one line."""
    if not workers:
        return None
    import importlib.util

    from mlflow_di.errors import UserError

    if per_class:
        raise UserError("--per-class runs in this process; drop --per-class with --workers, or use --workers 0")
    if importlib.util.find_spec("ray") is None:
        raise UserError("--workers needs Ray: pip install 'mlflow-di[ray]' (or run with --workers 0)")
    from mlflow_di.coverage.distributed import RayPasses

    return RayPasses(workers=workers, address=address, cpus_per_worker=cpus, gpus_per_worker=gpus, specs=specs,
                     trace_dir=trace_dir)


def _score_all(suite, tests, passes=None) -> list:
    if passes is not None:  # every test set in one pass: one pool of workers for all of them
        click.echo(f"scoring {' + '.join(f'{t.name} ({len(t)} images)' for t in tests)} ...")
        return suite.score_all(tests, passes=passes)
    results = []
    for test in tests:
        click.echo(f"scoring {test.name} ({len(test)} images) ...")
        results.append(suite.score(test, accumulate=results[-1] if results else None))
    return results


def _per_class_idc(suite, model, train, tests):
    """IDC of each class on its own, with the suite's subject layer and settings, on all test sets together."""
    from sklearn.base import clone

    from mlflow_di.coverage.per_class import PerClassCoverage
    from mlflow_di.data import ImageSet

    top_m = suite.idc_.fitted_layers_[suite.primary_].top_m  # below --top-m where --layers all meets a narrow layer
    estimator = PerClassCoverage(clone(suite.idc_).set_params(layers=suite.primary_, top_m=top_m))
    click.echo(f"fitting IDC per class on {train.name} ...")
    estimator.fit(model, train)
    return estimator.score(ImageSet.concatenate(tests))


def _log_fitted(log, suite) -> None:
    with tempfile.TemporaryDirectory(prefix="mlflow-di-coverage-") as folder:
        suite.save(folder)
        log.folder(folder, "coverage/model")
    log.table(suite.important_neurons_table(), "coverage/important_neurons.json")


def _log_review_artifacts(log, suite, model, test, results: list, by_class=None) -> None:
    """PNGs and tables the MLflow UI previews, and one self-contained HTML report with all of it."""
    from mlflow_di import reporting as rp
    from mlflow_di.coverage.suite import growth_curve

    final = results[-1]
    html = rp.HtmlReport(f"Coverage of {model.name}", subtitle=f"test data: {final.data}")
    html.verdict(None, _headline(final))
    counts = ("idc_covered", "idc_total", "idc_reachable_covered", "idc_reachable_total", "idc_reachable_n")
    html.section("Metrics").metrics(final.metrics(), percent_keys=[k for k in final.metrics() if k not in counts])
    if final.primary is not None and final.idc[final.primary].reachable:
        html.paragraph("The paper's IDC counts every combination of the important neurons' clusters, most of which "
                       "no input realises, and their number moves with the clustering between trainings of one model. "
                       "Reachable IDC counts only the combinations the training data realise: it is the figure the "
                       "gate judges (--min-idc), with its 95% interval from refitting importance and clusters on "
                       "resamples of the training data.")
    if final.primary is not None:
        curves = {r.data: growth_curve(r.idc[final.primary]) for r in results}
        growth = rp.coverage_growth_plot(curves, title=f"IDC growth over the test inputs (layer {final.primary})")
        log.image(growth, "coverage/idc_growth.png")
        html.section("IDC growth").image(growth, "covered combinations after each test input")
        if len(final.idc) > 1:
            per_layer = rp.bar_plot({layer: r.idc for layer, r in final.idc.items()}, "IDC per layer")
            log.image(per_layer, "coverage/idc_per_layer.png")
            html.image(per_layer, "IDC per layer")
        if by_class is not None:
            _report_per_class(log, html, by_class)
        html.section("Important neurons").table(suite.important_neurons_table())
        heatmaps = _heatmaps(suite, model, test)
        log.image(heatmaps, "coverage/relevance_heatmaps.png")
        html.section("Relevance heatmaps").image(heatmaps, "input-pixel LRP relevance (red: for, blue: against the decision)")
    if final.criteria is not None:
        bars = rp.bar_plot(final.criteria.coverage, "Classic coverage criteria")
        log.image(bars, "coverage/criteria.png")
        html.section("Classic criteria").image(bars, "fractions of each criterion's cells covered")
        _log_surprise(log, final)
    log.text(html.render(), "coverage/report.html")


def _report_per_class(log, html, result) -> None:
    """The per-class table (an MLflow table too), its bar plot and which classes are least covered."""
    import math

    from mlflow_di import reporting as rp

    log.table(result.table(), "coverage/idc_per_class.json")
    html.section("IDC per class").paragraph(_per_class_line(result))
    if result.scored:
        values = {f"class {c.label}": c.idc if c.scored else math.nan for c in result.classes}
        plot = rp.bar_plot(values, f"IDC per class (layer {result.layer}, top-{result.top_m})",
                           reference=result.mean_idc, reference_label="mean")
        log.image(plot, "coverage/idc_per_class.png")
        html.image(plot, "each class's IDC, fitted on its analysis inputs and scored on its test inputs "
                         "(n/a: skipped)")
    html.table(result.table(), percent_columns=["idc"])


def _per_class_line(result) -> str:
    """One sentence: the mean over the scored classes, the least covered ones, how many were skipped."""
    if not result.scored:
        return f"No class could be scored ({len(result.skipped)} skipped; see the reasons below)."
    least = ", ".join(f"class {c.label} ({c.idc:.1%})" for c in result.least_covered())
    skipped = f"; {len(result.skipped)} skipped (see the table)" if result.skipped else ""
    return (f"Mean IDC {result.mean_idc:.1%} over {len(result.scored)} classes; least covered: {least}"
            f"{skipped}. The test data exercises the decision logic of the least covered classes least.")


def _headline(result) -> str:
    if result.primary is None:
        return ", ".join(f"{k.upper()} {v:.1%}" for k, v in result.metrics().items())
    main = result.idc[result.primary]
    text = f"IDC {main.idc:.1%}: {main.covered} of {main.total} combinations of layer {main.layer}'s important neurons covered"
    return text + (f"; {reachable_line(main, result.n_analysis)}" if main.reachable else "")


def reachable_line(report, n_analysis: int) -> str:
    """Reachable IDC (what the gate judges) with its interval, and the training data's own figure, in one phrase."""
    spread = report.reachable_interval(n_analysis)
    interval = (f" (95% CI {spread.low:.1%}-{spread.high:.1%} over {len(report.resampled_covered)} resamples of the "
                f"{n_analysis} analysis inputs)" if spread is not None else " (no interval: --idc-resamples 0)")
    return (f"reachable IDC {report.idc_reachable:.1%}{interval}: {report.covered_reachable} of the {report.reachable} "
            f"combinations the training data realise (the training data itself reaches {report.analysis_idc:.1%} of "
            f"all {report.total})")


def _heatmaps(suite, model, test):
    from mlflow_di import reporting as rp
    from mlflow_di.coverage.relevance import input_relevance

    images = test.images[:HEATMAP_INPUTS]
    rule = suite.rule
    relevance = input_relevance(model.module, model.to_tensor(images), rule=rule, progress=False)
    predicted = model.classifier().predict(images)
    return rp.relevance_heatmaps(images, relevance, labels=predicted)


def _log_surprise(log, result) -> None:
    import numpy as np

    report = result.criteria
    series = {name: values for name, values in (("lsa", report.lsa), ("dsa", report.dsa)) if values is not None}
    if series:
        log.table([{"input": i, **{name: float(v[i]) if np.isfinite(v[i]) else None for name, v in series.items()}}
                   for i in range(report.num_inputs)], "coverage/surprise.json")


def _print_summary(result, by_class=None) -> None:
    click.echo(f"coverage of {result.data}:")
    if result.primary is not None:
        for layer, report in result.idc.items():
            click.echo(f"  IDC {layer:<14} {report.idc:7.2%}  ({report.covered}/{report.total} combinations, "
                       f"neurons {list(report.important_neurons)}, clusters {list(report.clusters_per_neuron)})")
            if report.reachable and layer == result.primary:
                click.echo(f"    {reachable_line(report, result.n_analysis)}")
    if result.criteria is not None:
        for name, value in result.criteria.coverage.items():
            click.echo(f"  {name.upper():<18} {value:7.2%}")
    if by_class is not None:
        click.echo(f"  IDC per class (layer {by_class.layer}): {_per_class_line(by_class)}")
