"""Runtimes as declarations: an export judged on the runtime that will serve it (ONNX Runtime, OpenVINO, or a
registered one), with the runtime, its version and the precision it computed in named beside every figure."""
import dataclasses
import importlib.util
import json

import mlflow
import numpy as np
import pytest

from mlflow_di.cli import main
from mlflow_di.errors import UserError
from mlflow_di.models.runtimes import RUNTIMES, Runtime, RuntimeChoice, parse_runtimes, register_runtime, unregister_runtime

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                                    reason="OpenVINO is not installed (pip install 'mlflow-di[openvino]')")


def test_a_runtime_is_named_with_an_optional_precision_checked_against_its_declaration():
    assert RuntimeChoice.parse(None) == RuntimeChoice("onnxruntime", "default")
    assert RuntimeChoice.parse("openvino:f32").label == "openvino:f32"
    assert RuntimeChoice.parse("openvino:f32").slug == "openvino-f32"
    assert [c.label for c in parse_runtimes("onnxruntime, openvino:bf16")] == ["onnxruntime", "openvino:bf16"]
    with pytest.raises(UserError, match="unknown runtime 'tensorrt'; known runtimes: onnxruntime, openvino"):
        RuntimeChoice.parse("tensorrt")
    with pytest.raises(UserError, match="offers the precisions default, f32, bf16, not 'int4'"):
        RuntimeChoice.parse("openvino:int4")
    with pytest.raises(UserError, match="offers the precisions default, not 'bf16'"):
        RuntimeChoice.parse("onnxruntime:bf16")
    with pytest.raises(UserError, match="names openvino twice"):
        parse_runtimes("openvino,onnxruntime,openvino")


def test_a_runtime_that_is_not_installed_is_one_line_naming_its_extra(registered_cnn, capsys):
    absent = dataclasses.replace(RUNTIMES["openvino"], module="openvino_is_not_installed_here")
    register_runtime(absent)
    try:
        code = main(["fuzz", "--original", registered_cnn, "--compressed", registered_cnn, "--runtime", "openvino",
                     "--seed-data", "digits[0:2]"])
        err = capsys.readouterr().err
    finally:
        register_runtime(dataclasses.replace(absent, module="openvino"))
    assert code == 2 and "Traceback" not in err
    assert "the runtime 'openvino' (OpenVINO CPU plugin) is not installed: pip install 'mlflow-di[openvino]'" in err
    assert len(err.strip().splitlines()) == 1


def _newest_fuzz_run():
    return mlflow.search_runs(search_all_experiments=True, filter_string="tags.`mlflow_di.command` = 'fuzz'",
                              order_by=["attributes.start_time DESC"], output_format="list")[0]


class _Shifted:
    """The toy runtime's model: ONNX Runtime's answers with class 0's logit raised by 2.0 (a runtime that
    computes differently, as a lower precision would), and a context naming the toy."""

    def __init__(self, path, preprocessing, name):
        from mlflow_di.models.classifier import OnnxClassifier

        self.inner = OnnxClassifier(path, preprocessing, name)
        self.preprocessing, self.name, self.path, self.origin = self.inner.preprocessing, self.inner.name, path, None
        self.provider = "toy (cpu)"

    def predict_proba(self, images, batch_size=None):
        logits = np.log(self.inner.predict_proba(images, batch_size) + 1e-12)
        logits[:, 0] += 2.0
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)

    def predict(self, images, batch_size=None):
        return self.predict_proba(images, batch_size).argmax(axis=1)

    @property
    def num_classes(self):
        return self.inner.num_classes

    @property
    def execution_context(self):
        from mlflow_di.models.execution import host_context

        return host_context("toy", "0.1", "CPU", precision="f32")


@pytest.fixture()
def toy_runtime():
    register_runtime(Runtime("toy", "a toy runtime", opens=("onnx",),
                             open=lambda path, preprocessing, name, device, precision: _Shifted(path, preprocessing, name)))
    yield
    unregister_runtime("toy")


