"""``gate --baseline``: relative thresholds against another registry version (pure pairing and
comparison, reading a baseline's recorded runs, the command), and the CI outputs ``--junit-xml``
and ``--summary-md``."""
import json
import math
import xml.etree.ElementTree as ET

import pytest

from mlflow_di.errors import UserError
from mlflow_di.gate import Baseline, Measurement, Thresholds, Verdict, decide
from mlflow_di.reporting.ci import junit_xml, summary_markdown

from mlflow_server import record_candidate, record_history, run_gate

URI, BASE = "models:/m/3", "models:/m/1"


def _baseline(*measurements, is_export=False):
    return Baseline(BASE, list(measurements), is_export)


# ------------------------------------------------------------------------------ pure logic
def test_each_relation_passes_on_its_threshold_and_fails_beyond_it():
    base = _baseline(Measurement("idc", 0.6), Measurement("success_rate", 0.2, "models:/m-int8/1", method="int8"),
                     Measurement("mean_queries", 100.0, "models:/m-int8/1", method="int8"))
    on = {"idc": 0.5, "success_rate": 0.25, "mean_queries": 80.0}  # drop 0.1, rise 0.05, ratio 0.8
    thresholds = Thresholds(max_idc_drop=0.1, max_success_rate_rise=0.05, min_mean_queries_ratio=0.8)

    def candidate(values):
        return [Measurement("idc", values["idc"])] + [Measurement(metric, values[metric], "models:/m-int8/2",
                                                                  method="int8") for metric in ("success_rate", "mean_queries")]

    verdict = decide(URI, thresholds, candidate(on), base)
    assert verdict.passed, [c.to_dict() for c in verdict.checks]
    assert [c.criterion for c in verdict.checks] == ["idc_drop", "success_rate_rise", "mean_queries_ratio"]
    changes = [c.change for c in verdict.checks]
    assert changes == pytest.approx([0.6 - 0.5, 0.25 - 0.2, 80.0 / 100.0])
    assert [c.baseline for c in verdict.checks] == [0.6, 0.2, 100.0]
    assert verdict.checks[1].baseline_model == "models:/m-int8/1"
    for metric, worse in {"idc": 0.49, "success_rate": 0.26, "mean_queries": 79.0}.items():
        failed = decide(URI, thresholds, candidate({**on, metric: worse}), base)
        assert [c.metric for c in failed.failures] == [metric]


def test_exports_pair_by_method_and_an_unpaired_or_unknown_method_fails_naming_the_baseline_command():
    base = _baseline(Measurement("success_rate", 0.2, "models:/m-int8/1", method="int8"),
                     Measurement("success_rate", 0.9, "models:/m-prune/1", method="prune"))
    candidate = [Measurement("success_rate", 0.25, "models:/m-prune/2", method="prune"),
                 Measurement("success_rate", 0.25, "models:/m-int8/2", method="int8"),
                 Measurement("success_rate", 0.25, "models:/m-qdq/1", method="qdq"),
                 Measurement("success_rate", 0.25, "local.onnx")]
    checks = decide(URI, Thresholds(max_success_rate_rise=0.1), candidate, base).checks
    assert [(c.baseline, c.passed) for c in checks] == [(0.9, True), (0.2, True), (None, False), (None, False)]
    assert checks[2].message.startswith(f"{BASE} has no qdq export with recorded results; run `mlflow-di compress "
                                        f"--model-uri {BASE} --method qdq ...`")
    assert "local.onnx has no recorded compression method" in checks[3].message
    assert all(len(c.message.splitlines()) <= 1 for c in checks)


def test_of_several_baseline_exports_of_a_method_the_newest_version_counts():
    base = _baseline(Measurement("success_rate", 0.5, "models:/m-int8/9", method="int8"),
                     Measurement("success_rate", 0.1, "models:/m-int8/10", method="int8"))
    check = decide(URI, Thresholds(max_success_rate_rise=0.2),
                   [Measurement("success_rate", 0.2, "models:/m-int8/11", method="int8")], base).checks[0]
    assert check.baseline_model == "models:/m-int8/10" and check.change == pytest.approx(0.1)


