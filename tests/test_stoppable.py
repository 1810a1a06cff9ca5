"""A model that never returns (an ONNX Loop with a trip count of 10^15) is stopped: by SIGTERM or Ctrl-C within
seconds, with one line and no run left RUNNING, and by the stated limit on one call (fuzz's --timeout, or
MLFLOW_DI_MAX_CALL_SECONDS) with one line naming the model."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mlflow_di.models import stoppable


def forever_onnx(path, side: int = 8) -> str:
    """A classifier of (N, 1, side, side) images into 10 classes whose Loop adds 1 to its input 10^15 times."""
    import onnx
    from onnx import TensorProto, helper

    shape = ["n", 1, side, side]
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, shape)],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "go", "x"], ["y"], body=body), helper.make_node("Flatten", ["y"], ["flat"]),
         helper.make_node("MatMul", ["flat", "w"], ["logits"])],
        "forever", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])],
        [helper.make_tensor("trips", TensorProto.INT64, [], [10**15]), helper.make_tensor("go", TensorProto.BOOL, [], [True]),
         helper.make_tensor("w", TensorProto.FLOAT, [side * side, 10],
                            np.random.default_rng(0).random(side * side * 10).astype(np.float32))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def never_returns(tmp_path_factory):
    return forever_onnx(tmp_path_factory.mktemp("forever") / "forever.onnx")


def test_a_call_past_its_limit_is_stopped_naming_the_model_and_who_stated_the_limit(never_returns):
    from mlflow_di.models.classifier import OnnxClassifier

    model = OnnxClassifier(never_returns, name="models:/forever/1")
    started = time.monotonic()
    with stoppable.call_limit(1.0, "fuzz --timeout 1"), pytest.raises(stoppable.CallStopped) as stopped:
        model.predict_proba(np.zeros((2, 8, 8, 1), np.uint8))
    assert time.monotonic() - started < 5
    assert str(stopped.value).startswith("models:/forever/1: one call ran for more than 1 s and was stopped "
                                         "(fuzz --timeout 1)")
    assert stoppable._watch.calls == set()  # nothing left registered


def test_the_stricter_limit_holds_and_the_environment_states_the_default(monkeypatch):
    monkeypatch.delenv("MLFLOW_DI_MAX_CALL_SECONDS", raising=False)
    assert stoppable.current_limit()[0] == stoppable.DEFAULT_LIMIT
    monkeypatch.setenv("MLFLOW_DI_MAX_CALL_SECONDS", "40")
    with stoppable.call_limit(60, "fuzz --timeout 60"):
        assert stoppable.current_limit() == (40.0, "MLFLOW_DI_MAX_CALL_SECONDS")
        with stoppable.call_limit(5, "fuzz --timeout 5"):
            assert stoppable.current_limit() == (5.0, "fuzz --timeout 5")
    for bad in ("0", "-1", "inf", "soon"):
        monkeypatch.setenv("MLFLOW_DI_MAX_CALL_SECONDS", bad)
        with pytest.raises(stoppable.UserError, match="MLFLOW_DI_MAX_CALL_SECONDS must be a positive number"):
            stoppable.current_limit()


def test_a_call_that_returns_gives_onnx_runtimes_own_answer(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weights = np.random.default_rng(1).random((4, 3)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
                              [numpy_helper.from_array(weights, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "m.onnx")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).random((5, 4)).astype(np.float32)
    with stoppable.call_limit(30, "a test"):
        answer = stoppable.run(session, {"x": x}, "m")[0]
    assert np.array_equal(answer, session.run(None, {"x": x})[0])
    assert stoppable._watch.calls == set()


def _fuzz(never_returns, store, *extra) -> subprocess.Popen:
    return _command("fuzz", never_returns, store, *extra)


def _command(command: str, never_returns, store, *extra) -> subprocess.Popen:
    """``mlflow-di fuzz`` or ``robustness`` of a PyTorch digits CNN against the never-returning ONNX model."""
    from mlflow_di.models import zoo
    import torch

    from mlflow_di.models.torch_model import TorchModel

    original = store.parent / "digits-cnn.pt"
    model = TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing, name="digits-cnn")
    torch.save({"module": model.module, "mlflow_di": {"preprocessing": model.preprocessing.to_dict()}}, original)
    _running_runs(store)  # the store made here first: polled while the command creates it, its tables could race
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "PYTHONUNBUFFERED": "1"}
    argv = {"fuzz": ["--original", str(original), "--compressed", never_returns, "--seed-data", "digits[0:4]",
                     "--num-seeds", "4", "--out-dir", str(store.parent / "campaign")],
            "robustness": ["--model-uri", str(original), "--compressed", never_returns, "--data", "digits[0:4]",
                           "--corruptions", "gaussian_noise", "--severities", "1"]}[command]
    return subprocess.Popen([sys.executable, "-m", "mlflow_di.cli", command, *argv, *extra], cwd=store.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _running_runs(store) -> list:
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(f"sqlite:///{store}")
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    return client.search_runs(experiments, "attributes.status = 'RUNNING'") if experiments else []


def _wait_for_the_run(store, process, seconds: float = 120) -> None:
    """Until the command's run exists (the models are loaded and it calls the compressed model)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        if _running_runs(store):
            time.sleep(2)  # inside the never-ending call by now
            return
        time.sleep(0.5)
    raise AssertionError(f"no run started: {process.poll()} {process.stderr.read() if process.poll() else ''}")


@pytest.mark.parametrize("command, stop, code", [("fuzz", signal.SIGTERM, 143), ("fuzz", signal.SIGINT, 130),
                                                  ("robustness", signal.SIGTERM, 143)],
                         ids=["fuzz-sigterm", "fuzz-sigint", "robustness-sigterm"])
def test_a_signal_ends_a_command_inside_a_call_that_never_returns(command, stop, code, never_returns, tmp_path):
    store = tmp_path / "mlflow.db"
    process = _command(command, never_returns, store)
    try:
        _wait_for_the_run(store, process)
        signalled = time.monotonic()
        process.send_signal(stop)
        _, err = process.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    lines = err.strip().splitlines()
    assert process.returncode == code and took < 10, (process.returncode, took, err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert _running_runs(store) == []


def test_fuzz_timeout_stops_a_call_that_never_returns_in_one_line(never_returns, tmp_path):
    store = tmp_path / "mlflow.db"
    started = time.monotonic()
    process = _fuzz(never_returns, store, "--timeout", "5")
    try:
        _, err = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    lines = err.strip().splitlines()
    assert process.returncode == 2, err
    assert len(lines) == 1 and "one call ran for more than 5 s and was stopped (fuzz --timeout 5)" in lines[0], err
    assert _running_runs(store) == []
    assert time.monotonic() - started < 120
