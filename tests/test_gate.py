"""The quality gate: decision logic (pure), reading recorded runs, and the ``mlflow-di gate`` command
against a local sqlite tracking store (the real-server variants are in test_server.py)."""
import itertools
import json
import math
import pathlib
import xml.etree.ElementTree as ET

import pytest

from mlflow_di.errors import UserError
from mlflow_di.gate import CHECKS, Measurement, Thresholds, Verdict, decide

from mlflow_server import PASSING, record_export, record_history, record_run, register_version, run_gate

URI = "models:/lenet/1"


# ------------------------------------------------------------------------------ decision logic
def test_values_on_the_threshold_pass_and_values_beyond_it_fail():
    thresholds = Thresholds(min_idc=0.5, max_success_rate=0.3, min_mean_queries=100, max_accuracy_drop=0.01,
                            max_class_accuracy_drop=0.05)
    on_threshold = [Measurement("idc", 0.5), Measurement("success_rate", 0.3, "c"),
                    Measurement("mean_queries", 100.0, "c"), Measurement("accuracy_drop", 0.01, "c"),
                    Measurement("max_class_accuracy_drop", 0.05, "c")]
    assert decide(URI, thresholds, on_threshold).passed
    beyond = {"idc": 0.49, "success_rate": 0.31, "mean_queries": 99.0, "accuracy_drop": 0.011,
              "max_class_accuracy_drop": 0.051}
    for metric, value in beyond.items():
        measured = [m if m.metric != metric else Measurement(metric, value, m.compressed) for m in on_threshold]
        verdict = decide(URI, thresholds, measured)
        assert not verdict.passed
        assert [c.metric for c in verdict.failures] == [metric]
        per_export = "c 3/4" if verdict.failures[0].compressed else "c 4/4"
        assert verdict.summary() == f"fail: 4/5 checks passed; failed: {verdict.failures[0].label}; per export: {per_export}"


def test_a_missing_measurement_fails_and_says_which_command_records_it():
    verdict = decide(URI, Thresholds(min_idc=0.1, max_accuracy_drop=0.5), [])
    assert not verdict.passed
    assert [c.measured for c in verdict.checks] == [None, None]
    assert verdict.checks[0].message == (
        "no coverage run recorded for models:/lenet/1; run `mlflow-di coverage --model-uri models:/lenet/1 ...` first")
    assert "mlflow-di compress --model-uri models:/lenet/1" in verdict.checks[1].message


def test_every_compressed_model_is_checked_and_the_worst_value_is_reported():
    measured = [Measurement("success_rate", 0.1, "models:/a/1"), Measurement("success_rate", 0.6, "models:/b/1"),
                Measurement("mean_queries", 300.0, "models:/a/1"), Measurement("mean_queries", 80.0, "models:/b/1")]
    verdict = decide(URI, Thresholds(max_success_rate=0.5, min_mean_queries=100), measured)
    assert [(c.label, c.passed) for c in verdict.checks] == [
        ("success_rate [models:/a/1]", True), ("success_rate [models:/b/1]", False),
        ("mean_queries [models:/a/1]", True), ("mean_queries [models:/b/1]", False)]
    assert verdict.worst("success_rate") == 0.6 and verdict.worst("mean_queries") == 80.0
    assert verdict.worst("idc") is None


def test_a_campaign_without_deviations_passes_any_minimum_of_queries():
    verdict = decide(URI, Thresholds(min_mean_queries=1e9), [Measurement("mean_queries", math.inf, "c")])
    assert verdict.passed
    assert Verdict.from_json(verdict.to_json()).checks[0].measured == math.inf


def test_verdict_round_trips_through_json():
    verdict = decide(URI, Thresholds(min_idc=0.5, max_success_rate=0.2),
                     [Measurement("idc", 0.7, run_id="r1"), Measurement("success_rate", None, "c", missing="run fuzz")])
    again = Verdict.from_json(verdict.to_json())
    assert again == verdict and again.passed is False and again.to_dict()["passed"] is False


@pytest.mark.parametrize("thresholds, problem", [
    (Thresholds(), "no threshold given"), ({"min_idc": 1.5}, "between 0 and 1"),
    ({"max_success_rate": -0.1}, "between 0 and 1"), ({"min_mean_queries": math.nan}, "finite")])
def test_bad_thresholds_are_user_errors(thresholds, problem):
    with pytest.raises(UserError, match=problem):
        decide(URI, thresholds if isinstance(thresholds, Thresholds) else Thresholds(**thresholds), [])


def test_checks_agree_with_mlflow_metric_threshold():
    """Each check is the comparison mlflow.validate_evaluation_results makes for a MetricThreshold."""
    from mlflow.models import MetricThreshold
    from mlflow.models.evaluation import EvaluationResult
    from mlflow.models.evaluation.validation import ModelValidationFailedException
    import mlflow

    values = [0.0, 0.25, 0.5, 0.5000001, 0.75, 1.0]
    for (metric, criterion), threshold, value in itertools.product(CHECKS.items(), values, values):
        if criterion.threshold_name == "min_speedup" and threshold == 0:
            continue  # a speedup threshold must be above 0
        check = decide(URI, Thresholds(**{criterion.threshold_name: threshold}),
                       [Measurement(metric, value, None if metric == "idc" else "c")]).checks[0]
        try:
            mlflow.validate_evaluation_results({metric: MetricThreshold(**check.metric_threshold_args())},
                                               EvaluationResult({metric: value}, {}))
            mlflow_passed = True
        except ModelValidationFailedException:
            mlflow_passed = False
        assert check.passed == mlflow_passed, (metric, threshold, value)


# ------------------------------------------------------------------------ recorded runs (sqlite)
@pytest.fixture()
def client(mlflow_client):
    return mlflow_client


@pytest.fixture()
def history(client):
    return record_history(client, client.create_experiment("recorded"), "lenet")


def _values(found):
    return {(m.metric, m.compressed): m.value for m in found}