def test_a_registered_runtime_works_in_compress_fuzz_and_gate_with_no_edit_in_commands(registered_cnn, toy_runtime,
                                                                                         tmp_path, capsys):
    assert main(["compress", "--model-uri", registered_cnn, "--method", "fp32", "--eval-data", "digits[1300:]",
                 "--runtime", "onnxruntime,toy", "--no-benefit"]) == 0
    out = capsys.readouterr().out
    assert "on toy 0.1 CPU (all optimizations, f32 (the host default), " in out
    client = mlflow.MlflowClient()
    version = client.get_model_version("cnn-fp32", "1")
    assert version.tags["mlflow_di.runtimes"] == "onnxruntime,toy"
    assert version.tags["mlflow_di.runtimes.toy.name"] == "toy" and version.tags["mlflow_di.runtimes.toy.toy"] == "0.1"
    metrics = client.get_run(version.run_id).data.metrics
    # fp32 on ONNX Runtime answers as the source; the toy's shifted logits move answers to class 0
    assert metrics["disagreements"] <= 2 and metrics["runtime.toy.disagreements"] > 10
    assert metrics["runtime.toy.top1_differs_from_first"] >= metrics["runtime.toy.disagreements"] - metrics["disagreements"]
    assert metrics["runtime.toy.disagreement_rate_low"] <= metrics["runtime.toy.disagreement_rate"] <= \
        metrics["runtime.toy.disagreement_rate_high"] and metrics["runtime.toy.disagreement_rate_n"] == 497

    # the gate judges the runtime it is asked for, and names it in the evidence
    verdict = tmp_path / "verdict.json"
    assert main(["gate", "--model-uri", "models:/cnn-fp32/1", "--max-disagreement-rate", "0.01", "--runtime", "toy",
                 "--json-out", str(verdict)]) == 1
    assert "the exports' answers judged as toy computes them" in capsys.readouterr().out
    check = next(c for c in json.loads(verdict.read_text())["checks"] if c["metric"] == "disagreement_rate")
    assert check["measured"] == pytest.approx(metrics["runtime.toy.disagreement_rate"])
    assert check["evidence"]["context"].startswith("toy 0.1 CPU")
    assert main(["gate", "--model-uri", "models:/cnn-fp32/1", "--max-disagreement-rate", "0.05",
                 "--runtime", "onnxruntime", "--json-out", str(verdict)]) == 0
    check = next(c for c in json.loads(verdict.read_text())["checks"] if c["metric"] == "disagreement_rate")
    assert check["evidence"]["context"].startswith("onnxruntime ")
    capsys.readouterr()
    # a runtime the export was never judged on is missing evidence, named as such
    assert main(["gate", "--model-uri", "models:/cnn-fp32/1", "--max-disagreement-rate", "0.05",
                 "--runtime", "openvino"]) == 2
    assert "judged models:/cnn-fp32/1 on onnxruntime,toy, not on openvino" in capsys.readouterr().out

    # a campaign against the export as the toy runs it finds the inputs the toy answers differently
    summary = tmp_path / "fuzz.json"
    assert main(["fuzz", "--original", registered_cnn, "--compressed", "models:/cnn-fp32/1", "--runtime", "toy",
                 "--seed-data", "digits[1300:1320]", "--max-queries", "40", "--out-dir", str(tmp_path / "c"),
                 "--json-out", str(summary)]) == 0
    assert json.loads(summary.read_text())["already_deviating"] > 0
    fuzz_run = _newest_fuzz_run()
    assert fuzz_run.data.tags["mlflow_di.runtime.name"] == "toy" and fuzz_run.data.params["runtime"] == "toy"
    # the gate's fuzz checks read only campaigns run on the runtime judged
    capsys.readouterr()
    assert main(["gate", "--model-uri", "models:/cnn-fp32/1", "--max-success-rate", "1.0",
                 "--runtime", "onnxruntime"]) == 2
    assert "on onnxruntime (campaigns against it ran on toy; run `mlflow-di fuzz ... --runtime onnxruntime`)" in \
        capsys.readouterr().out
    assert main(["gate", "--model-uri", "models:/cnn-fp32/1", "--max-success-rate", "1.0", "--runtime", "toy"]) == 0


@needs_openvino
def test_openvino_runs_an_export_as_onnx_runtime_does_and_names_its_precision(registered_cnn, tmp_path, capsys):
    from mlflow_di.data import load_images
    from mlflow_di.models.loading import load_classifier
    from mlflow_di.models.openvino_runtime import host_default_precision

    assert main(["compress", "--model-uri", registered_cnn, "--method", "int8-static,prune-l1",
                 "--calib-data", "digits[0:200]", "--eval-data", "digits[1300:]",
                 "--runtime", "onnxruntime,openvino,openvino:f32", "--no-benefit"]) == 0
    out = capsys.readouterr().out
    default = host_default_precision()
    assert f"on openvino {__import__('openvino').__version__.split('-')[0]} CPU (all optimizations, {default} " \
           "(the host default)" in out
    client = mlflow.MlflowClient()
    for method in ("int8-static", "prune-l1"):
        version = client.get_model_version(f"cnn-{method}", "1")
        assert version.tags["mlflow_di.runtimes.openvino.precision"] == default
        assert version.tags["mlflow_di.runtimes.openvino-f32.precision"] == "f32"
        assert version.tags["mlflow_di.runtimes.openvino-f32.precision_asked"] == "f32"
        metrics = client.get_run(version.run_id).data.metrics
        # on f32 the two runtimes compute one graph in one precision: at most a rounding tie apart
        assert metrics["runtime.openvino-f32.top1_differs_from_first"] <= 2
        assert metrics["runtime.openvino-f32.max_probability_difference"] < (0.05 if method.startswith("int8") else 1e-3)

    # the same file on both runtimes, image by image, as fuzz and the gate see it
    images = load_images("digits[1300:]").images
    ort_model = load_classifier("models:/cnn-int8-static/1")
    ov_model = load_classifier("models:/cnn-int8-static/1", runtime="openvino:f32")
    assert ov_model.execution_context.runtime == "openvino" and ov_model.execution_context.precision == "f32"
    assert ov_model.preprocessing == ort_model.preprocessing  # read from the export's metadata by either runtime
    differs = np.sum(ort_model.predict(images) != ov_model.predict(images))
    assert differs <= 2

    # describe says what each runtime will compute
    assert main(["describe", "models:/cnn-int8-static/1", "--runtime", "openvino"]) == 0
    out = capsys.readouterr().out
    assert f"runtime:        openvino {__import__('openvino').__version__.split('-')[0]} CPU" in out
    assert "kernels:        Convolution x" in out and " in u8" in out  # the QDQ pairs fused into int8 kernels

    # one export compared across runtimes: the original as ONNX Runtime runs it, the export as OpenVINO does
    summary = tmp_path / "fuzz.json"
    assert main(["fuzz", "--original", "models:/cnn-int8-static/1", "--compressed", "models:/cnn-int8-static/1",
                 "--runtime", "openvino:bf16", "--seed-data", "digits[1300:1310]", "--max-queries", "20",
                 "--out-dir", str(tmp_path / "cross"), "--json-out", str(summary)]) == 0
    assert json.loads(summary.read_text())["seeds"] == 10
    run = _newest_fuzz_run()
    assert run.data.tags["mlflow_di.runtime.precision_asked"] == "bf16"
    assert run.data.tags["mlflow_di.runtime.precision"] == ("bf16" if default == "bf16" else "f32")


