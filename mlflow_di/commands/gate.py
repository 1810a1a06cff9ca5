"""``mlflow-di gate``: pass or fail a registered model version on its recorded results.

Reads the newest coverage / fuzz / compress runs recorded for the version, applies the
thresholds (:mod:`mlflow_di.gate`), logs the decision as a ``gate`` run, writes it and every
measured value as model-version tags, and moves ``--promote-alias`` to the version only when
every check passed. Exit code 0 pass, 1 fail, 2 error.
"""
from __future__ import annotations

import datetime

import click
import mlflow

from mlflow_di import registry, tracking
from mlflow_di.commands.options import json_out_option
from mlflow_di.gate import CRITERION, Thresholds, Verdict, decide


@click.command("gate")
@click.option("--model-uri", required=True, metavar="models:/NAME/VERSION",
              help="The registered version to check: models:/NAME/VERSION or models:/NAME@ALIAS.")
@click.option("--compressed", "compressed", multiple=True, metavar="URI",
              help="A compressed model whose fuzz/compress results count (repeatable; as given to "
                   "`mlflow-di fuzz --compressed`). Default: every compressed model with recorded runs.")
@click.option("--min-idc", type=float, default=None, help="Fail if IDC (0..1) of the newest coverage run is lower.")
@click.option("--max-success-rate", type=float, default=None,
              help="Fail if the fuzzing success rate (0..1) against a compressed model is higher.")
@click.option("--min-mean-queries", type=float, default=None,
              help="Fail if fuzzing needed fewer queries per deviating input on average.")
@click.option("--max-accuracy-drop", type=float, default=None,
              help="Fail if compression lost more accuracy (source - compressed, 0..1).")
@click.option("--promote-alias", default=None, metavar="ALIAS",
              help="On pass, point this alias of the registered model at the version (never touched on fail).")
@json_out_option
def command(model_uri: str, compressed: tuple[str, ...], min_idc, max_success_rate, min_mean_queries,
            max_accuracy_drop, promote_alias: str | None, json_out: str | None) -> None:
    """Pass or fail a registered model version on its recorded coverage, fuzzing and compression results.

    Exit code 0 when every check passes, 1 when one fails, 2 on an error.
    """
    thresholds = Thresholds(min_idc, max_success_rate, min_mean_queries, max_accuracy_drop).require_any()
    version = registry.resolve_version(model_uri)
    found = registry.measurements(model_uri, list(compressed))
    verdict = decide(model_uri, thresholds, found)
    checked_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with tracking.tracked_run("gate", tags={"mlflow_di.command": "gate", **registry.version_tags(version, model_uri),
                                            "mlflow_di.gate": "pass" if verdict.passed else "fail"}) as run:
        _log_verdict(verdict, compressed, promote_alias)
        registry.write_version_tags(version, registry.gate_tags(verdict, checked_at, run.info.run_id))
        if verdict.passed and promote_alias:
            registry.set_alias(version, promote_alias)
    tracking.write_json({**verdict.to_dict(), "checked_at": checked_at, "run_id": run.info.run_id}, json_out)
    _print_verdict(verdict, version, promote_alias, run.info.run_id)
    if not verdict.passed:
        click.get_current_context().exit(1)


def _log_verdict(verdict: Verdict, compressed, promote_alias: str | None) -> None:
    params = {name: value for name, value in verdict.thresholds.to_dict().items() if value is not None}
    params["compressed"] = ",".join(compressed) or "all recorded"
    if promote_alias:
        params["promote_alias"] = promote_alias
    tracking.log_params(params)
    metrics = {"passed": float(verdict.passed), "checks": len(verdict.checks), "failed_checks": len(verdict.failures)}
    for metric in CRITERION:
        value = verdict.worst(metric)
        if value is not None and value != float("inf"):
            metrics[metric] = value
    mlflow.log_metrics(metrics)
    mlflow.log_dict(verdict.to_dict(), "gate/verdict.json")
    mlflow.log_text(_report(verdict, promote_alias), "gate/report.html")


def _report(verdict: Verdict, promote_alias: str | None) -> str:
    """The verdict as a self-contained page for the MLflow UI's artifact view."""
    from mlflow_di.report import HtmlReport

    html = HtmlReport(f"Quality gate: {verdict.model_uri}")
    html.verdict(verdict.passed, verdict.summary())
    html.section("Checks").table([{"check": c.label, "measured": _measured(c), "threshold": f"{c.comparison} {c.threshold:g}",
                                   "result": "PASS" if c.passed else "FAIL"} for c in verdict.checks])
    if promote_alias:
        html.paragraph(f"Alias '{promote_alias}' " + ("moved to this version." if verdict.passed else "left untouched."))
    return html.render()


def _print_verdict(verdict: Verdict, version, promote_alias: str | None, run_id: str) -> None:
    click.echo(f"gate for {verdict.model_uri} ({version.name} version {version.version})")
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
