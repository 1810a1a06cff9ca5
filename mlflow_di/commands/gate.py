"""``mlflow-di gate``: pass or fail a registered model version on its recorded results.

Reads the newest coverage / fuzz / compress / robustness runs recorded for the version, applies the
thresholds (:mod:`mlflow_di.gate`), logs the decision as a ``gate`` run, writes it and every
measured value as model-version tags, and moves ``--promote-alias`` to the version only when
every check passed. Exit code 0 pass, 1 fail, 2 error.
"""
from __future__ import annotations

import datetime

import click

from mlflow_di.commands.options import Fraction, json_out_option, write_json_out


@click.command("gate")
@click.option("--model-uri", required=True, metavar="models:/NAME/VERSION",
              help="The registered version to check: models:/NAME/VERSION or models:/NAME@ALIAS. For an export "
                   "made by `compress`, coverage is read from its source version.")
@click.option("--compressed", "compressed", multiple=True, metavar="URI",
              help="A compressed model whose fuzz/compress results count (repeatable; as given to "
                   "`mlflow-di fuzz --compressed`). Default: every compressed model with recorded runs.")
@click.option("--min-idc", type=Fraction(), default=None, help="Fail if IDC (0..1) of the newest coverage run is lower.")
@click.option("--max-success-rate", type=Fraction(), default=None,
              help="Fail if the fuzzing success rate (0..1) against a compressed model is higher.")
@click.option("--min-mean-queries", type=click.FloatRange(0), default=None,
              help="Fail if fuzzing needed fewer queries per deviating input on average.")
@click.option("--max-accuracy-drop", type=click.FloatRange(-1, 1), default=None,
              help="Fail if compression lost more accuracy (source - compressed, 0..1).")
@click.option("--max-class-accuracy-drop", type=click.FloatRange(-1, 1), default=None,
              help="Fail if compression lost more accuracy on any one class (largest per-class drop, 0..1).")
@click.option("--min-robustness-agreement", type=Fraction(), default=None,
              help="Fail if a compressed model agrees with the original (top-1) on fewer images (0..1) than this "
                   "in the worst corruption and severity of the newest robustness run.")
@click.option("--promote-alias", default=None, metavar="ALIAS",
              help="On pass, point this alias of the registered model at the version (never touched on fail).")
@json_out_option
def command(model_uri: str, compressed: tuple[str, ...], min_idc, max_success_rate, min_mean_queries,
            max_accuracy_drop, max_class_accuracy_drop, min_robustness_agreement, promote_alias: str | None,
            json_out: str | None) -> None:
    """Pass or fail a registered model version on its recorded coverage, fuzzing, compression and robustness results.

    Exit code 0 when every check passes, 1 when one fails, 2 on an error.
    """
    from mlflow_di.gate import Thresholds, decide
    from mlflow_di.mlflow_edge import recorded, registry, runs

    thresholds = Thresholds(min_idc, max_success_rate, min_mean_queries, max_accuracy_drop,
                            max_class_accuracy_drop, min_robustness_agreement).require_any()
    version, source = recorded.gate_subject(model_uri)
    found = recorded.measurements(model_uri, list(compressed), resolved=(version, source))
    verdict = decide(model_uri, thresholds, found)
    checked_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tags = {"mlflow_di.command": "gate", **registry.version_tags(version, model_uri),
            "mlflow_di.gate": "pass" if verdict.passed else "fail"}
    with runs.tracked_run(f"gate {version.name}/{version.version}", tags=tags) as log:
        _log_verdict(log, verdict, compressed, promote_alias)
        version_tags = registry.gate_tags(verdict, checked_at, log.run_id)
        if source is not None:
            version_tags["mlflow_di.gate_source"] = registry.version_uri(source)
        registry.write_version_tags(version, version_tags)
        if verdict.passed and promote_alias:
            registry.set_alias(version, promote_alias)
    write_json_out({**verdict.to_dict(), "checked_at": checked_at, "run_id": log.run_id}, json_out)
    _print_verdict(verdict, version, source, promote_alias, log.run_id)
    if not verdict.passed:
        click.get_current_context().exit(1)


def _log_verdict(log, verdict, compressed, promote_alias: str | None) -> None:
    from mlflow_di.gate import CRITERION

    params = {name: value for name, value in verdict.thresholds.to_dict().items() if value is not None}
    params["compressed"] = ",".join(compressed) or "all recorded"
    if promote_alias:
        params["promote_alias"] = promote_alias
    log.params(params)
    metrics = {"passed": float(verdict.passed), "checks": len(verdict.checks), "failed_checks": len(verdict.failures)}
    for metric in CRITERION:
        value = verdict.worst(metric)
        if value is not None and value != float("inf"):
            metrics[metric] = value
    log.metrics(metrics)
    log.json(verdict.to_dict(), "gate/verdict.json")
    log.text(_report(verdict, promote_alias), "gate/report.html")


def _report(verdict, promote_alias: str | None) -> str:
    """The verdict as a self-contained page for the MLflow UI's artifact view."""
    from mlflow_di.reporting import HtmlReport

    html = HtmlReport(f"Quality gate: {verdict.model_uri}")
    html.verdict(verdict.passed, verdict.summary())
    html.section("Checks").table([{"check": c.label, "measured": _measured(c), "threshold": f"{c.comparison} {c.threshold:g}",
                                   "result": "PASS" if c.passed else "FAIL"} for c in verdict.checks])
    if promote_alias:
        html.paragraph(f"Alias '{promote_alias}' " + ("moved to this version." if verdict.passed else "left untouched."))
    return html.render()


def _print_verdict(verdict, version, source, promote_alias: str | None, run_id: str) -> None:
    from mlflow_di.mlflow_edge import registry

    click.echo(f"gate for {verdict.model_uri} ({version.name} version {version.version})")
    if source is not None:
        click.echo(f"  an export of {registry.version_uri(source)}: coverage is that model's, fuzzing and "
                   f"compression compare the two")
    rows = [(c.label, _measured(c), f"{c.comparison} {c.threshold:g}", "PASS" if c.passed else "FAIL")
            for c in verdict.checks]
    widths = [max(len(r[i]) for r in rows + [("check", "measured", "threshold", "result")]) for i in range(4)]
    for row in [("check", "measured", "threshold", "result")] + rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for message in dict.fromkeys(c.message for c in verdict.failures if c.message):  # once each, in order
        click.echo(f"  - {message}")
    result = "PASS" if verdict.passed else "FAIL"
    click.echo(f"verdict: {result} ({verdict.summary().split(': ', 1)[1]})")
    if promote_alias:
        if verdict.passed:
            click.echo(f"alias '{promote_alias}' now points to {registry.version_uri(version)}")
        else:
            click.echo(f"alias '{promote_alias}' not moved")
    click.echo(f"tags written on {registry.version_uri(version)}; gate run {run_id}")


def _measured(check) -> str:
    if check.measured is None:
        return "missing"
    if check.measured == float("inf"):
        return "inf (no deviation found)"
    return f"{check.measured:.4g}"
