"""``mlflow-di gate``: pass or fail a registered model version on its recorded results.

Reads the newest coverage / fuzz / compress / robustness runs recorded for the version, applies the
thresholds (:mod:`mlflow_di.gate`), logs the decision as a ``gate`` run, and writes it on the
version: the verdict and the value of each check asked for, with its 95% interval and sample size,
as tags, the table of checks at the top of the description. A check PASSes or FAILs only when its
figure's whole interval is on one side of its threshold; otherwise it is INCONCLUSIVE, and so is the
verdict (``--inconclusive`` counts such checks as failed, passed or errors instead). The verdict is
PASS, FAIL, INCONCLUSIVE, or ERROR when a check had nothing to judge. ``--promote-alias`` moves to the
version only on PASS, and is removed from it otherwise (an earlier passing version keeps it). With
``--baseline`` the candidate is also compared with another version (relative thresholds);
``--junit-xml`` and ``--summary-md`` write the verdict for CI systems (also when it fails). Exit code
0 PASS, 1 FAIL, 2 ERROR or bad input (one line on stderr), 3 INCONCLUSIVE.
"""
from __future__ import annotations

import dataclasses
import datetime

import click

from mlflow_di.gate import INCONCLUSIVE_AS
from mlflow_di.commands.options import (AliasName, FiniteFloat, Fraction, NamedNumber, RealismBudget, RunIds,
                                        RuntimeName, WritablePath, json_out_option, stacked)
from mlflow_di.commands.output_files import write_json_out, write_text_out


def threshold_options(relative: bool):
    """One option per gate check's threshold (``relative``: the relations to a baseline), built from the
    check records of :mod:`mlflow_di.gate`: name, range and help."""
    from mlflow_di.gate import CHECKS, RELATIONS

    types = {"fraction": Fraction, "positive": lambda: FiniteFloat(0, min_open=True), "nonnegative": lambda: FiniteFloat(0)}
    return stacked([click.option(record.option, type=types[record.range](), default=None, help=record.help)
                    for record in (RELATIONS if relative else CHECKS).values()])


@click.command("gate")
@click.option("--model-uri", required=True, metavar="models:/NAME/VERSION",
              help="The registered version to check: models:/NAME/VERSION or models:/NAME@ALIAS. For an export "
                   "made by `compress`, coverage is read from its source version.")
@click.option("--compressed", "compressed", multiple=True, metavar="URI",
              help="A compressed model whose fuzz/compress results count (repeatable; as given to "
                   "`mlflow-di fuzz --compressed`). Default: every compressed model with recorded runs.")
@threshold_options(relative=False)
@click.option("--threshold", "extra_thresholds", multiple=True, type=NamedNumber(), metavar="NAME=VALUE",
              help="A threshold by its name (repeatable), e.g. min_idc=0.5: also a registered check's "
                   "(mlflow_di.gate.register_check).")
@click.option("--realism-budget", type=RealismBudget(), default=None, metavar="linf=32,ssim=0.9",
              help="The budget --max-realistic-success-rate judges (default linf=32,ssim=0.9: L-inf <= 32 levels, "
                   "SSIM >= 0.9 where measurable): only a campaign that searched inside one at least as strict counts.")
@click.option("--semantics", type=click.Choice(["host", "reference", "both"]), default="host", show_default=True,
              help="Which answers of an int8 export the compress checks judge: host (ONNX Runtime's kernels on the "
                   "CPU compress ran on), reference (the QDQ graph as written, the same on every CPU) or both.")
@click.option("--runtime", type=RuntimeName(), default=None,
              help="Judge the exports' answers on this runtime (NAME[:PRECISION], as compress and fuzz --runtime named "
                   "it): only campaigns run on it count, and compress's figures on it. Default: whatever runtime each "
                   "figure was measured on (each named in its evidence).")
@click.option("--allow-calibration-evidence", is_flag=True,
              help="Judge accuracy and disagreement figures that compress measured on its calibration data or a "
                   "training split (refused by default: they say how an export fits the images it was tuned on).")
@click.option("--exclude-export", multiple=True, metavar="models:/NAME/VERSION",
              help="An export of the model not to judge (repeatable). By default every export compressed from the "
                   "model, fuzzed or measured against it is judged, and one without evidence makes the verdict ERROR.")
@click.option("--baseline", default=None, metavar="models:/NAME@ALIAS",
              help="Compare with this registered version too (e.g. models:/NAME@champion), read the same way; "
                   "'previous': the candidate's predecessor (the highest version number of the same registered "
                   "model below the candidate's). Needs at least one of the relative thresholds below.")