def test_measurements_are_the_newest_finished_runs_of_that_version(client, history):
    from mlflow_di.mlflow_edge import gate_evidence

    found = gate_evidence.measurements(history.uri)
    assert _values(found) == {
        ("idc", None): 0.62,
        ("success_rate", "models:/lenet-int8/1"): 0.30, ("mean_queries", "models:/lenet-int8/1"): 120.0,
        ("accuracy_drop", "models:/lenet-int8/1"): 0.004, ("max_class_accuracy_drop", "models:/lenet-int8/1"): 0.02,
        ("success_rate", "models:/lenet-prune/1"): 0.8, ("mean_queries", "models:/lenet-prune/1"): 40.0,
        ("accuracy_drop", "models:/lenet-prune/1"): 0.05, ("max_class_accuracy_drop", "models:/lenet-prune/1"): 0.2,
        ("disagreement_rate", "models:/lenet-int8/1"): 0.008, ("disagreement_rate", "models:/lenet-prune/1"): 0.1,
        ("speedup", "models:/lenet-int8/1"): None, ("speedup", "models:/lenet-prune/1"): None,  # --no-benefit runs
        # the newest robustness run that measured each export: int8 alone later, prune only in the first
        ("robustness_agreement_min", "models:/lenet-int8/1"): 0.95,
        ("robustness_agreement_min", "models:/lenet-prune/1"): 0.60,
        # recorded by no campaign: missing per export, never a row left out
        ("realistic_success_rate", "models:/lenet-int8/1"): None,
        ("realistic_success_rate", "models:/lenet-prune/1"): None}
    idc = next(m for m in found if m.metric == "idc")
    assert client.get_run(idc.run_id).data.metrics["idc"] == 0.62
    accuracy = next(m for m in found if m.metric == "accuracy_drop" and m.compressed == "models:/lenet-int8/1")
    assert accuracy.run_id == history.compressed.run_id


def test_gating_an_export_reads_coverage_from_its_source_through_lineage(client, history):
    """Coverage cannot be measured on an ONNX export: the gate follows the export's source tags."""
    from mlflow_di.mlflow_edge import gate_evidence

    client.set_model_version_tag("lenet-int8", "1", "mlflow_di.source_name", "lenet")
    client.set_model_version_tag("lenet-int8", "1", "mlflow_di.source_version", "1")
    found = gate_evidence.measurements("models:/lenet-int8/1")
    assert _values(found) == {
        ("idc", None): 0.62,  # the source's coverage, not a 'run coverage on the export' message
        ("success_rate", "models:/lenet-int8/1"): 0.30, ("mean_queries", "models:/lenet-int8/1"): 120.0,
        ("accuracy_drop", "models:/lenet-int8/1"): 0.004, ("max_class_accuracy_drop", "models:/lenet-int8/1"): 0.02,
        ("disagreement_rate", "models:/lenet-int8/1"): 0.008, ("speedup", "models:/lenet-int8/1"): None,
        ("robustness_agreement_min", "models:/lenet-int8/1"): 0.95,
        ("realistic_success_rate", "models:/lenet-int8/1"): None}
    # recorded without a benefit measurement, and by campaigns that predate the realism counts
    assert [m.metric for m in found if m.missing] == ["realistic_success_rate", "speedup"]


def test_measurements_only_for_the_compressed_models_asked_for(client, history):
    from mlflow_di.mlflow_edge import gate_evidence

    client.set_registered_model_alias("lenet-int8", "edge", "1")
    found = gate_evidence.measurements(history.uri, ["models:/lenet-int8@edge"])
    assert {m.compressed for m in found if m.compressed} == {"models:/lenet-int8/1"}
    assert _values(found)[("success_rate", "models:/lenet-int8/1")] == 0.30


def test_a_compressed_model_never_fuzzed_is_reported_missing(client, history):
    from mlflow_di.mlflow_edge import gate_evidence

    lonely = register_version(client, "lenet-onnx")
    found = {m.metric: m for m in gate_evidence.measurements(history.uri, ["models:/lenet-onnx/1", "local.tflite"])
             if m.compressed == "models:/lenet-onnx/1"}
    assert found["success_rate"].value is None and found["accuracy_drop"].value is None
    assert found["success_rate"].missing == (
        f"no fuzz run recorded for {history.uri} against models:/lenet-onnx/{lonely.version}; run "
        f"`mlflow-di fuzz --original {history.uri} --compressed models:/lenet-onnx/1 ...` first")


def test_a_compress_run_without_per_class_figures_says_so(client, history):
    from mlflow_di.mlflow_edge import gate_evidence

    experiment = client.get_experiment_by_name("recorded").experiment_id
    run_id = record_run(client, experiment, "compress", history.subject, {"accuracy_drop": 0.01})
    register_version(client, "lenet-old", run_id)
    found = {m.metric: m for m in gate_evidence.measurements(history.uri, ["models:/lenet-old/1"]) if m.compressed}
    assert found["accuracy_drop"].value == 0.01
    assert found["max_class_accuracy_drop"].value is None
    assert found["max_class_accuracy_drop"].missing.startswith(f"compress run {run_id} recorded no max_class_accuracy_drop")


def test_a_fuzz_run_without_deviations_measures_infinite_queries(client, history):
    from mlflow_di.mlflow_edge import gate_evidence
    from mlflow_server import fuzz_tags

    experiment = client.get_experiment_by_name("recorded").experiment_id
    record_run(client, experiment, "fuzz", history.subject, {"success_rate": 0.0, "triggers": 0},
               tags=fuzz_tags(history.compressed), start_time=1_800_000_000_000)
    found = _values(gate_evidence.measurements(history.uri, ["models:/lenet-int8/1"]))
    assert found[("success_rate", "models:/lenet-int8/1")] == 0.0
    assert found[("mean_queries", "models:/lenet-int8/1")] == math.inf


