"""A compression method is one module plus its declaration: a toy method registered here runs through
`mlflow-di compress` (registered, measured, reported) with no edit in commands/, and the command asks each
method's declaration what it needs instead of naming methods."""
import copy

import mlflow
import pytest
import torch

from mlflow_di.cli import main
from mlflow_di.compression.export import export_onnx
from mlflow_di.compression.methods import (
    METHODS,
    MethodDeclaration,
    method_declaration,
    methods_that,
    register_method,
    unregister_method,
)


def _rounded_weights(job) -> dict:
    """Every weight rounded to a multiple of 1/8, then exported in float: a 'compression' a user might try."""
    module = copy.deepcopy(job.module)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.round(parameter * 8) / 8)
    export = export_onnx(module, job.preprocessing, job.path, job.opset)
    return {"params": {"step": 0.125, "opset": export.opset}, "exporter": export.exporter}


@pytest.fixture()
def toy_method():
    register_method(MethodDeclaration("round-weights", "weights rounded to 1/8, exported in float", _rounded_weights))
    yield "round-weights"
    unregister_method("round-weights")


def test_the_built_in_methods_say_what_they_need():
    assert list(METHODS) == ["fp32", "int8-static", "int8-dynamic", "prune-l1", "prune-structured", "int8-nncf"]
    assert methods_that("needs_calibration") == ["int8-static", "int8-nncf"]
    assert methods_that("selective") == ["int8-static"]
    assert methods_that("integer") == ["int8-static", "int8-dynamic", "int8-nncf"]
    assert [name for name in METHODS if METHODS[name].made_for] == ["int8-nncf"]  # scored on OpenVINO too
    assert methods_that("prunes") == ["prune-l1", "prune-structured"]
    assert method_declaration("fp32").summary.startswith("plain ONNX export")


def test_a_registered_method_runs_through_the_command(toy_method, registered_cnn, capsys):
    code = main(["compress", "--model-uri", registered_cnn, "--method", toy_method, "--eval-data", "digits[1300:]"])
    assert code == 0, capsys.readouterr().err
    version = mlflow.MlflowClient().get_model_version("cnn-round-weights", "1")
    assert version.tags["mlflow_di.method"] == toy_method
    run = mlflow.MlflowClient().get_run(version.run_id)
    assert run.info.status == "FINISHED" and 0 <= run.data.metrics["disagreements"] <= 497
    assert "reference.disagreements" not in run.data.metrics  # not an integer method: no reference semantics
    assert "calib_data" not in run.data.params and "amount" not in run.data.params


def test_unknown_methods_are_listed_with_the_registered_ones(toy_method, capsys):
    assert main(["compress", "--model-uri", "models:/absent/1", "--method", "int4-magic"]) == 2
    err = capsys.readouterr().err
    assert "int4-magic" in err and "round-weights" in err and len(err.strip().splitlines()) == 1


def test_options_for_a_selective_method_name_it(registered_cnn, capsys):
    assert main(["compress", "--model-uri", registered_cnn, "--method", "int8-dynamic", "--keep-float", "fc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "apply to int8-static only; add it to --method (got int8-dynamic)" in err
