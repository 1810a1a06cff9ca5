"""A compression method is one module plus its declaration: a toy method registered here runs through
`mlflow-di compress` (registered, measured, reported) with no edit in commands/, and the command asks each
method's declaration what it needs instead of naming methods."""
import copy

import mlflow
import pytest
import torch

from mlflow_di.cli import main
from mlflow_di.errors import UserError
from mlflow_di.compression.export import export_onnx
from mlflow_di.compression.declarations import (
    METHODS,
    MethodDeclaration,
    method_declaration,
    methods_that,
    register_method,
    unregister_method,
)
from mlflow_di.settings import OptionSpec


def _rounded_weights(job) -> dict:
    """Every weight rounded to a multiple of its ``step`` option, then exported in float: a 'compression' a user
    might try."""
    step = job.settings.step
    module = copy.deepcopy(job.module)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.round(parameter / step) * step)
    export = export_onnx(module, job.preprocessing, job.path, job.opset)
    return {"params": {"step": step, "opset": export.opset}, "exporter": export.exporter}


#: the toy's one option: the one edit that gives compress --step, the policy's compress.step and job.settings.step
STEP = OptionSpec("step", "Round each weight to a multiple of this.", "float", low=0, high=1, open=(True, False),
                  default=0.125)


@pytest.fixture()
def toy_method():
    register_method(MethodDeclaration("round-weights", "weights rounded to a step, exported in float", _rounded_weights,
                                      options=(STEP,)))
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
    assert '"step": 0.125' in version.tags["mlflow_di.params"]  # its option's declared default


def test_a_methods_option_is_one_edit_in_its_declaration(toy_method, registered_cnn, capsys):
    """The toy declares one option (STEP): compress --help lists it under the method's heading, the command passes
    it to the method as its settings, its range refuses a bad value in one line, and a policy sets it by name."""
    assert main(["compress", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "round-weights options: --step FLOAT RANGE Round each weight to a multiple of this. [default: 0.125" in text
    code = main(["compress", "--model-uri", registered_cnn, "--method", toy_method, "--step", "0.25",
                 "--eval-data", "digits[1700:]", "--no-benefit"])
    assert code == 0, capsys.readouterr().err
    version = mlflow.MlflowClient().get_model_version("cnn-round-weights", "1")
    assert '"step": 0.25' in version.tags["mlflow_di.params"]
    assert main(["compress", "--model-uri", registered_cnn, "--method", toy_method, "--step", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--step" in err and "0<x<=1" in err
    assert main(["compress", "--model-uri", registered_cnn, "--method", "fp32", "--step", "0.5"]) == 2
    assert "--step is an option of round-weights; add it to --method (got fp32)" in capsys.readouterr().err


def test_a_policy_sets_a_methods_option_checked_by_its_declared_range(toy_method):
    import click

    from mlflow_di.commands.pipeline import _step_arguments, command
    from mlflow_di.policy import parse_policy

    gate = "gate: {thresholds: {min_idc: 0.5}}\n"
    with click.Context(command) as ctx:
        policy = parse_policy("compress: {methods: [round-weights], step: 0.5}\n" + gate, "p.yaml")
        assert _step_arguments(ctx, policy, "models:/m/1")["compress"]["step"] == 0.5
        with pytest.raises(UserError, match=r"^p.yaml: compress.step: 2.0 is not in the range 0<x<=1"):
            _step_arguments(ctx, parse_policy("compress: {methods: [round-weights], step: 2}\n" + gate, "p.yaml"),
                            "models:/m/1")
        with pytest.raises(UserError, match="compress.step: 'fine' is not a valid float range"):
            _step_arguments(ctx, parse_policy("compress: {methods: [round-weights], step: fine}\n" + gate, "p.yaml"),
                            "models:/m/1")
        with pytest.raises(UserError, match="^p.yaml: compress.methods is required$"):  # an option is no method
            parse_policy("compress: {step: 0.5}\n" + gate, "p.yaml")
        with pytest.raises(UserError, match="^p.yaml: compress.step must be a value or a list of values, got"):
            parse_policy("compress: {methods: [round-weights], step: {fine: 1}}\n" + gate, "p.yaml")
        unregister_method(toy_method)  # undeclared, its option is an unknown key like any other
        with pytest.raises(UserError, match="^p.yaml: unknown key compress.step; known: methods, .*, weight_symmetry$"):
            _step_arguments(ctx, parse_policy("compress: {methods: [fp32], step: 0.5}\n" + gate, "p.yaml"),
                            "models:/m/1")


def test_settings_are_a_frozen_record_checked_by_the_declaration(toy_method):
    declared = method_declaration(toy_method)
    assert declared.configure().step == 0.125 and declared.configure({"step": 0.5}).step == 0.5
    with pytest.raises(UserError, match="round-weights's step must be in \\(0, 1\\], got 3"):
        declared.configure({"step": 3})
    with pytest.raises(UserError, match="has no option 'steps'; its options: step"):
        declared.configure({"steps": 0.5})
    assert method_declaration("int8-static").configure({"recipe": "s8s8"}).name == "s8s8"  # its settings: a Recipe


def test_unknown_methods_are_listed_with_the_registered_ones(toy_method, capsys):
    assert main(["compress", "--model-uri", "models:/absent/1", "--method", "int4-magic"]) == 2
    err = capsys.readouterr().err
    assert "int4-magic" in err and "round-weights" in err and len(err.strip().splitlines()) == 1


def test_options_for_a_selective_method_name_it(registered_cnn, capsys):
    assert main(["compress", "--model-uri", registered_cnn, "--method", "int8-dynamic", "--keep-float", "fc"]) == 2
    err = capsys.readouterr().err.strip()
    assert "apply to int8-static only; add it to --method (got int8-dynamic)" in err


def test_a_methods_option_named_like_one_of_compress_own_is_refused_in_one_line():
    from mlflow_di.commands import compress

    register_method(MethodDeclaration("clash", "an option named like compress's own", _rounded_weights,
                                      options=(OptionSpec("amount", "Clashes with --amount.", "float", default=0.5),)))
    try:
        with pytest.raises(UserError, match="^a declared option 'amount' is also an option of mlflow-di compress itself"):
            compress.command.params
    finally:
        unregister_method("clash")
    assert "recipe" in {param.name for param in compress.command.params}  # and the command is whole again
