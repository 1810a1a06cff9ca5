"""The gate's verdict for CI systems: a JUnit XML report and a Markdown summary.

Pure renderers (a :class:`mlflow_di.gate.Verdict` in, text out); ``mlflow-di gate --junit-xml``
and ``--summary-md`` write them. JUnit: one ``testsuite`` named ``mlflow-di gate``, one
``testcase`` per check (``classname`` the criterion, e.g. ``success_rate`` or ``idc_drop``;
``name`` the check's label with the compressed model), a failed, inconclusive or missing check as a
``failure`` (``type`` threshold, inconclusive or missing) whose message reads ``value X (95% CI L-H (n))
vs threshold Y``. Markdown (for ``$GITHUB_STEP_SUMMARY``): a heading with the verdict (PASS, FAIL,
INCONCLUSIVE or ERROR), a table of the checks with their intervals, the runs the values came from and
the data they were measured on.

Names come from users (a registered model may be called ``x"><img src=x onerror=...>``), so
every piece of text is escaped for where it lands: Markdown punctuation and HTML are
backslash-escaped in prose, names sit in code spans whose fence is longer than any backtick run
in them, and the XML holds no character XML 1.0 forbids (CI parsers reject the whole report).
"""
from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from typing import Callable

from mlflow_di.printable import printable

SUITE = "mlflow-di gate"


def value_text(value: float | None) -> str:
    """A measured value or change as the gate prints it (``missing``; ``inf`` for no deviation found)."""
    if value is None:
        return "missing"
    if math.isinf(value):
        return "inf (no deviation found)" if value > 0 else "-inf"
    return f"{value:.4g}"


def threshold_text(check) -> str:
    return f"{check.comparison} {check.threshold:g}"


def interval_text(check) -> str:
    """A check's 95% interval and sample size, e.g. ``0.0033-0.023 (497)``; ``exact`` for a figure measured
    without sampling, ``-`` when nothing was measured."""
    if check.interval is None:
        if check.compared is None or check.outcome == "MISSING":
            return "-"
        return "none recorded" if check.outcome == "INCONCLUSIVE" else "exact"
    low, high = check.interval
    return f"{value_text(low)}-{value_text(high)}" + (f" ({check.n})" if check.n else "")


def result_text(check, inconclusive_as: str = "inconclusive") -> str:
    """PASS, FAIL, INCONCLUSIVE (with how it counts when the gate counts it otherwise) or MISSING."""
    if check.outcome == "INCONCLUSIVE" and inconclusive_as != "inconclusive":
        return f"INCONCLUSIVE (counts as {inconclusive_as})"
    return check.outcome


def details(check) -> str:
    """One line: candidate, baseline and change of a check, the runs they came from, and its message."""
    evidence = check.evidence.describe() if check.evidence else ""
    spread = check.spread_text()
    parts = [f"{'candidate ' if check.relation else ''}value {value_text(check.measured)}"
             + (f" ({evidence})" if evidence else f" (run {check.run_id})" if check.run_id else "")]
    if spread:
        parts.append(f"{'change ' if check.relation else ''}{spread}"
                     + (f" ({check.interval_method})" if check.interval_method else ""))
    if check.relation and check.baseline_model:
        parts.append(f"baseline {value_text(check.baseline)} from {check.baseline_model}"
                     + (f" (run {check.baseline_run_id})" if check.baseline_run_id else ""))
        parts.append(f"{check.relation} {value_text(check.change)}")
    if check.message:
        parts.append(check.message)
    return "; ".join(parts)


def junit_xml(verdict, gate_run_id: str | None = None, checked_at: str | None = None) -> str:
    """The verdict as JUnit XML: ``<testsuites>`` holding the one suite ``mlflow-di gate``."""
    tests, failures = str(len(verdict.checks)), str(len(verdict.failures))
    root = ET.Element("testsuites", name="mlflow-di", tests=tests, failures=failures, errors="0")
    suite = ET.SubElement(root, "testsuite", name=SUITE, tests=tests, failures=failures, errors="0", skipped="0")
    if checked_at:
        suite.set("timestamp", checked_at)
    properties = ET.SubElement(suite, "properties")
    for name, value in (("model_uri", verdict.model_uri), ("baseline", verdict.baseline_uri),
                        ("gate_run_id", gate_run_id), ("summary", verdict.summary())):
        if value:
            ET.SubElement(properties, "property", name=name, value=value)
    for check in verdict.checks:
        case = ET.SubElement(suite, "testcase", classname=check.criterion, name=check.label)
        if check.passed:
            ET.SubElement(case, "system-out").text = (f"{check.outcome}: " if check.outcome != "PASS" else "") + \
                details(check)
            continue
        kind = {"MISSING": "missing", "INCONCLUSIVE": "inconclusive"}.get(check.outcome, "threshold")
        spread = f" ({check.spread_text()})" if check.interval is not None else ""
        failure = ET.SubElement(case, "failure", type=kind, message=(
            f"{'INCONCLUSIVE: ' if kind == 'inconclusive' else ''}value {value_text(check.compared)}{spread} vs "
            f"threshold {threshold_text(check)}"))
        failure.text = details(check)
    ET.indent(root)
    text = ET.tostring(root, encoding="unicode")  # escapes & < > " itself
    return '<?xml version="1.0" encoding="utf-8"?>\n' + _NOT_XML.sub("\ufffd", text) + "\n"


