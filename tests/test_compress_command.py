"""`mlflow-di compress` end to end on a small registered model: every method registers a version
with lineage, logs accuracies, and `mlflow-di fuzz` accepts each export; bad input fails in one line."""
import json

import mlflow
import numpy as np
import pytest

from mlflow_di.cli import main

METHODS = ("fp32", "int8-static", "int8-dynamic", "prune-l1", "prune-structured")


def test_every_method_registers_an_export_with_lineage_that_fuzz_accepts(registered_cnn, tmp_path, capsys):
    code = main(["compress", "--model-uri", registered_cnn, "--method", ",".join(METHODS), "--amount", "0.1",
                 "--calib-data", "digits[0:200]", "--eval-data", "digits[1300:]"])
    assert code == 0, capsys.readouterr().err
    client = mlflow.MlflowClient()
    for method in METHODS:
        version = client.get_model_version(f"cnn-{method}", "1")
        assert version.tags["mlflow_di.source_uri"] == registered_cnn
        assert version.tags["mlflow_di.source_name"] == "cnn" and version.tags["mlflow_di.source_version"] == "1"
        assert version.tags["mlflow_di.method"] == method
        assert "amount" in json.loads(version.tags["mlflow_di.params"]) or not method.startswith("prune")
        run = client.get_run(version.run_id)
        assert run.data.tags["mlflow_di.command"] == "compress" and run.info.status == "FINISHED"
        metrics = run.data.metrics
        assert metrics["eval_images"] == 497 and 0 <= metrics["disagreements"] <= 497
        assert metrics["accuracy_drop"] == pytest.approx(metrics["source_accuracy"] - metrics["compressed_accuracy"])
        assert metrics["compressed_size_bytes"] > 0
        out = tmp_path / f"fuzz-{method}.json"
        assert main(["fuzz", "--original", registered_cnn, "--compressed", f"models:/cnn-{method}/1",
                     "--seed-data", "digits[1300:1305]", "--max-queries", "30", "--out-dir", str(tmp_path / method),
                     "--json-out", str(out)]) == 0
        assert json.loads(out.read_text())["seeds"] == 5
    sparsity = client.get_run(client.get_model_version("cnn-prune-l1", "1").run_id).data.metrics["sparsity"]
    assert sparsity == pytest.approx(0.1, abs=0.01)
    assert "quantized layers: conv1.0" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["--method", "int8-static"], "needs calibration data"),
    (["--method", "int8-magic"], "unknown compression method"),
    (["--method", "fp32,prune-l1", "--register-as", "x"], "--register-as names one model"),
])
def test_bad_compress_requests(registered_cnn, capsys, args, fragment):
    assert main(["compress", "--model-uri", registered_cnn, *args]) == 2
    assert fragment in capsys.readouterr().err


def test_pruning_needs_a_pytorch_source(tracking_uri, tmp_path, capsys, shared_dir):
    lite = shared_dir / "models" / "dflare" / "lenet5-quan.lite"
    assert main(["compress", "--model-uri", str(lite), "--method", "prune-l1"]) == 2
    assert "needs a PyTorch model" in capsys.readouterr().err
    assert not np.any([run.info.status == "RUNNING" for run in mlflow.search_runs(output_format="list",
                                                                                   search_all_experiments=True)])