@click.option("--baseline-optional", is_flag=True,
              help="When the --baseline alias is not set yet (the first version), or the candidate has no previous "
                   "version, pass the relative checks as 'no baseline' instead of stopping with an error.")
@threshold_options(relative=True)
@click.option("--inconclusive", type=click.Choice(INCONCLUSIVE_AS), default="inconclusive",
              show_default=True,
              help="How a check counts whose 95% interval holds its threshold (the evidence cannot decide it): "
                   "inconclusive (the verdict is INCONCLUSIVE, exit code 3, the alias does not move), fail, pass "
                   "or error.")
@click.option("--runs", "pinned_runs", type=RunIds(), default=None,
              help="Judge only these runs' results (comma-separated ids; a pipeline passes its own step runs). "
                   "Default: the newest recorded run of each kind; the report names the runs it took.")
@click.option("--promote-alias", type=AliasName(), default=None,
              help="On pass, point this alias of the registered model at the version; on FAIL or ERROR, take it off "
                   "this version (an earlier version that holds it keeps it).")
@json_out_option
@click.option("--junit-xml", type=WritablePath("file"), default=None,
              help="Also write the checks as a JUnit XML report (one test case per check), also on fail.")
@click.option("--summary-md", type=WritablePath("file"), default=None,
              help="Also write a Markdown summary (e.g. to append to $GITHUB_STEP_SUMMARY), also on fail.")
def command(model_uri: str, compressed: tuple[str, ...], baseline: str | None, baseline_optional: bool,
            pinned_runs: tuple[str, ...] | None, promote_alias: str | None, json_out: str | None, junit_xml: str | None,
            summary_md: str | None, semantics: str = "host", allow_calibration_evidence: bool = False,
            exclude_export: tuple[str, ...] = (), extra_thresholds: tuple = (), realism_budget=None,
            inconclusive: str = "inconclusive", runtime=None, **thresholds) -> None:
    """Pass or fail a registered model version on its recorded coverage, fuzzing, compression and robustness results.

    Exit code 0 when every check passes, 1 when one fails, 2 on an error, 3 when the evidence cannot decide
    a check (its interval holds the threshold).
    """
    from mlflow_di.errors import UserError
    from mlflow_di.gate import Thresholds, decide
    from mlflow_di.mlflow_edge import gate_evidence
    from mlflow_di.mlflow_edge.version_lock import version_lock

    thresholds = Thresholds(**{**thresholds, **dict(extra_thresholds)}).require_any()
    baseline = baseline or None  # MLproject passes "" for unset
    thresholds.require_baseline(baseline is not None)
    if baseline and baseline.strip() == model_uri.strip():
        raise UserError(f"--baseline {baseline} is the candidate itself (--model-uri); compare with another version")
    baseline_version = (gate_evidence.baseline_version(baseline, baseline_optional, candidate_uri=model_uri)
                        if baseline else None)  # its errors first
    version, source = gate_evidence.gate_subject(model_uri)
    with gate_evidence.only_runs(pinned_runs):
        found = gate_evidence.measurements(model_uri, list(compressed), resolved=(version, source), semantics=semantics,
                                           allow_calibration_evidence=allow_calibration_evidence,
                                           exclude=tuple(exclude_export), realism_budget=realism_budget, runtime=runtime)
    compared = gate_evidence.baseline(baseline, baseline_version, version) if baseline else None
    verdict = decide(model_uri, thresholds, found, compared, inconclusive_as=inconclusive)
    with version_lock(version.name, version.version, "gate", wait_s=LOCK_WAIT_S):  # one gate's record, whole
        written = _write_verdict(verdict, version, source, model_uri=model_uri, baseline=baseline,
                                 compressed=compressed, promote_alias=promote_alias,
                                 rules=_evidence_notes(verdict, pinned_runs, realism_budget, runtime))
    # what a pipeline calling this command logs on its own run (see commands/pipeline.py)
    click.get_current_context().meta["mlflow_di.gate"] = {
        "run_id": written.run_id, "outcome": verdict.outcome, "metrics": written.metrics, "report": written.report,
        "inconclusive": [{"metric": c.metric, "label": c.label, "n": c.n} for c in verdict.inconclusive]}
    write_json_out({**verdict.to_dict(), "outcome": verdict.outcome, "checked_at": written.checked_at,
                    "run_id": written.run_id}, json_out)
    _write_ci_reports(verdict, written.checked_at, written.run_id, junit_xml=junit_xml, summary_md=summary_md,
                      notes=written.notes, run_link=written.run_link)
    _print_verdict(verdict, version, source, promote_alias=promote_alias, run_id=written.run_id,
                   alias_dropped=written.alias_dropped, rules=written.rules)
    if verdict.outcome == "ERROR":
        raise UserError(f"the gate could not judge {model_uri}: {verdict.cause}")
    if verdict.exit_code:
        click.get_current_context().exit(verdict.exit_code)


