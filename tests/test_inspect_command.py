"""``mlflow-di inspect`` end to end: a registered model, a coverage run whose important neurons it labels."""
import json
import subprocess
import sys

import mlflow
import pytest

from mlflow_di.cli import main

pytestmark = pytest.mark.slow


def _runs(client, command):
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, f"tags.`mlflow_di.command` = '{command}'")


def test_inspect_labels_the_important_neurons_of_a_coverage_run(registered_cnn, mlflow_client, tmp_path, capsys):
    assert main(["coverage", "--model-uri", registered_cnn, "--train-data", "digits[0:600]",
                 "--test-data", "digits[600:900]", "--criteria", "idc", "--top-m", "4"]) == 0
    coverage_run = _runs(mlflow_client, "coverage")[0].info.run_id
    out = tmp_path / "inspect.json"
    assert main(["inspect", "--model-uri", registered_cnn, "--data", "digits[0:1200]", "--coverage", coverage_run,
                 "--measures", "pearson,mi,probe", "--tolerance", "0.5", "--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "important neuron" in printed and "inputs" in printed
    run = _runs(mlflow_client, "inspect")[0]
    assert run.info.status == "FINISHED" and run.data.params["coverage"] == coverage_run
    assert run.data.metrics["inputs_read"] <= 1200
    artifacts = {a.path for a in mlflow_client.list_artifacts(run.info.run_id, "inspection")}
    assert {"inspection/report.html", "inspection/heatmap_pearson.png", "inspection/heatmap_probe.png",
            "inspection/top_units_examples.png", "inspection/important_neurons.json"} <= artifacts
    summary = json.loads(out.read_text())
    unit_rows = [row for row in summary["table"] if row["measure"] != "probe"]
    assert unit_rows and all(isinstance(row["unit"], int) and row["name"] == f"unit {row['unit']}" for row in unit_rows)
    assert all(row["unit"] is None and row["group"] for row in summary["table"] if row["measure"] == "probe")
    assert len(summary["important_neurons"]) == 4 and summary["layer"]
    # the coverage run now shows the labels: a table and a section of its report
    labels = mlflow.artifacts.load_text(f"runs:/{coverage_run}/coverage/important_neuron_labels.json")
    assert json.loads(labels)[0]["strongest"]
    report = mlflow.artifacts.load_text(f"runs:/{coverage_run}/coverage/report.html")
    assert "What the important neurons respond to" in report and report.count("<footer>") == 1
    # inspecting the same coverage run again replaces its section rather than adding a second one
    assert main(["inspect", "--model-uri", registered_cnn, "--data", "digits[0:300]", "--coverage", coverage_run,
                 "--measures", "pearson", "--no-early-stop"]) == 0
    report = mlflow.artifacts.load_text(f"runs:/{coverage_run}/coverage/report.html")
    assert report.count("What the important neurons respond to") == 1 and "on 300 inputs" in report


def test_inspect_fits_the_important_neurons_itself_with_units_important(registered_cnn, mlflow_client, tmp_path):
    (tmp_path / "mine.py").write_text("HYPS = {'left_ink': lambda im, lab: im[:, :, :4].mean(axis=(1, 2, 3))}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["inspect", "--model-uri", registered_cnn, "--data", "digits[0:700]", "--units", "important",
                     "--top-m", "3", "--importance-inputs", "300", "--hypotheses", "builtin",
                     "--hypotheses", "mine:HYPS", "--measures", "spearman", "--no-early-stop"]) == 0
    finally:
        sys.path.remove(str(tmp_path))
    run = _runs(mlflow_client, "inspect")[0]
    assert run.data.metrics["inputs_read"] == 700 and "left_ink" in run.data.params["hypotheses"]
    result = json.loads(mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/inspection/result.json"))
    assert len(result["unit_indices"]) == 3 and list(result["group_units"]) == ["layer", "important"]


@pytest.mark.parametrize("args, fragment", [
    (["--hypotheses", "no_such_module_xyz:H"], "cannot import hypothesis module"),
    (["--layer", "nope"], "layer 'nope' is not in"),
    (["--measures", "kendall"], "unknown measures"),
    (["--coverage", "0123456789abcdef0123456789abcdef"], "cannot read run"),
])
def test_bad_input_is_one_line_and_leaves_no_run(registered_cnn, mlflow_client, tmp_path, args, fragment):
    result = subprocess.run([sys.executable, "-m", "mlflow_di.cli", "inspect", "--model-uri", registered_cnn,
                             "--data", "digits[0:50]", *args], capture_output=True, text=True,
                            env=_env(mlflow_client), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and fragment in result.stderr
    assert not _runs(mlflow_client, "inspect")


def _env(client):
    import os

    return dict(os.environ, MLFLOW_TRACKING_URI=client.tracking_uri)