def test_a_compressed_model_with_only_a_robustness_run_is_gated_and_one_never_measured_is_missing(client, history):
    from mlflow_di.mlflow_edge import gate_evidence

    lonely = register_version(client, "lenet-onnx")
    experiment = client.get_experiment_by_name("recorded").experiment_id
    record_run(client, experiment, "robustness", history.subject,
               {"robustness_agreement_min": 0.7, "robustness_agreement_min.local_onnx": 0.7},
               tags={"mlflow_di.robustness_compressed": '{"local.onnx": "local_onnx"}'}, start_time=1_800_000_000_000)
    found = _values(gate_evidence.measurements(history.uri))
    assert found[("robustness_agreement_min", "local.onnx")] == 0.7  # found from its robustness run alone
    assert found[("success_rate", "local.onnx")] is None
    missing = {m.metric: m for m in gate_evidence.measurements(history.uri, [f"models:/lenet-onnx/{lonely.version}"])}
    assert missing["robustness_agreement_min"].value is None
    assert missing["robustness_agreement_min"].missing == (
        f"no robustness run recorded for {history.uri} against models:/lenet-onnx/1; run `mlflow-di robustness "
        f"--model-uri {history.uri} --compressed models:/lenet-onnx/1 --data SPEC` first")


def test_min_robustness_agreement_checks_every_compressed_model():
    measured = [Measurement("robustness_agreement_min", 0.95, "models:/a/1"),
                Measurement("robustness_agreement_min", 0.6, "models:/b/1")]
    verdict = decide(URI, Thresholds(min_robustness_agreement=0.9), measured)
    assert [(c.label, c.passed) for c in verdict.checks] == [
        ("robustness_agreement_min [models:/a/1]", True), ("robustness_agreement_min [models:/b/1]", False)]
    assert verdict.worst("robustness_agreement_min") == 0.6
    assert decide(URI, Thresholds(min_robustness_agreement=0.6), measured).passed
    with pytest.raises(UserError, match="between 0 and 1"):
        Thresholds(min_robustness_agreement=1.2)


def test_model_version_tags_resolve_aliases(client, history):
    from mlflow_di.mlflow_edge import registry

    client.set_registered_model_alias("lenet", "champion", "2")
    assert registry.model_version_tags("models:/lenet@champion") == {
        "mlflow_di.model_name": "lenet", "mlflow_di.model_version": "2", "mlflow_di.model_uri": "models:/lenet@champion"}
    assert registry.model_version_tags("model.onnx") == {}
    with pytest.raises(UserError, match="cannot find models:/lenet/9"):
        registry.model_version_tags("models:/lenet/9")


# ------------------------------------------------------------------------------ the command
def test_gate_pass_writes_tags_moves_the_alias_and_logs_a_gate_run(client, history, capsys, tmp_path):
    import json

    client.set_registered_model_alias("lenet", "champion", "2")
    code, out, err = run_gate(capsys, "--model-uri", history.uri, *PASSING, "--promote-alias", "champion",
                          "--json-out", str(tmp_path / "verdict.json"))
    assert code == 0, out + err
    assert str(client.get_model_version_by_alias("lenet", "champion").version) == "1"
    tags = client.get_model_version("lenet", "1").tags
    assert {k: tags[k] for k in ("mlflow_di.verdict", "mlflow_di.idc", "mlflow_di.success_rate", "mlflow_di.mean_queries",
                                 "mlflow_di.accuracy_drop")} == {
        "mlflow_di.verdict": "PASS", "mlflow_di.idc": "0.62", "mlflow_di.success_rate": "0.8",
        "mlflow_di.mean_queries": "40", "mlflow_di.accuracy_drop": "0.05"}
    assert "missing" not in tags.values() and "mlflow_di.class_accuracy_drop" not in tags  # not asked for
    description = client.get_model_version("lenet", "1").description
    assert description.startswith("## mlflow-di gate: PASS for `models:/lenet/1`")
    assert tags["mlflow_di.gate_run_id"] in description
    assert json.loads(tags["mlflow_di.gate_thresholds"]) == {
        "min_idc": 0.6, "max_success_rate": 0.85, "min_mean_queries": 30, "max_accuracy_drop": 0.06}
    run = client.get_run(tags["mlflow_di.gate_run_id"])
    assert run.data.tags["mlflow_di.command"] == "gate" and run.info.status == "FINISHED"
    assert run.data.tags["mlflow_di.model_version"] == "1" and run.data.metrics["passed"] == 1.0
    assert run.data.metrics["checks"] == 7.0  # idc + 3 criteria x 2 compressed models
    assert json.loads((tmp_path / "verdict.json").read_text())["passed"] is True
    assert "verdict: PASS (7/7 checks passed; per export: models:/lenet-int8/1 3/3, models:/lenet-prune/1 3/3)" in out
    assert "alias 'champion' now points to models:/lenet/1" in out


def test_gate_fail_exits_1_and_leaves_the_alias_alone(client, history, capsys):
    client.set_registered_model_alias("lenet", "champion", "2")
    code, out, err = run_gate(capsys, "--model-uri", history.uri, "--min-idc", "0.6", "--max-success-rate", "0.5",
                          "--promote-alias", "champion")
    assert code == 1, out + err
    assert str(client.get_model_version_by_alias("lenet", "champion").version) == "2"
    assert client.get_model_version("lenet", "1").tags["mlflow_di.verdict"] == "FAIL"
    failed = [line.split() for line in out.splitlines() if line.endswith("FAIL")]
    assert failed == [["success_rate", "[models:/lenet-prune/1]", "0.8", "0.8-0.8", "(10000)", "<=", "0.5", "FAIL"]]
    assert "alias 'champion' not moved" in out


def test_a_failing_version_loses_the_alias_it_held_and_keeps_its_own_description_text(client, history, capsys):
    client.set_registered_model_alias("lenet", "champion", "1")
    client.update_model_version("lenet", "1", description="Trained by Ada on the March data.")
    code, out, _ = run_gate(capsys, "--model-uri", history.uri, "--max-success-rate", "0.5", "--promote-alias", "champion")
    assert code == 1 and "alias 'champion' removed from this version" in out
    assert "champion" not in client.get_registered_model("lenet").aliases
    description = client.get_model_version("lenet", "1").description
    assert description.startswith("## mlflow-di gate: FAIL") and description.endswith("Trained by Ada on the March data.")
    assert run_gate(capsys, "--model-uri", history.uri, "--max-success-rate", "0.9")[0] == 0  # written again
    again = client.get_model_version("lenet", "1").description
    assert again.startswith("## mlflow-di gate: PASS") and again.count("mlflow-di gate") == 1
    assert again.endswith("Trained by Ada on the March data.")