def test_a_missing_baseline_measurement_fails_with_what_to_run_on_the_baseline():
    base = _baseline(Measurement("idc", None, missing=f"no coverage run recorded for {BASE}; run "
                                                      f"`mlflow-di coverage --model-uri {BASE} ...` first"))
    check = decide(URI, Thresholds(max_idc_drop=0.5), [Measurement("idc", 0.9, run_id="r")], base).checks[0]
    assert not check.passed and check.change is None
    assert check.message == (f"baseline: no coverage run recorded for {BASE}; run "
                             f"`mlflow-di coverage --model-uri {BASE} ...` first")
    empty = decide(URI, Thresholds(max_idc_drop=0.5), [Measurement("idc", 0.9)], _baseline()).checks[0]
    assert not empty.passed and f"mlflow-di coverage --model-uri {BASE}" in empty.message


def test_a_baseline_that_is_an_export_is_compared_with_whatever_export_the_candidate_is():
    base = _baseline(Measurement("mean_queries", 50.0, "models:/m-int8/1", method="int8"), is_export=True)
    check = decide(URI, Thresholds(min_mean_queries_ratio=1.0),
                   [Measurement("mean_queries", 60.0, "models:/m-prune/2", method="prune")], base).checks[0]
    assert check.passed and check.change == pytest.approx(60.0 / 50.0)


def test_ratio_of_campaigns_without_deviations():
    def ratio(candidate, baseline):
        return decide(URI, Thresholds(min_mean_queries_ratio=1.0), [Measurement("mean_queries", candidate, "c", method="x")],
                      _baseline(Measurement("mean_queries", baseline, "b", method="x"))).checks[0]

    assert ratio(math.inf, 40.0).passed and ratio(math.inf, 40.0).change == math.inf
    assert ratio(math.inf, math.inf).change == 1.0 and ratio(math.inf, math.inf).passed
    assert not ratio(40.0, math.inf).passed and ratio(40.0, math.inf).change == 0.0


def test_no_baseline_yet_passes_the_relative_checks_and_says_so():
    verdict = decide(URI, Thresholds(max_idc_drop=0.0), [Measurement("idc", 0.1)],
                     Baseline(None, absent="no baseline: models:/m@champion is not set yet"))
    assert verdict.passed and verdict.checks[0].message == "no baseline: models:/m@champion is not set yet"
    assert verdict.baseline_uri is None


@pytest.mark.parametrize("thresholds, baseline, problem", [
    ({"max_idc_drop": 0.1}, None, "--max-idc-drop compare(s) with a baseline"),
    ({"min_idc": 0.1}, _baseline(), "--baseline needs a relative threshold"),
    ({"max_success_rate_rise": 1.5}, _baseline(), "between 0 and 1"),
    ({"min_mean_queries_ratio": 0.0}, _baseline(), "above 0")])
def test_relative_threshold_errors(thresholds, baseline, problem):
    with pytest.raises(UserError) as raised:
        decide(URI, Thresholds(**thresholds), [], baseline)
    assert problem in str(raised.value)


def test_a_verdict_with_a_baseline_round_trips_and_one_without_keeps_the_old_keys():
    base = _baseline(Measurement("idc", 0.6, run_id="b1"))
    verdict = decide(URI, Thresholds(min_idc=0.5, max_idc_drop=0.05), [Measurement("idc", 0.58, run_id="c1")], base)
    assert Verdict.from_json(verdict.to_json()) == verdict
    assert json.loads(verdict.to_json())["baseline_uri"] == BASE
    plain = decide(URI, Thresholds(min_idc=0.5), [Measurement("idc", 0.58)]).to_dict()
    assert set(plain) == {"model_uri", "passed", "thresholds", "checks", "measurements"}
    assert set(plain["checks"][0]) == {"metric", "compressed", "measured", "threshold", "greater_is_better", "passed",
                                       "run_id", "message", "outcome"}
    assert set(plain["thresholds"]) == {"min_idc", "max_success_rate", "min_mean_queries", "max_accuracy_drop"}


# ------------------------------------------------------------------------------ CI renderers
def _mixed_verdict():
    base = _baseline(Measurement("success_rate", 0.2, "models:/m-int8/1", "rb", method="int8"))
    candidate = [Measurement("idc", None, missing="no coverage run recorded for models:/m/3; run `mlflow-di coverage`"),
                 Measurement("success_rate", 0.5, "models:/m-int8/2", "rc", method="int8")]
    return decide(URI, Thresholds(min_idc=0.5, max_success_rate=0.6, max_success_rate_rise=0.1), candidate, base)