#: what a pipeline calling the gate puts in the click context: its run id (the evidence are its step runs)
PIPELINE_RUN = "mlflow_di.pipeline_run"
#: seconds a gate waits for another one writing the same version's verdict (gates take seconds)
LOCK_WAIT_S = 120.0


@dataclasses.dataclass(frozen=True)
class _Written:
    """What one gate wrote: its run, when, the notes and metrics it logged, the report, how runs are linked."""

    run_id: str
    checked_at: str
    notes: tuple
    rules: tuple
    metrics: dict
    report: str
    run_link: object
    alias_dropped: bool


def _write_verdict(verdict, version, source, model_uri: str, baseline, compressed, promote_alias, rules) -> _Written:
    """The gate run, the version's tags, alias and description: every write of one verdict (under its lock)."""
    from mlflow_di.mlflow_edge import gate_evidence, registry, runs
    from mlflow_di.mlflow_edge.version_lock import record_holder_run
    from mlflow_di.reporting.ci import summary_markdown

    checked_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    tags = {"mlflow_di.command": "gate", **registry.version_tags(version, model_uri), "mlflow_di.verdict": verdict.outcome}
    with runs.tracked_run(f"gate {version.name}/{version.version}", tags=tags) as log:
        record_holder_run(log.run_id)  # a gate killed from here on: whoever takes its lock over ends this run
        registry.begin_verdict(version, log.run_id)  # the first write: refused without EDIT, before anything else
        try:
            # the alias first: of all the writes it is the one a user with EDIT may still be refused (removing
            # an alias asks for MANAGE), and nothing else of the new verdict is written yet
            alias_dropped = False
            if promote_alias and verdict.passed:
                registry.set_alias(version, promote_alias)
            elif promote_alias:
                alias_dropped = registry.drop_alias_from(version, promote_alias)
            notes = (*_notes(verdict, version, source, baseline, promote_alias, alias_dropped), *rules,
                     *gate_evidence.runtime_notes(c.run_id for c in verdict.checks))
            metrics, report = _log_verdict(log, verdict, compressed, promote_alias, notes)
            judged = [log.run_id, *(r for c in verdict.checks for r in (c.run_id, c.baseline_run_id))]
            run_link = _run_link(judged)  # for CI summaries, read off the UI: absolute links
            registry.write_verdict_description(version, summary_markdown(
                verdict, _run_link(judged, relative=True), log.run_id,
                (f"checked {checked_at}; the report is gate/report.html of the gate run", *notes)))
            version_tags = registry.gate_tags(verdict, checked_at, log.run_id)
            if source is not None:
                version_tags["mlflow_di.gate_source"] = registry.version_uri(source)
            outcome = version_tags.pop(registry.VERDICT)
            registry.write_version_tags(version, version_tags)
            registry.remove_version_tags(version, registry.stale_gate_tags(version, version_tags))
            registry.commit_verdict(version, outcome)  # the last write
        except BaseException as exc:
            registry.abandon_verdict(version, log.run_id, _why_stopped(exc))
            raise
    return _Written(log.run_id, checked_at, notes, rules=rules, metrics=metrics, report=report, run_link=run_link,
                    alias_dropped=alias_dropped)


def _why_stopped(exc: BaseException) -> str:
    """What stopped a verdict's writes, in the words the version's ERROR tag keeps."""
    from mlflow_di.errors import Terminated

    if isinstance(exc, Terminated):
        return "it was terminated (SIGTERM)"
    if isinstance(exc, KeyboardInterrupt):
        return "it was interrupted (Ctrl-C)"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _run_link(run_ids, relative: bool = False):
    """How Markdown names a run: a link to its page in the MLflow UI where there is one (``relative``: a
    ``#/experiments/...`` link, which works in the UI on any host), else its id."""
    from mlflow_di.mlflow_edge import runs

    links = runs.run_links(run_ids, relative)
    return lambda run_id: f"[`{run_id[:8]}`]({links[run_id]})" if run_id in links else f"`{run_id}`"