def test_gate_min_robustness_agreement_fails_the_export_below_it(client, history, capsys):
    code, out, err = run_gate(capsys, "--model-uri", history.uri, "--min-robustness-agreement", "0.9")
    assert code == 1, out + err
    rows = [line.split() for line in out.splitlines() if line.startswith("robustness_agreement_min")]
    assert rows == [["robustness_agreement_min", "[models:/lenet-int8/1]", "0.95", "0.95-0.95", "(10000)", ">=", "0.9",
                     "PASS"],
                    ["robustness_agreement_min", "[models:/lenet-prune/1]", "0.6", "0.6-0.6", "(10000)", ">=", "0.9",
                     "FAIL"]]
    assert client.get_model_version("lenet", "1").tags["mlflow_di.robustness_agreement_min"] == "0.6"
    code, out, _ = run_gate(capsys, "--model-uri", history.uri, "--compressed", "models:/lenet-int8/1",
                            "--min-robustness-agreement", "0.9")
    assert code == 0, out


def test_gate_without_recorded_coverage_is_an_error_not_a_failure_and_says_what_to_run(client, capsys):
    register_version(client, "fresh")
    code, out, err = run_gate(capsys, "--model-uri", "models:/fresh/1", "--min-idc", "0.5")
    assert code == 2
    assert [line.split() for line in out.splitlines() if line.startswith("idc")] == [
        ["idc", "missing", "-", ">=", "0.5", "MISSING"]]
    what = "no coverage run recorded for models:/fresh/1; run `mlflow-di coverage --model-uri models:/fresh/1 ...` first"
    assert what in out and "verdict: ERROR" in out
    assert err.splitlines() == [f"mlflow-di: error: the gate could not judge models:/fresh/1: {what}"]
    version = client.get_model_version("fresh", "1")
    assert version.tags["mlflow_di.verdict"] == "ERROR" and "mlflow_di.idc" not in version.tags
    assert version.description.startswith("## mlflow-di gate: ERROR") and "could not judge" in version.description


def test_a_new_check_leaves_only_its_own_tags(client, history, capsys):
    import json

    assert run_gate(capsys, "--model-uri", history.uri, *PASSING)[0] == 0
    assert run_gate(capsys, "--model-uri", history.uri, "--compressed", "models:/lenet-int8/1", "--min-idc", "0.6")[0] == 0
    tags = client.get_model_version("lenet", "1").tags
    assert json.loads(tags["mlflow_di.gate_thresholds"]) == {"min_idc": 0.6}
    assert "mlflow_di.success_rate" not in tags and tags["mlflow_di.idc"] == "0.62"  # no stale value of a check not asked


def test_gate_checks_the_largest_class_accuracy_drop_of_every_export(client, history, capsys):
    code, out, err = run_gate(capsys, "--model-uri", history.uri, "--max-class-accuracy-drop", "0.1")
    assert code == 1, out + err
    rows = [line.split() for line in out.splitlines() if line.startswith("max_class_accuracy_drop")]
    assert rows == [["max_class_accuracy_drop", "[models:/lenet-int8/1]", "0.02", "0.02-0.02", "(10000)", "<=", "0.1",
                     "PASS"],
                    ["max_class_accuracy_drop", "[models:/lenet-prune/1]", "0.2", "0.2-0.2", "(10000)", "<=", "0.1",
                     "FAIL"]]
    assert client.get_model_version("lenet", "1").tags["mlflow_di.max_class_accuracy_drop"] == "0.2"
    assert run_gate(capsys, "--model-uri", history.uri, "--max-class-accuracy-drop", "0.2")[0] == 0


@pytest.mark.parametrize("args, message", [
    (["--model-uri", "models:/nothing/1", "--min-idc", "0.5"], "cannot find models:/nothing/1"),
    (["--model-uri", "models:/lenet/1"], "no threshold given"),
    (["--model-uri", "model.onnx", "--min-idc", "0.5"], "not a registered model version")])