def test_junit_has_one_suite_one_case_per_check_and_failures_for_missing_and_beyond():
    verdict = _mixed_verdict()
    root = ET.fromstring(junit_xml(verdict, "gate-run", "2026-01-01T00:00:00+00:00"))
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["mlflow-di gate"]
    cases = suites[0].findall("testcase")
    assert len(cases) == len(verdict.checks) == int(suites[0].get("tests")) == int(root.get("tests"))
    failed = [case for case in cases if case.find("failure") is not None]
    assert len(failed) == len(verdict.failures) == int(suites[0].get("failures"))
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("idc", "idc"), ("success_rate", "success_rate [models:/m-int8/2]"),
        ("success_rate_rise", "success_rate rise [models:/m-int8/2]")]
    messages = [case.find("failure").get("message") for case in failed]
    assert messages == ["value missing vs threshold >= 0.5", "value 0.3 vs threshold <= 0.1"]
    assert "baseline 0.2 from models:/m-int8/1 (run rb)" in failed[1].find("failure").text
    properties = {p.get("name"): p.get("value") for p in suites[0].find("properties")}
    assert properties["baseline"] == BASE and properties["gate_run_id"] == "gate-run"


def test_markdown_summary_has_a_heading_a_row_per_check_and_the_runs():
    verdict = _mixed_verdict()
    text = summary_markdown(verdict, lambda run_id: f"[{run_id}](http://ui/{run_id})", "gate-run", ("a note | piped",))
    lines = text.splitlines()
    assert lines[0] == f"## mlflow-di gate: FAIL for `{URI}`"
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == ("| criterion | model | value | 95% interval (n) | threshold | baseline | change | result | runs | "
                        "evidence |")
    assert len(table) == 1 + len(verdict.checks)
    # each cell padded with a non-breaking space: the MLflow UI's tables pad none, and "static/1" beside "0"
    # read "static/10"
    assert table[3] == ("| &nbsp;success_rate_rise&nbsp; | &nbsp;`models:/m-int8/2`&nbsp; | &nbsp;0.5&nbsp; | "
                        "&nbsp;exact&nbsp; | &nbsp;<= 0.1&nbsp; | &nbsp;0.2&nbsp; | &nbsp;0.3&nbsp; | &nbsp;**FAIL**&nbsp; | "
                        "&nbsp;[rc](http://ui/rc), [rb](http://ui/rb)&nbsp; |  |")
    assert "- a note \\| piped" in lines and lines[-1] == "Gate run: [gate-run](http://ui/gate-run)"
    assert all(line.count("|") - line.count("\\|") == 11 for line in table)


# ------------------------------------------------------------------------ recorded runs and the command
@pytest.fixture()
def client(mlflow_client):
    return mlflow_client


@pytest.fixture()
def versions(client):
    """lenet/1 (history: idc 0.62, int8 0.30/120, prune 0.8/40) is the champion; lenet/3 the candidate
    (idc 0.58, int8 0.35/100, prune 0.7/60); lenet/2 has only coverage."""
    experiment = client.create_experiment("recorded")
    history = record_history(client, experiment, "lenet")
    client.set_registered_model_alias("lenet", "champion", "1")
    candidate = record_candidate(client, experiment, "lenet", 0.58, {"int8": (0.35, 100.0), "prune": (0.7, 60.0)})
    return history, candidate


def _rows(out: str, start: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith(start)]


def test_measurements_carry_the_compression_method_of_each_export(client, versions):
    from mlflow_di.mlflow_edge import gate_evidence

    found = gate_evidence.measurements("models:/lenet/3")
    assert {(m.compressed, m.method) for m in found if m.compressed} == {("models:/lenet-int8/2", "int8"),
                                                                         ("models:/lenet-prune/2", "prune")}