#: Characters XML 1.0 does not allow anywhere (control characters but tab and newlines, lone surrogates).
_NOT_XML = re.compile("[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
#: Markdown (CommonMark/GFM) punctuation that can start markup: backslash-escaped, as both GFM and the MLflow
#: UI's renderer (showdown) honour for these. HTML's < > & become entities instead: showdown keeps a backslash
#: before < or & literally, so "SSIM \>= 0.9" showed its backslash on a version's page.
_MARKUP = re.compile(r"([\\`*_\[\]|!~#])")
_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}


def _prose(text) -> str:
    """``text`` as literal Markdown prose: markup characters escaped, control characters shown, one line."""
    text = re.sub(r"[<>&]", lambda match: _ENTITIES[match.group(0)], printable(" ".join(str(text).split())))
    return _MARKUP.sub(r"\\\1", text)


def _code(text) -> str:
    """``text`` as a Markdown code span (shown literally, HTML included), fenced by more backticks
    than its longest run of them."""
    text = printable(" ".join(str(text).split()))
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str) -> str:
    """A table cell: GFM splits cells at every unescaped ``|``, inside code spans too; a non-breaking space on
    either side keeps neighbouring cells apart where the renderer pads none (the MLflow UI's tables)."""
    text = re.sub(r"(?<!\\)\|", r"\\|", str(text))
    return f"&nbsp;{text}&nbsp;" if text else text


def summary_markdown(verdict, run_link: Callable[[str], str] | None = None, gate_run_id: str | None = None,
                     notes: tuple[str, ...] = ()) -> str:
    """The verdict as Markdown: heading, notes, a table of checks, messages of failed checks, the gate run.

    ``run_link(run_id)`` gives the text naming a run (e.g. a Markdown link to the MLflow UI);
    default: the id in backticks.
    """
    link = run_link or _code
    relative = any(c.relation for c in verdict.checks)
    lines = [f"## mlflow-di gate: {verdict.outcome} for {_code(verdict.model_uri)}", ""]
    if verdict.outcome == "ERROR":
        lines.append(f"- **could not judge**: {_prose(verdict.cause)}")
    if verdict.outcome == "INCONCLUSIVE":
        lines.append("- **inconclusive**: the evidence cannot decide " + ", ".join(
            _code(c.label) for c in verdict.inconclusive) + " (a 95% interval holds its threshold)")
    lines += [f"- {_prose(note)}" for note in notes]
    if verdict.baseline_uri:
        lines.append(f"- baseline: {_code(verdict.baseline_uri)}")
    lines.append(f"- {_prose(verdict.summary())}")
    lines.append("")
    header = ["criterion", "model", "value", "95% interval (n)", "threshold", *(["baseline", "change"] if relative else []),
              "result", "runs", "evidence"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for check in verdict.checks:
        runs = [link(run_id) for run_id in (check.run_id, check.baseline_run_id) if run_id]
        row = [check.criterion, _code(check.compressed) if check.compressed else "",
               value_text(check.measured), interval_text(check), threshold_text(check)]
        if relative:
            row += [value_text(check.baseline) if check.relation and check.baseline_model else "",
                    value_text(check.change) if check.relation and check.change is not None else ""]
        result = result_text(check, verdict.inconclusive_as)
        row += [result if check.outcome == "PASS" else f"**{result}**", ", ".join(runs), evidence_cell(check)]
        lines.append("| " + " | ".join(_cell(cell) for cell in row) + " |")
    messages = list(dict.fromkeys(c.message for c in verdict.checks if c.message))
    if messages:
        lines += ["", *[f"- {_prose(message)}" for message in messages]]
    if gate_run_id:
        lines += ["", f"Gate run: {link(gate_run_id)}"]
    return "\n".join(lines) + "\n"


def evidence_cell(check) -> str:
    """What a check's figure rests on, for a table cell: split and data, strategy and budget, completeness,
    semantics (the run is its own column; the execution contexts are listed once below the table)."""
    evidence = check.evidence
    if evidence is None:
        return _code(check.data) if check.data else ""
    parts = []
    if evidence.data:
        parts.append(f"{evidence.split} {_code(evidence.data)}" if evidence.split else _code(evidence.data))
    if evidence.strategy:
        parts.append(_prose(evidence.strategy + (f" inside {evidence.budget}" if evidence.budget not in ("", "none")
                                                  else ", no realism budget")))
    if evidence.complete is False:
        parts.append("**INCOMPLETE**")
    if evidence.semantics:
        parts.append(f"{evidence.semantics} semantics")
    return "; ".join(parts)


def error_markdown(model_uri: str, cause: str) -> str:
    """The description of a version that could not be analysed: ERROR and the one-line cause."""
    return (f"## mlflow-di gate: ERROR for {_code(model_uri)}\n\n- **could not analyse**: {_prose(cause)}\n"
            "- this says nothing about the model's quality; fix the cause and run the pipeline again\n")