def _notes(verdict, version, source, baseline: str | None, promote_alias: str | None,
           alias_dropped: bool = False) -> tuple[str, ...]:
    from mlflow_di.mlflow_edge import registry

    notes = [f"{registry.version_uri(version)}" + (f", an export of {registry.version_uri(source)}" if source else "")]
    if baseline and verdict.baseline_uri is None:
        what = "the version has no previous one" if baseline.strip() == "previous" else f"{baseline} is not set"
        notes.append(f"no baseline yet: {what} (relative checks passed as 'no baseline')")
    elif baseline and baseline != verdict.baseline_uri:
        notes.append(f"--baseline {baseline} is {verdict.baseline_uri}")
    if promote_alias:
        notes.append(f"alias '{promote_alias}' " + ("moved to this version" if verdict.passed else
                                                     "removed from this version" if alias_dropped else "not moved")
                     + (" (the alias moves only on PASS)" if verdict.outcome == "INCONCLUSIVE" else ""))
    if verdict.inconclusive:
        notes.append("INCONCLUSIVE: a check's 95% interval holds its threshold, so its evidence can neither pass nor "
                     "fail it; more images or seeds (as each check says) would decide")
    return (*notes, *_unjudged_slowness(verdict))


def _unjudged_slowness(verdict) -> list[str]:
    """A note per export measurably slower than its source (its speedup's whole interval below 1) when no speed
    check was asked: the verdict says nothing about speed, and must not let that pass unsaid."""
    if verdict.thresholds.min_speedup is not None:
        return []
    return [f"{m.compressed} is measurably slower than its source on its compress run's host (speedup {m.value:.2f}x, "
            f"95% CI {m.interval[0]:.2f}-{m.interval[1]:.2f}); no --min-speedup was asked, so speed was not judged"
            for m in verdict.measurements if m.metric == "speedup" and m.found and m.interval and m.interval[1] < 1]


def _evidence_notes(verdict, pinned_runs, realism_budget, runtime=None) -> tuple[str, ...]:
    """Which rule chose the runs behind the figures, the runtime whose answers were judged, and the budget realistic
    deviations were judged in."""
    from mlflow_di.fuzz.realism import DEFAULT_BUDGET
    from mlflow_di.gate import RULE

    pipeline = click.get_current_context().meta.get(PIPELINE_RUN)
    given = (f"the step runs of pipeline run {pipeline} ({len(pinned_runs or ())})" if pipeline else
             f"the runs given with --runs ({len(pinned_runs or ())})")
    notes = [f"evidence: {given}" if pinned_runs else
             f"evidence: for each check, {RULE}; search-split and calibration figures are never judged"]
    if runtime is not None:
        notes.append(f"the exports' answers judged as {runtime.label} computes them: only campaigns run on it and "
                     "compress figures measured on it count")
    if any(c.metric == "realistic_success_rate" for c in verdict.checks):
        budget = (realism_budget or DEFAULT_BUDGET).describe()
        notes.append(f"realistic deviations judged inside {budget}, only from campaigns that searched inside a "
                     "budget at least as strict")
    return tuple(notes)


def _write_ci_reports(verdict, checked_at: str, run_id: str, junit_xml: str | None, summary_md: str | None,
                      notes: tuple[str, ...], run_link) -> None:
    """--junit-xml and --summary-md (each written atomically)."""
    from mlflow_di.reporting.ci import junit_xml as render_junit, summary_markdown

    if junit_xml:
        write_text_out(render_junit(verdict, run_id, checked_at), junit_xml)
    if summary_md:
        write_text_out(summary_markdown(verdict, run_link, run_id, notes), summary_md)


def _log_verdict(log, verdict, compressed, promote_alias: str | None, notes: tuple[str, ...]) -> tuple[dict, str]:
    from mlflow_di.gate import CHECKS, RELATIONS

    params = {name: value for name, value in verdict.thresholds.to_dict().items() if value is not None}
    params["compressed"] = ",".join(compressed) or "all recorded"
    if verdict.baseline_uri:
        params["baseline"] = verdict.baseline_uri
    if promote_alias:
        params["promote_alias"] = promote_alias
    log.params(params)
    metrics = {"passed": float(verdict.passed), "checks": len(verdict.checks),
               "failed_checks": sum(c.outcome == "FAIL" for c in verdict.checks),
               "inconclusive_checks": len(verdict.inconclusive)}
    for metric in CHECKS:
        value = verdict.worst(metric)
        if value is not None and value != float("inf"):
            metrics[metric] = value
    for relation in RELATIONS:
        check = verdict.worst_change(relation)
        if check is not None and abs(check.change) != float("inf"):
            metrics[relation] = check.change
    log.metrics(metrics)
    log.json({**verdict.to_dict(), "outcome": verdict.outcome}, "gate/verdict.json")
    report = _report(verdict, notes)
    log.text(report, "gate/report.html")
    return metrics, report