def test_gate_baseline_compares_each_export_with_the_champions_of_the_same_method(client, versions, capsys, tmp_path):
    junit, summary = tmp_path / "ci" / "gate.xml", tmp_path / "summary.md"
    code, out, err = run_gate(capsys, "--model-uri", "models:/lenet/3", "--baseline", "models:/lenet@champion",
                              "--max-idc-drop", "0.05", "--max-success-rate-rise", "0.04",
                              "--min-mean-queries-ratio", "0.8", "--promote-alias", "champion",
                              "--junit-xml", str(junit), "--summary-md", str(summary))
    assert code == 1, out + err
    assert _rows(out, "check") == [["check", "measured", "baseline", "change", "95%", "interval", "(n)", "threshold",
                                    "result"]]
    rise = _rows(out, "success_rate rise")  # exact figures (degenerate intervals): the change's interval is the change
    assert [row[:6] + row[8:] for row in rise] == [
        ["success_rate", "rise", "[models:/lenet-int8/2]", "0.35", "0.3", "0.05", "<=", "0.04", "FAIL"],
        ["success_rate", "rise", "[models:/lenet-prune/2]", "0.7", "0.8", "-0.1", "<=", "0.04", "PASS"]]
    assert [row[6:8] for row in rise] == [["0.05-0.05", "(10000)"], ["-0.1--0.1", "(10000)"]]
    ratio = _rows(out, "mean_queries ratio")
    assert [row[-7:-5] + row[-3:] for row in ratio] == [["120", f"{100 / 120:.4g}", ">=", "0.8", "PASS"],
                                                        ["40", "1.5", ">=", "0.8", "PASS"]]
    drop = _rows(out, "idc drop")
    assert [row[:5] + row[7:] for row in drop] == [["idc", "drop", "0.58", "0.62", f"{0.62 - 0.58:.4g}", "<=", "0.05",
                                                    "PASS"]]
    assert "compared with the baseline models:/lenet/1" in out
    assert str(client.get_model_version_by_alias("lenet", "champion").version) == "1"  # failed: not moved
    tags = client.get_model_version("lenet", "3").tags
    assert tags["mlflow_di.gate_baseline"] == "models:/lenet/1"
    assert float(tags["mlflow_di.success_rate_rise"]) == pytest.approx(0.05)
    assert tags["mlflow_di.success_rate_rise_baseline"] == "0.3"
    assert float(tags["mlflow_di.mean_queries_ratio"]) == pytest.approx(100 / 120, rel=1e-5)
    # the CI files exist although the gate failed
    suite = ET.parse(junit).getroot().find("testsuite")
    assert int(suite.get("tests")) == 5 and int(suite.get("failures")) == 1
    assert [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None] == [
        "success_rate rise [models:/lenet-int8/2]"]
    text = summary.read_text()
    assert text.startswith("## mlflow-di gate: FAIL for `models:/lenet/3`")
    assert tags["mlflow_di.gate_run_id"] in text and "alias 'champion' not moved" in text
    assert not list(tmp_path.rglob("*.partial"))


def test_gate_baseline_pass_moves_the_champion(client, versions, capsys):
    code, out, err = run_gate(capsys, "--model-uri", "models:/lenet/3", "--baseline", "models:/lenet@champion",
                              "--min-idc", "0.5", "--max-idc-drop", "0.05", "--max-success-rate-rise", "0.1",
                              "--promote-alias", "champion")
    assert code == 0, out + err
    assert str(client.get_model_version_by_alias("lenet", "champion").version) == "3"
    # the next candidate compares with the new champion
    code, out, err = run_gate(capsys, "--model-uri", "models:/lenet/1", "--baseline", "models:/lenet@champion",
                              "--max-idc-drop", "0")
    assert code == 0 and _rows(out, "idc drop")[0][3:5] == ["0.58", f"{0.58 - 0.62:.4g}"], out + err