def test_gate_errors_exit_2_with_one_line(client, history, capsys, args, message):
    code, out, err = run_gate(capsys, *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_pinned_runs_are_the_only_evidence_and_the_tags_name_them(client, history, capsys):
    old = [run for run in client.search_runs([e.experiment_id for e in client.search_experiments()],
                                             "tags.`mlflow_di.command` = 'coverage'")
           if run.data.metrics.get("idc") == 0.40][0].info.run_id
    code, out, _ = run_gate(capsys, "--model-uri", history.uri, "--min-idc", "0.5", "--runs", old)
    assert code == 1  # the old run's 0.40, not the newest run's 0.62
    tags = client.get_model_version("lenet", "1").tags
    assert tags["mlflow_di.idc"] == "0.4" and tags["mlflow_di.gate_evidence"] == old
    code, out, _ = run_gate(capsys, "--model-uri", history.uri, "--min-idc", "0.5")  # not pinned: the newest
    assert code == 0 and client.get_model_version("lenet", "1").tags["mlflow_di.idc"] == "0.62"
    code, _, err = run_gate(capsys, "--model-uri", history.uri, "--min-idc", "0.5", "--runs", "not-a-run")
    assert code == 2 and "--runs" in err


def test_gate_max_disagreement_rate_reads_each_exports_compress_run(client, history, capsys):
    code, out, _ = run_gate(capsys, "--model-uri", history.uri, "--max-disagreement-rate", "0.05")
    assert code == 1
    rows = [line.split() for line in out.splitlines() if line.startswith("disagreement_rate")]
    assert rows == [["disagreement_rate", "[models:/lenet-int8/1]", "0.008", "0.008-0.008", "(10000)", "<=", "0.05",
                     "PASS"],
                    ["disagreement_rate", "[models:/lenet-prune/1]", "0.1", "0.1-0.1", "(10000)", "<=", "0.05", "FAIL"]]
    assert client.get_model_version("lenet", "1").tags["mlflow_di.disagreement_rate"] == "0.1"


def test_realistic_success_rate_is_judged_and_noise_is_named(client, capsys):
    """An unconstrained campaign whose triggers are mostly noise, and a boundary campaign that searched inside
    the budget: --max-realistic-success-rate judges the second, names its strategy and budget, and the
    success-rate check, read from the first (it passes), says that it counts noise-like inputs."""
    from mlflow_server import fuzz_tags

    experiment = client.create_experiment("realism")
    model = register_version(client, "noisy")
    export = register_version(client, "noisy-int8")
    record_run(client, experiment, "fuzz", model, tags=fuzz_tags(export),
               metrics={"success_rate": 0.9, "mean_queries": 40, "triggers": 90, "fuzzed": 100,
                        "realistic_triggers": 3, "realistic_success_rate": 0.03,
                        "realism_max_linf": 32, "realism_min_ssim": 0.9})
    _fuzz_run(client, experiment, model, export, "boundary", {"success_rate": 0.4, "triggers": 40,
                                                               "realistic_triggers": 40, "realistic_success_rate": 0.4,
                                                               "realism_max_linf": 32, "realism_min_ssim": 0.9},
              LOOKED_INSIDE)
    code, out, _ = run_gate(capsys, "--model-uri", "models:/noisy/1", "--max-success-rate", "0.95",
                            "--max-realistic-success-rate", "0.02")
    assert code == 1
    rows = [line.split() for line in out.splitlines() if line.startswith(("success_rate", "realistic_success_rate"))]
    assert rows == [["success_rate", "[models:/noisy-int8/1]", "0.9", "0.9-0.9", "(10000)", "<=", "0.95", "PASS"],
                    ["realistic_success_rate", "[models:/noisy-int8/1]", "0.4", "0.4-0.4", "(10000)", "<=", "0.02", "FAIL"]]
    assert "only 3 of 90 triggers are within the realism budget" in out and "noise-like" in out
    assert ("(boundary inside L-inf <= 32, paper's and whole-image SSIM >= 0.9 where measurable, complete) on seeds "
            "digits[1300:]") in out
    version = client.get_model_version("noisy", "1")
    assert version.tags["mlflow_di.realistic_success_rate"] == "0.4" and "noise-like" in version.description
    assert "boundary inside L-inf" in version.description


def test_a_gate_check_on_a_fuzz_metric_is_one_record(client, capsys):
    """A toy check on a fuzz metric the campaigns already log (median queries per trigger), registered as one
    record: the gate reads it per export from the newest unconstrained campaign, names that run, passes and
    fails it, and does not judge an incomplete campaign's figure."""
    from mlflow_di.gate import CheckDeclaration, register_check, unregister_check

    experiment = client.create_experiment("declared-fuzz-check")
    model, export = register_version(client, "toy"), register_version(client, "toy-int8")
    register_check(CheckDeclaration("median_queries", "fuzz", "min_median_queries", greater_is_better=True,
                                    per_compressed=True, range="nonnegative",
                                    help="Fail if fuzzing needed fewer queries per trigger (median)."))
    try:
        run_id = _fuzz_run(client, experiment, model, export, "dflare", {"success_rate": 0.3, "median_queries": 30})
        code, out, _ = run_gate(capsys, "--model-uri", "models:/toy/1", "--threshold", "min_median_queries=20")
        row = next(line.split() for line in out.splitlines() if line.startswith("median_queries"))
        assert code == 0 and row == ["median_queries", "[models:/toy-int8/1]", "30", "exact", ">=", "20", "PASS"]
        assert f"fuzz run {run_id[:8]} (dflare, no realism budget, complete)" in out  # the run behind the figure
        code, out, _ = run_gate(capsys, "--model-uri", "models:/toy/1", "--threshold", "min_median_queries=50")
        assert code == 1 and "failed: median_queries" in out
        pruned = register_version(client, "toy-prune")  # searched only by a campaign the safety net cut short
        _fuzz_run(client, experiment, model, pruned, "dflare", {"success_rate": 0.3, "median_queries": 90,
                                                                 "timed_out_seeds": 4})
        code, _, err = run_gate(capsys, "--model-uri", "models:/toy/1", "--threshold", "min_median_queries=20")
        assert code == 2 and "could not judge" in err and "4 of 100 seeds stopped at the --timeout safety net" in err
    finally:
        unregister_check("median_queries")


#: the tags of a boundary campaign that searched inside the default realism budget
LOOKED_INSIDE = {"mlflow_di.fuzz_constraint": '{"max_linf": 32, "min_ssim": 0.9}', "mlflow_di.fuzz_ssim_measurable": "true"}


def _fuzz_run(client, experiment, model, export, strategy, metrics, tags=None, start_time=None):
    from mlflow_server import fuzz_tags

    run_id = record_run(client, experiment, "fuzz", model, tags={**fuzz_tags(export), **(tags or {})},
                        metrics={"fuzzed": 100, "mean_queries": 12, **metrics}, start_time=start_time)
    client.log_param(run_id, "strategy", strategy)
    client.log_param(run_id, "seed_data", "digits[1300:]")
    return run_id


def test_a_search_that_did_not_look_cannot_pass_the_realism_check(client, capsys):
    """A dflare campaign without a budget found only noise (realistic rate 0): not evidence, ERROR naming the
    command that makes it; a campaign under a looser budget is not either; one as strict as the check's is."""
    experiment = client.create_experiment("looked")
    model, export = register_version(client, "plain"), register_version(client, "plain-int8")
    _fuzz_run(client, experiment, model, export, "dflare", {"success_rate": 1.0, "triggers": 100,
                                                             "realistic_triggers": 0, "realistic_success_rate": 0.0})
    code, out, err = run_gate(capsys, "--model-uri", "models:/plain/1", "--max-realistic-success-rate", "0.1")
    assert code == 2
    assert ("no fuzz campaign against models:/plain-int8/1 searched inside a realism budget at least as strict as "
            "L-inf <= 32, paper's and whole-image SSIM >= 0.9 where measurable; run `mlflow-di fuzz --original "
            "models:/plain/1 --compressed models:/plain-int8/1 --seed-data digits[1300:] --strategy boundary "
            "--max-linf 32 --min-ssim 0.9` first") in err
    assert "context, not judged: dflare run" in err and "realistic success rate of 0 after the fact" in err

    _fuzz_run(client, experiment, model, export, "boundary", {"success_rate": 0.05, "triggers": 5,
                                                               "realistic_triggers": 5, "realistic_success_rate": 0.05},
              {"mlflow_di.fuzz_constraint": '{"max_linf": 64, "min_ssim": null}'})  # looser than the check's
    assert run_gate(capsys, "--model-uri", "models:/plain/1", "--max-realistic-success-rate", "0.1")[0] == 2
    # the same campaign qualifies for a check that names its looser budget
    code, out, _ = run_gate(capsys, "--model-uri", "models:/plain/1", "--max-realistic-success-rate", "0.1",
                            "--realism-budget", "linf=64")
    assert code == 0 and "realistic deviations judged inside L-inf <= 64" in out

    _fuzz_run(client, experiment, model, export, "boundary", {"success_rate": 0.05, "triggers": 5,
                                                               "realistic_triggers": 5, "realistic_success_rate": 0.05},
              LOOKED_INSIDE)
    code, out, _ = run_gate(capsys, "--model-uri", "models:/plain/1", "--max-realistic-success-rate", "0.1",
                            "--json-out", "verdict.json")
    assert code == 0
    check = json.loads(pathlib.Path("verdict.json").read_text())["checks"][0]
    assert check["evidence"]["strategy"] == "boundary" and check["evidence"]["complete"] is True
    assert check["evidence"]["budget"].startswith("L-inf <= 32, paper's and whole-image SSIM >= 0.9")


def test_on_images_too_small_for_ssim_an_l_inf_budget_is_as_strict_as_the_check(client, capsys):
    experiment = client.create_experiment("small")
    model, export = register_version(client, "tiny"), register_version(client, "tiny-int8")
    _fuzz_run(client, experiment, model, export, "boundary", {"success_rate": 0.02, "triggers": 2,
                                                               "realistic_triggers": 2, "realistic_success_rate": 0.02},
              {"mlflow_di.fuzz_constraint": '{"max_linf": 32, "min_ssim": null}', "mlflow_di.fuzz_ssim_measurable": "false"})
    assert run_gate(capsys, "--model-uri", "models:/tiny/1", "--max-realistic-success-rate", "0.1")[0] == 0


def test_an_incomplete_campaign_can_fail_a_check_but_never_pass_it(client, capsys):
    """Seeds stopped by the time safety net found no trigger for want of time: the campaign's success rate is a
    lower bound. Above the threshold it proves the FAIL; below it, it proves nothing (INCONCLUSIVE, saying so);
    a complete campaign recorded earlier is preferred over a newer incomplete one."""
    experiment = client.create_experiment("time-limited")
    model, export = register_version(client, "hurried"), register_version(client, "hurried-int8")
    _fuzz_run(client, experiment, model, export, "dflare", {"success_rate": 0.1, "triggers": 10, "timed_out_seeds": 7})
    code, out, err = run_gate(capsys, "--model-uri", "models:/hurried/1", "--max-success-rate", "0.2")
    assert code == 3 and "verdict: INCONCLUSIVE" in out
    assert "0.1 is only a lower bound (95% CI from 0.1), which cannot show success_rate <= 0.2" in out
    assert "is incomplete: 7 of 100 seeds stopped at the --timeout safety net" in out
    assert "INCOMPLETE" in client.get_model_version("hurried", "1").description
    code, out, _ = run_gate(capsys, "--model-uri", "models:/hurried/1", "--max-success-rate", "0.05")
    assert code == 1  # at least 10% of seeds deviate: more than 5% whatever the cut-short seeds would have given

    complete = _fuzz_run(client, experiment, model, export, "dflare", {"success_rate": 0.15, "triggers": 15},
                         start_time=1)  # older than the incomplete run, yet chosen: it can prove the check
    code, out, _ = run_gate(capsys, "--model-uri", "models:/hurried/1", "--max-success-rate", "0.2")
    assert code == 0 and f"fuzz run {complete[:8]} (dflare, no realism budget, complete)" in out


def test_a_model_name_with_both_kinds_of_quote_is_found_exactly(client):
    """MLflow's filter has no literal for it: LIKE with ' as a wildcard, then the exact tags."""
    import mlflow

    from mlflow_di.mlflow_edge import gate_evidence

    name = """it's a "model\""""
    for value, idc in ((name, 0.5), ("itXs a \"model\"", 0.9)):  # the second matches the LIKE pattern too
        with mlflow.start_run():
            mlflow.set_tags({"mlflow_di.command": "coverage", "mlflow_di.model_name": value})
            mlflow.log_metric("idc", idc)
    found = gate_evidence.search_recorded_runs("coverage", {"mlflow_di.model_name": name}, "idc", client)
    assert [run.data.metrics["idc"] for run in found] == [0.5]


def test_a_gate_check_is_one_record(registered_cnn, capsys):
    """A toy check, NC of the newest coverage run, registered as one record: the gate reads it from the
    coverage runs, `--threshold` sets it, and it passes, fails and is shown like the built-in ones."""
    from mlflow_di.cli import main
    from mlflow_di.gate import CheckDeclaration, register_check, unregister_check
    from mlflow_di.policy import _thresholds

    register_check(CheckDeclaration("nc", "coverage", "min_nc", greater_is_better=True, per_compressed=False,
                             help="Fail if NC of the newest coverage run is lower."))
    try:
        assert main(["coverage", "--model-uri", registered_cnn, "--train-data", "digits[0:200]",
                     "--test-data", "digits[300:400]", "--criteria", "idc,nc"]) == 0
        capsys.readouterr()
        code, out, _ = run_gate(capsys, "--model-uri", registered_cnn, "--threshold", "min_nc=0")
        assert code == 0 and any(line.split()[:1] == ["nc"] and line.split()[-1] == "PASS" for line in out.splitlines())
        code, out, _ = run_gate(capsys, "--model-uri", registered_cnn, "--threshold", "min_nc=1")
        assert code == 1 and "failed: nc" in out
        assert _thresholds("gate.thresholds", {"min_nc": 0.5}, "policy.yaml") == {"min_nc": 0.5}  # a policy names it too
    finally:
        unregister_check("nc")
    code, _, err = run_gate(capsys, "--model-uri", registered_cnn, "--threshold", "min_nc=0")
    assert code == 2 and "unknown threshold min_nc" in err


# ------------------------------------------------------------------------------ three outcomes
def test_a_figure_whose_interval_holds_its_threshold_is_inconclusive_and_so_is_the_verdict():
    interval = (0.0097, 0.0367)  # 10 of 500, Clopper-Pearson
    measured = [Measurement("disagreement_rate", 0.02, "c", interval=interval, n=500, interval_method="Clopper-Pearson")]
    verdict = decide(URI, Thresholds(max_disagreement_rate=0.02), measured)
    check = verdict.checks[0]
    assert (verdict.outcome, check.outcome, verdict.exit_code, verdict.passed) == ("INCONCLUSIVE", "INCONCLUSIVE", 3, False)
    assert "0.0097-0.0367 (Clopper-Pearson, n=500 images) holds the threshold" in check.message
    assert "no amount of evidence at this value would decide: it equals the threshold" in check.message
    assert verdict.summary() == "inconclusive: 0/1 checks passed; inconclusive: disagreement_rate [c]; per export: c 0/1"
    counted = {how: decide(URI, Thresholds(max_disagreement_rate=0.02), measured, inconclusive_as=how)
               for how in ("fail", "pass", "error")}
    assert {how: (v.outcome, v.exit_code) for how, v in counted.items()} == {
        "fail": ("FAIL", 1), "pass": ("PASS", 0), "error": ("ERROR", 2)}
    assert "counted as an error by --inconclusive error" in counted["error"].cause
    again = Verdict.from_json(verdict.to_json())
    assert again == verdict and again.checks[0].outcome == "INCONCLUSIVE" and again.checks[0].n == 500


def test_a_fail_outweighs_an_error_and_an_error_outweighs_inconclusive():
    fail = Measurement("success_rate", 0.9, "c", interval=(0.8, 0.95), n=100)
    undecided = Measurement("disagreement_rate", 0.02, "c", interval=(0.01, 0.03), n=500)
    thresholds = Thresholds(max_success_rate=0.5, max_disagreement_rate=0.02, min_idc=0.5)
    assert decide(URI, thresholds, [fail, undecided]).outcome == "FAIL"  # idc missing, still FAIL
    assert decide(URI, thresholds, [undecided]).outcome == "ERROR"  # idc missing
    assert decide(URI, Thresholds(max_disagreement_rate=0.02), [undecided]).outcome == "INCONCLUSIVE"


def test_an_inconclusive_gate_says_so_everywhere_and_never_moves_the_alias(client, capsys, tmp_path):
    """The disagreement rate equals the limit (10 of 500 against 0.02): exit 3, the interval and n in the console,
    verdict.json, the tags and the description; the alias is not moved, and taken off this version if it held it."""
    from mlflow_server import as_recorded

    experiment = client.create_experiment("undecided")
    model = register_version(client, "unsure")
    metrics = as_recorded({"idc": 0.9, "idc_reachable_low": 0.85, "idc_reachable_high": 0.95, "idc_reachable_n": 800})
    record_run(client, experiment, "coverage", model, metrics)
    record_export(client, experiment, model, "prune", {"accuracy_drop": 0.0, "disagreement_rate": 0.02,
                                                       "disagreement_rate_low": 0.0097, "disagreement_rate_high": 0.0367,
                                                       "disagreement_rate_n": 500}, [])
    client.set_registered_model_alias("unsure", "champion", "1")
    code, out, err = run_gate(capsys, "--model-uri", "models:/unsure/1", "--min-idc", "0.5",
                              "--max-disagreement-rate", "0.02", "--promote-alias", "champion", "--json-out",
                              str(tmp_path / "verdict.json"), "--junit-xml", str(tmp_path / "gate.xml"))
    assert code == 3, out + err
    row = next(line.split() for line in out.splitlines() if line.startswith("disagreement_rate"))
    assert row == ["disagreement_rate", "[models:/unsure-prune/1]", "0.02", "0.0097-0.0367", "(500)", "<=", "0.02",
                   "INCONCLUSIVE"]
    assert "verdict: INCONCLUSIVE" in out and "alias 'champion' removed from this version" in out
    assert "champion" not in client.get_registered_model("unsure").aliases
    written = json.loads((tmp_path / "verdict.json").read_text())
    check = next(c for c in written["checks"] if c["metric"] == "disagreement_rate")
    assert written["outcome"] == "INCONCLUSIVE" and check["outcome"] == "INCONCLUSIVE" and check["n"] == 500
    assert check["interval"] == [0.0097, 0.0367] and check["interval_method"] == "Clopper-Pearson"
    tags = client.get_model_version("unsure", "1").tags
    assert tags["mlflow_di.verdict"] == "INCONCLUSIVE" and tags["mlflow_di.disagreement_rate_result"] == "INCONCLUSIVE"
    assert tags["mlflow_di.disagreement_rate_interval"] == "0.0097-0.0367 (95% CI, n=500, Clopper-Pearson)"
    assert tags["mlflow_di.idc_result"] == "PASS"
    description = client.get_model_version("unsure", "1").description
    assert description.startswith("## mlflow-di gate: INCONCLUSIVE") and "0.0097-0.0367 (500)" in description
    assert "**inconclusive**: the evidence cannot decide" in description
    failure = ET.parse(tmp_path / "gate.xml").getroot().find(".//failure")
    assert failure.get("type") == "inconclusive" and failure.get("message").startswith("INCONCLUSIVE: value 0.02")
    code, out, _ = run_gate(capsys, "--model-uri", "models:/unsure/1", "--max-disagreement-rate", "0.02",
                            "--inconclusive", "pass", "--promote-alias", "champion")
    assert code == 0 and "INCONCLUSIVE (counts as pass)" in out  # an advisory gate, on purpose


def test_a_figure_recorded_without_its_interval_decides_nothing(client, capsys):
    experiment = client.create_experiment("older")
    model = register_version(client, "old")
    record_run(client, experiment, "coverage", model, {"idc": 0.9, "idc_reachable": 0.9}, sized=False)
    code, out, _ = run_gate(capsys, "--model-uri", "models:/old/1", "--min-idc", "0.5")
    assert code == 3
    assert "recorded idc_reachable without its 95% interval (by an older mlflow-di), so it cannot decide min_idc" in out
    assert next(line.split() for line in out.splitlines() if line.startswith("idc"))[2:4] == ["none", "recorded"]


def test_min_idc_after_a_classic_only_coverage_run_says_idc_was_not_computed(client, capsys):
    experiment = client.create_experiment("classic-only")
    model = register_version(client, "classic")
    run_id = record_run(client, experiment, "coverage", model, {"nc": 0.4, "kmnc": 0.3})
    client.log_param(run_id, "criteria", "nc,kmnc")
    code, _, err = run_gate(capsys, "--model-uri", "models:/classic/1", "--min-idc", "0.5")
    assert code == 2
    assert (f"coverage run {run_id} of models:/classic/1 computed nc,kmnc but not idc (the newest coverage run has "
            "none); run `mlflow-di coverage --model-uri models:/classic/1 --criteria idc,...") in err


def _state(client, name: str, version: str = "1") -> tuple:
    """What a reader sees of a version: its verdict tag, the reason an ERROR carries, the verdict heading of its
    description, and whether the alias champion points at it."""
    seen = client.get_model_version(name, version)
    heading = (seen.description or "").split("\n", 1)[0]
    aliases = client.get_registered_model(name).aliases
    return (seen.tags.get("mlflow_di.verdict"), seen.tags.get("mlflow_di.verdict_reason", ""), heading,
            str(aliases.get("champion")) == version)


def _consistent(state: tuple) -> bool:
    """All old, all new, or ERROR with a reason: a PASS or FAIL tag is the heading's, and champion is on the
    version only when it passed; an ERROR says why."""
    verdict, reason, heading, champion = state
    if verdict == "ERROR":
        return bool(reason)
    return heading.split()[:4] == ["##", "mlflow-di", "gate:", verdict] and champion == (verdict == "PASS")


@pytest.mark.parametrize("first, second", [(("--max-success-rate", "0.9"), ("--max-success-rate", "0.5")),
                                           (("--max-success-rate", "0.5"), ("--max-success-rate", "0.9"))],
                         ids=["pass-then-fail", "fail-then-pass"])
def test_a_gate_killed_after_any_of_its_writes_leaves_a_verdict_whole_or_an_error_with_its_reason(
        client, history, capsys, monkeypatch, first, second):
    """kill -9 cannot run a handler: what it leaves is the state after the last write done. Every write the
    second gate makes is watched, and the version is read after each: never half of one verdict."""
    from mlflow import MlflowClient

    assert run_gate(capsys, "--model-uri", history.uri, *first, "--promote-alias", "champion")[0] in (0, 1)
    before = _state(client, "lenet")
    assert _consistent(before) and before[0] in ("PASS", "FAIL")
    seen = []
    for method in ("set_model_version_tag", "delete_model_version_tag", "update_model_version",
                   "set_registered_model_alias", "delete_registered_model_alias"):
        original = getattr(MlflowClient, method)

        def watched(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            seen.append(_state(client, "lenet"))
            return result
        monkeypatch.setattr(MlflowClient, method, watched)
    code, out, err = run_gate(capsys, "--model-uri", history.uri, *second, "--promote-alias", "champion")
    assert code in (0, 1), out + err
    assert len(seen) >= 5 and seen[-1][0] in ("PASS", "FAIL") and seen[-1][0] != before[0]
    torn = [state for state in seen if not _consistent(state)]
    assert torn == [], torn


def test_a_write_refused_midway_leaves_error_with_the_reason_in_tag_and_description(client, history, capsys,
                                                                                      monkeypatch):
    """The alias move is refused (a server that asks MANAGE to remove an alias): the version says ERROR and why,
    in its tag and description; the gate run is FAILED, not RUNNING."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED

    assert run_gate(capsys, "--model-uri", history.uri, "--max-success-rate", "0.9", "--promote-alias", "champion")[0] == 0

    def refused(self, name, alias):
        raise MlflowException("Permission denied", error_code=PERMISSION_DENIED)
    monkeypatch.setattr(MlflowClient, "delete_registered_model_alias", refused)
    code, out, err = run_gate(capsys, "--model-uri", history.uri, "--max-success-rate", "0.5", "--promote-alias",
                              "champion")
    assert code == 2 and err.strip().endswith("may not remove the alias 'champion' from models:/lenet/1 (needs MANAGE "
                                              "permission on the registered model)"), err
    verdict, reason, heading, champion = _state(client, "lenet")
    assert (verdict, heading.split()[:4], champion) == ("ERROR", ["##", "mlflow-di", "gate:", "ERROR"], True)
    assert "could not finish writing its verdict" in reason and "remove the alias 'champion'" in reason
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`mlflow_di.command` = 'gate'")
    assert [r.info.status for r in runs if r.info.status != "FINISHED"] == ["FAILED"]