def _report(verdict, notes: tuple[str, ...]) -> str:
    """The verdict as a self-contained page for the MLflow UI's artifact view."""
    from mlflow_di.reporting import HtmlReport

    html = HtmlReport(f"Quality gate: {verdict.model_uri}")
    error = verdict.outcome in ("ERROR", "INCONCLUSIVE")
    html.verdict(None if error else verdict.passed, verdict.summary(), word=verdict.outcome if error else None)
    if error:
        html.paragraph(f"Could not judge: {verdict.cause}")
    html.section("Checks").table([{"check": row[0], "measured": row[1], **_baseline_cells(verdict, row),
                                   "95% interval (n)": row[-3], "threshold": row[-2], "result": row[-1],
                                   "evidence": (check.evidence.describe() if check.evidence else "")
                                   or check.run_id or "-"}
                                  for row, check in zip(_rows(verdict), verdict.checks)])
    for message in dict.fromkeys(c.message for c in verdict.checks if c.message):  # as the console lists them
        html.paragraph(message)
    for note in notes:  # the version, its baseline, what happened to the alias: as the summaries say them
        html.paragraph(note)
    return html.render()


def _print_verdict(verdict, version, source, promote_alias: str | None, run_id: str, alias_dropped: bool,
                   rules: tuple[str, ...] = ()) -> None:
    from mlflow_di.mlflow_edge import registry

    _echo(f"gate for {verdict.model_uri} ({version.name} version {version.version})")
    if source is not None:
        _echo(f"  an export of {registry.version_uri(source)}: coverage is that model's, fuzzing and "
                   f"compression compare the two")
    if verdict.baseline_uri:
        _echo(f"  compared with the baseline {verdict.baseline_uri}")
    header = _header(verdict)
    rows = [header, *_rows(verdict)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        _echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for message in dict.fromkeys(c.message for c in verdict.checks if c.message):  # once each, in order
        _echo(f"  - {message}")
    for evidence, labels in _evidence_groups(verdict).items():
        _echo(f"  evidence for {', '.join(labels)}: {evidence}")
    for rule in rules:
        _echo(f"  {rule}")
    for note in _unjudged_slowness(verdict):
        _echo(f"  note: {note}")
    _echo(f"verdict: {verdict.outcome} ({verdict.summary().split(': ', 1)[1]})")
    if promote_alias:
        if verdict.passed:
            _echo(f"alias '{promote_alias}' now points to {registry.version_uri(version)}")
        else:
            _echo(f"alias '{promote_alias}' " + ("removed from this version" if alias_dropped else "not moved"))
    _echo(f"verdict, tags and description written on {registry.version_uri(version)}; gate run {run_id}")


def _echo(line: str) -> None:
    """A console line of the verdict: registry names in it are shown, their control characters never obeyed."""
    from mlflow_di.printable import printable

    click.echo(printable(line))


def _evidence_groups(verdict) -> dict[str, list[str]]:
    """{what a figure rests on (one line): the checks it is behind}, in the order of the checks."""
    groups: dict[str, list[str]] = {}
    for check in verdict.checks:
        if check.evidence is not None and check.evidence.run_id:
            groups.setdefault(check.evidence.describe(), []).append(check.label)
    return groups


def _header(verdict) -> tuple[str, ...]:
    relative = any(c.relation for c in verdict.checks)
    return ("check", "measured", *(("baseline", "change") if relative else ()), "95% interval (n)", "threshold",
            "result")


def _rows(verdict) -> list[tuple[str, ...]]:
    """The table of checks: label, measured, (baseline, change when a check is relative), the interval of what
    the threshold applies to with its sample size, threshold, result."""
    from mlflow_di.reporting.ci import interval_text, result_text, threshold_text, value_text

    relative = any(c.relation for c in verdict.checks)
    rows = []
    for c in verdict.checks:
        compared = ()
        if relative:
            compared = ((value_text(c.baseline) if c.baseline_model else "-"),
                        (value_text(c.change) if c.change is not None else "-")) if c.relation else ("-", "-")
        rows.append((c.label, value_text(c.measured), *compared, interval_text(c), threshold_text(c),
                     result_text(c, verdict.inconclusive_as)))
    return rows


def _baseline_cells(verdict, row) -> dict:
    return dict(zip(("baseline", "change"), row[2:4])) if len(row) == 7 else {}