def test_gating_an_export_compares_it_with_the_baselines_export_of_its_method_or_the_baseline_export(client, versions,
                                                                                                  capsys):
    for number, source in (("1", "1"), ("2", "3")):
        client.set_model_version_tag("lenet-int8", number, "mlflow_di.source_name", "lenet")
        client.set_model_version_tag("lenet-int8", number, "mlflow_di.source_version", source)
    for baseline in ("models:/lenet@champion", "models:/lenet-int8/1"):
        code, out, err = run_gate(capsys, "--model-uri", "models:/lenet-int8/2", "--baseline", baseline,
                                  "--max-success-rate-rise", "0.1", "--max-idc-drop", "0.1")
        assert code == 0, out + err
        assert _rows(out, "success_rate rise") == [
            ["success_rate", "rise", "[models:/lenet-int8/2]", "0.35", "0.3", "0.05", "0.05-0.05", "(10000)", "<=", "0.1",
             "PASS"]]
        assert _rows(out, "idc drop")[0][2:4] == ["0.58", "0.62"]  # the sources' coverage


def test_no_champion_yet(client, capsys):
    experiment = client.create_experiment("first")
    record_candidate(client, experiment, "first", 0.7, {"int8": (0.1, 50.0)})
    args = ["--model-uri", "models:/first/1", "--baseline", "models:/first@champion", "--max-idc-drop", "0.01"]
    code, out, err = run_gate(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no such alias yet" in err and "--baseline-optional" in err
    code, out, err = run_gate(capsys, *args, "--baseline-optional", "--promote-alias", "champion")
    assert code == 0, out + err
    assert _rows(out, "idc drop") == [["idc", "drop", "0.7", "-", "-", "-", "<=", "0.01", "PASS"]]
    assert "no baseline: models:/first@champion is not set yet" in out
    assert client.get_model_version("first", "1").tags["mlflow_di.gate_baseline"] == "none"
    assert str(client.get_model_version_by_alias("first", "champion").version) == "1"


@pytest.mark.parametrize("args, message", [
    (["--model-uri", "models:/lenet/1", "--baseline", "models:/lenet@champion", "--max-idc-drop", "0.1"],
     "--baseline models:/lenet@champion is the candidate itself (models:/lenet/1)"),
    (["--model-uri", "models:/lenet/3", "--baseline", "models:/lenet/3", "--max-idc-drop", "0.1"],
     "is the candidate itself"),
    (["--model-uri", "models:/lenet/3", "--baseline", "models:/nothing@champion", "--max-idc-drop", "0.1"],
     "--baseline: cannot find models:/nothing@champion"),
    (["--model-uri", "models:/lenet/3", "--baseline", "models:/lenet/9", "--max-idc-drop", "0.1"],
     "--baseline: cannot find models:/lenet/9"),
    (["--model-uri", "models:/lenet/3", "--max-idc-drop", "0.1"], "compare(s) with a baseline"),
    (["--model-uri", "models:/lenet/3", "--baseline", "models:/lenet/1", "--min-idc", "0.1"],
     "needs a relative threshold")])
def test_gate_baseline_errors_exit_2_with_one_line(client, versions, capsys, args, message):
    code, out, err = run_gate(capsys, *args)
    assert code == 2, out + err
    assert message in err and len(err.strip().splitlines()) == 1


HOSTILE = 'x"><img src=x onerror=alert(1)> `code` | *bold* [link](http://evil) <script>&amp;\x01'


def test_hostile_names_render_as_text_in_markdown_and_junit():
    """A model name full of HTML, Markdown and a control character: the summary renders it as text
    (checked with markdown-it, a CommonMark/GFM parser) and the JUnit report stays parseable XML."""
    from markdown_it import MarkdownIt

    uri = f"models:/{HOSTILE}/1"
    verdict = decide(uri, Thresholds(min_idc=0.5, max_success_rate=0.1),
                     [Measurement("idc", None, missing=f"no coverage run recorded for {uri}"),
                      Measurement("success_rate", 0.5, f"models:/{HOSTILE}-int8/2", "rc", method="int8")])
    html = MarkdownIt("commonmark").enable("table").render(summary_markdown(verdict, notes=(f"note about {HOSTILE}",)))
    assert "<img" not in html and "<script" not in html and 'href="http://evil"' not in html and "<em>" not in html
    rows = [row for row in html.split("<tr>")[2:]]
    assert len(rows) == len(verdict.checks) and all(row.count("<td>") == 8 for row in rows)
    root = ET.fromstring(junit_xml(verdict, "gate-run"))
    properties = {p.get("name"): p.get("value") for p in root.find("testsuite").find("properties")}
    assert properties["model_uri"] == uri.replace("\x01", "\ufffd")
