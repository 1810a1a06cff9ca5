"""The command line: bad input gives one line and exit code 2, runs never stay RUNNING, and the
demo registers a model in a fresh store."""
import subprocess
import sys

import mlflow
import pytest

from mlflow_di.mlflow_edge import runs as tracking
from mlflow_di.cli import main
from mlflow_di.errors import UserError

CLI = [sys.executable, "-m", "mlflow_di.cli"]


def run_cli(*args, cwd):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_bad_input_is_one_line_exit_2_without_traceback(tmp_path):
    result = run_cli("describe", "missing.onnx", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "mlflow-di: error: model file 'missing.onnx' does not exist; give models:/NAME/VERSION, "
        "models:/NAME@ALIAS, runs:/RUN_ID/PATH, an MLflow model folder, a .pt/.pth/.pkl/.onnx/.tflite/.lite file "
        "or keras:ARCH:FILE.h5"]


@pytest.mark.parametrize("args, fragment", [
    (["describe", "models:/absent/3"], "Registered Model with name=absent not found"),
    (["import-keras", "--arch", "lenet9", "--weights", __file__, "--register-as", "x"], "unknown architecture"),
    (["describe"], "Missing argument"),
])
def test_errors_in_process(tracking_uri, capsys, args, fragment):
    assert main(args) == 2
    assert fragment in capsys.readouterr().err


def test_failed_work_marks_the_run_failed_and_keeps_what_was_logged(tracking_uri):
    with pytest.raises(UserError):
        with tracking.tracked_run("fails") as run:
            mlflow.log_metric("done_so_far", 3.0)
            raise UserError("bad input")
    finished = mlflow.get_run(run.info.run_id)
    assert finished.info.status == "FAILED"
    assert finished.data.metrics["done_so_far"] == 3.0
    with pytest.raises(KeyboardInterrupt):
        with tracking.tracked_run("stopped") as run:
            raise KeyboardInterrupt
    assert mlflow.get_run(run.info.run_id).info.status == "KILLED"


def test_describe_onnx_and_torch_files(tmp_path):
    from test_models import tiny_onnx, tiny_torch

    onnx_file = tiny_onnx(tiny_torch(), tmp_path / "tiny.onnx")
    described = run_cli("describe", str(onnx_file), cwd=tmp_path)
    assert described.returncode == 0, described.stderr
    assert "onnxruntime (nodes listed below; white-box commands use its view as torch layers)" in described.stdout
    assert "Gemm" in described.stdout
    assert "classes:        3" in described.stdout and "4x4x1" in described.stdout


def test_describe_each_backend(tmp_path, shared_dir):
    dflare = shared_dir / "models" / "dflare"
    lite = run_cli("describe", str(dflare / "lenet5-quan.lite"), cwd=tmp_path)
    assert lite.returncode == 0, lite.stderr
    assert "FULLY_CONNECTED" in lite.stdout and "tflite" in lite.stdout
    keras = run_cli("describe", f"keras:lenet5:{shared_dir / 'models' / 'deepimportance' / 'LeNet5.h5'}", cwd=tmp_path)
    assert keras.returncode == 0, keras.stderr
    assert "fc2" in keras.stdout and "84" in keras.stdout