def test_runtime_asked_of_a_model_it_does_not_open_is_one_line(registered_cnn, toy_runtime, capsys):
    code = main(["fuzz", "--original", registered_cnn, "--compressed", registered_cnn, "--runtime", "toy",
                 "--seed-data", "digits[0:2]"])
    err = capsys.readouterr().err
    assert code == 2 and "the runtime 'toy' opens onnx models, not pytorch-pt2 ones" in err


needs_nncf = pytest.mark.skipif(importlib.util.find_spec("nncf") is None or importlib.util.find_spec("openvino") is None,
                                reason="NNCF and OpenVINO are not installed (pip install 'mlflow-di[nncf]')")


@needs_nncf
@pytest.mark.shared
def test_an_nncf_int8_export_of_lenet5_is_registered_with_lineage_scored_on_openvino_and_gated(tracking_uri,
                                                                                                shared_dir, capsys):
    weights = shared_dir / "models" / "deepimportance" / "LeNet5.h5"
    mnist = shared_dir / "data" / "mnist"
    assert main(["import-keras", "--arch", "lenet5", "--weights", str(weights), "--register-as", "lenet5"]) == 0
    assert main(["compress", "--model-uri", "models:/lenet5/1", "--method", "int8-nncf",
                 "--calib-data", f"mnist-train:{mnist}[0:300]", "--eval-data", f"mnist-test:{mnist}[0:1000]",
                 "--no-benefit"]) == 0
    out = capsys.readouterr().out
    assert "Statistics collection" not in out  # NNCF's own progress bars stay out of the command's lines
    client = mlflow.MlflowClient()
    version = client.get_model_version("lenet5-int8-nncf", "1")
    assert version.tags["mlflow_di.source_uri"] == "models:/lenet5/1" and version.tags["mlflow_di.method"] == "int8-nncf"
    assert json.loads(version.tags["mlflow_di.params"])["tool"] == "nncf"
    # made for OpenVINO: scored there too without being asked
    assert version.tags["mlflow_di.runtimes"] == "onnxruntime,openvino"
    metrics = client.get_run(version.run_id).data.metrics
    assert metrics["runtime.openvino.eval_images"] == 1000 and metrics["runtime.openvino.disagreement_rate"] < 0.02
    assert metrics["compressed_size_bytes"] < metrics["source_size_bytes"] / 2  # int8 weights
    capsys.readouterr()
    assert main(["gate", "--model-uri", "models:/lenet5-int8-nncf/1", "--max-disagreement-rate", "0.05",
                 "--max-accuracy-drop", "0.03", "--runtime", "openvino"]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out
    assert "the exports' answers judged as openvino computes them" in out


@needs_nncf
def test_nncf_is_imported_with_its_telemetry_off():
    """NNCF would send usage events to Google Analytics; outside pytest (which NNCF itself checks for) the
    method's import turns that off."""
    import subprocess
    import sys

    code = ("from mlflow_di.compression.nncf_int8 import nncf_module; nncf_module(); "
            "from nncf.telemetry import wrapper; print(isinstance(wrapper.telemetry, wrapper.NNCFTelemetryStub))")
    env = {key: value for key, value in __import__("os").environ.items() if key not in ("NNCF_CI", "NNCF_DEV")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"  # the stub (a MagicMock) that sends nothing
