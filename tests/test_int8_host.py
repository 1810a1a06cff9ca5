"""int8 exports judged as they will run: the recipes, the execution context, host vs reference semantics.

ONNX Runtime's u8s8 kernels saturate on x86 CPUs with AVX2 but no VNNI. That path is forced two ways,
so that no test depends on the CPU it runs on: a real one, ONNX Runtime under ``qemu-x86_64 -cpu
Haswell`` (an AVX2 CPU without VNNI, emulated; skipped where qemu-user is not installed: ``make
test`` installs it), and a stand-in that makes the host session answer differently, for the
report, the run's metrics and the gate.
"""
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import mlflow
import numpy as np
import pytest

from mlflow_di.cli import main
from mlflow_di.compression.recipes import RECIPES, alternatives, recipe
from mlflow_di.errors import UserError
from mlflow_di.models import execution
from mlflow_di.models.execution import ExecutionContext

REPO = pathlib.Path(__file__).resolve().parents[1]


def context(machine="x86_64", features=("avx2",)) -> ExecutionContext:
    return ExecutionContext("1.32.0", "CPUExecutionProvider", "all", 1, machine, "test CPU", tuple(features))


def test_only_full_range_int8_weights_may_saturate_and_the_search_tries_the_others():
    assert [name for name, r in RECIPES.items() if r.may_saturate] == ["s8s8"]
    assert [r.name for r in alternatives(RECIPES["s8s8"])] == ["u8u8", "s8s8-reduced", "u8s8-reduced"]
    assert [r.name for r in alternatives(RECIPES["u8u8"])] == ["s8s8-reduced", "u8s8-reduced"]
    # where this host's kernels do not saturate, the search may also try s8s8 (last); its report then says so
    assert [r.name for r in alternatives(RECIPES["u8u8"], host_saturates=False)] == [
        "s8s8-reduced", "u8s8-reduced", "s8s8"]
    from mlflow_di.compression.recipes import portability_note

    assert "has an int8 dot product" in portability_note(RECIPES["s8s8"], host_saturates=False)
    assert portability_note(RECIPES["u8u8"], host_saturates=False) == ""
    tuned = recipe("s8s8", calibration="entropy", per_channel=False)
    assert all(not r.per_channel and r.calibration == "entropy" for r in alternatives(tuned))
    kwargs = recipe("s8s8-reduced").quantize_static_kwargs()
    assert kwargs["reduce_range"] and kwargs["weight_type"].name == "QInt8" and kwargs["activation_type"].name == "QInt8"
    assert recipe().params() == {"recipe": "u8u8", "activations": "uint8", "weights": "uint8", "reduce_range": False,
                                 "per_channel": True, "calibration": "minmax"}
    centred = recipe("u8u8", symmetric_activations=True, symmetric_weights=False)
    assert centred.quantize_static_kwargs()["extra_options"] == {"ActivationSymmetric": True, "WeightSymmetric": False}
    assert centred.params()["symmetric_activations"] is True and centred.params()["symmetric_weights"] is False
    with pytest.raises(UserError, match="unknown int8 recipe 'u4u4'; known: u8u8, s8s8"):
        recipe("u4u4")
    with pytest.raises(UserError, match="unknown calibration method 'kl'"):
        recipe(calibration="kl")


@pytest.mark.parametrize("machine, features, saturates, dot", [
    ("x86_64", ("avx2",), True, False),
    ("x86_64", ("avx2", "avx512f", "avx512bw"), True, False),
    ("x86_64", ("avx2", "avx512f", "avx512_vnni"), False, True),
    ("x86_64", ("avx2", "avx_vnni"), False, True),
    ("x86_64", (), False, False),  # no AVX2: ONNX Runtime's SSE kernels do not use VPMADDUBSW
    ("aarch64", ("asimddp",), False, True),
])
def test_the_context_says_whether_u8s8_kernels_saturate(machine, features, saturates, dot):
    found = context(machine, features)
    assert found.u8s8_saturates is saturates and found.int8_dot_product is dot
    tags = found.tags()
    assert tags["mlflow_di.runtime.u8s8_saturates"] == str(saturates).lower()
    assert tags["mlflow_di.runtime.int8_features"] == (",".join(features) or "none")
    assert ("u8s8 kernels saturate" in found.describe()) is saturates
    assert ExecutionContext.from_json(found.to_json()) == found


def test_cpu_features_come_from_cpuid_and_proc_cpuinfo_only_when_they_agree(monkeypatch):
    import numpy._core._multiarray_umath as umath

    host = {"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni"}
    monkeypatch.setattr(execution, "cpu_flags", lambda: host)
    emulated = {"AVX2": True, "AVX512F": False, "AVX512BW": False, "AVX512VNNI": False}
    monkeypatch.setattr(umath, "__cpu_features__", emulated)  # an emulated Haswell on a VNNI machine
    assert execution.int8_features() == ("avx2",)
    monkeypatch.setattr(umath, "__cpu_features__", {"AVX2": True, "AVX512F": True, "AVX512BW": True,
                                                    "AVX512VNNI": True})
    assert execution.int8_features() == ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni")


@pytest.mark.parametrize("bad", ["hosted", ""])
def test_unknown_semantics_are_refused(bad):
    with pytest.raises(UserError, match="unknown semantics"):
        execution.session_options(bad)


@pytest.fixture()
def saturating_host(monkeypatch):
    """A stand-in for a CPU whose int8 kernels saturate: the host session of an int8 export moves every
    third image's answer to its second choice; the reference session answers as it does; the CPU has AVX2
    and no VNNI."""
    from mlflow_di.models.classifier import OnnxClassifier

    forward = OnnxClassifier._forward

    def saturated(self, batch):
        outputs = forward(self, batch)
        if self.semantics != "host" or "int8" not in self.name:
            return outputs
        outputs = np.array(outputs, copy=True)
        rows = np.arange(0, len(outputs), 3)
        order = np.argsort(outputs[rows], axis=1)
        first, second = order[:, -1], order[:, -2]
        top, runner_up = outputs[rows, first].copy(), outputs[rows, second].copy()
        outputs[rows, first], outputs[rows, second] = runner_up, top
        return outputs

    monkeypatch.setattr(OnnxClassifier, "_forward", saturated)
    monkeypatch.setattr(execution, "int8_features", lambda: ("avx2",))


def test_host_kernels_that_differ_from_reference_semantics_are_named_in_the_report_metrics_gate_and_fuzz(
        registered_cnn, saturating_host, capsys, tmp_path):
    code = main(["compress", "--model-uri", registered_cnn, "--method", "int8-static", "--calib-data", "digits[0:200]",
                 "--eval-data", "digits[1300:1600]", "--diagnosis-images", "0", "--no-benefit"])
    out, err = capsys.readouterr()
    assert code == 0, err
    client = mlflow.MlflowClient()
    version = client.get_model_version("cnn-int8-static", "1")
    run = client.get_run(version.run_id)
    metrics, tags = run.data.metrics, run.data.tags
    assert metrics["disagreements"] >= 90 and metrics["reference.disagreements"] <= 10
    assert metrics["host_only_disagreements"] >= 90 and metrics["semantics_p_value"] < 1e-6
    assert metrics["reference.disagreement_rate"] == pytest.approx(metrics["reference.disagreements"] / 300)
    assert tags["mlflow_di.runtime.u8s8_saturates"] == "true" == version.tags["mlflow_di.runtime.u8s8_saturates"]
    assert tags["mlflow_di.runtime.int8_features"] == "avx2"
    warning = next(line for line in out.splitlines() if "WARNING: on this CPU" in line)
    assert "(no VNNI) ONNX Runtime's u8s8 kernels saturate" in warning and "host vs reference semantics" in warning
    assert f"would give ~{int(metrics['reference.disagreements'])}" in warning
    report = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/compress/report.html")
    assert "Execution context and benefit on this host" in report and "only on this host" in report
    assert "u8s8 kernels saturate" in report

    threshold = ["--model-uri", "models:/cnn-int8-static/1", "--max-disagreement-rate", "0.05"]
    assert main(["gate", *threshold, "--semantics", "reference"]) == 0
    gate_out = capsys.readouterr().out
    assert "(reference semantics)" in gate_out
    assert main(["gate", *threshold, "--semantics", "both"]) == 1  # the host's answers fail it
    gate_out = capsys.readouterr().out
    assert "host kernels vs reference semantics differ" in gate_out and "no VNNI" in gate_out
    assert main(["gate", *threshold]) == 1
    description = client.get_model_version("cnn-int8-static", "1").description
    assert "computed with onnxruntime" in description and "its u8s8 kernels saturate" in description

    # fuzzing the export: triggers that only this host's kernels make are counted as such
    export = "models:/cnn-int8-static/1"
    fuzz = ["fuzz", "--original", registered_cnn, "--compressed", export, "--seed-data", "digits[1300:1312]",
            "--max-queries", "20"]
    assert main([*fuzz, "--out-dir", str(tmp_path / "host")]) == 0
    out = capsys.readouterr().out
    host_run = mlflow.search_runs(output_format="list", search_all_experiments=True,
                                  filter_string="tags.`mlflow_di.command` = 'fuzz'")[0]
    assert host_run.data.metrics["host_only_triggers"] >= 1 and "flip only under this host's" in out
    assert host_run.data.tags["mlflow_di.runtime.u8s8_saturates"] == "true"
    assert host_run.data.params["semantics"] == "host"
    assert main([*fuzz, "--semantics", "reference", "--out-dir", str(tmp_path / "reference")]) == 0
    capsys.readouterr()
    runs = mlflow.search_runs(output_format="list", search_all_experiments=True,
                              filter_string="tags.`mlflow_di.command` = 'fuzz' and params.semantics = 'reference'")
    assert len(runs) == 1 and "host_only_triggers" not in runs[0].data.metrics
    assert runs[0].data.tags["mlflow_di.runtime.graph_optimization"] == "disabled"


@pytest.mark.shared
@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which("qemu-x86_64"),
                    reason="needs an x86_64 Python and qemu-user (make test installs it: apt-get install qemu-user)")
def test_on_an_emulated_cpu_without_vnni_s8s8_saturates_and_the_default_recipe_does_not(shared_dir, tmp_path):
    from benchmarks.bench_bounded import reference_lenet
    from benchmarks.bench_int8_host import EMULATED_CPU, SCORE
    from mlflow_di.compression import compress
    from mlflow_di.data import load_images

    model = reference_lenet(shared_dir, "lenet5")
    calib = load_images(f"mnist-train:{shared_dir}/data/mnist[0:500]").images
    test = np.asarray(load_images(f"mnist-test:{shared_dir}/data/mnist[0:2000]").images)
    for name in ("s8s8", "u8u8"):
        made = compress(model.module, model.preprocessing, "int8-static", tmp_path / name, calib_inputs=calib,
                        settings=RECIPES[name])
        shutil.copyfile(made.path, tmp_path / f"lenet5-{name}.onnx")
    np.save(tmp_path / "lenet5-inputs.npy", model.preprocessing.apply(test).astype(np.float32))
    np.save(tmp_path / "lenet5-labels.npy", model.classifier().predict(test))
    done = subprocess.run(["qemu-x86_64", "-cpu", EMULATED_CPU, sys.executable, "-c", SCORE, str(tmp_path), "lenet5",
                           "s8s8,u8u8"], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "int8 dot product: no; u8s8 kernels saturate" in found["context"]  # the CPU as the process sees it
    # measured: s8s8 11 (host) vs 1 (reference) of 2,000; u8u8 the same answers both ways
    assert found["lenet5 s8s8 host"] - found["lenet5 s8s8 reference"] >= 5
    assert found["lenet5 u8u8 host"] == found["lenet5 u8u8 reference"] <= 5


def test_benefit_times_a_fixed_batch_model_at_its_batch_and_says_why_it_cannot_time_others(tmp_path):
    import torch

    from mlflow_di.models.benefit import compare, measure

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    for batch in (1, 3):
        torch.onnx.export(model, torch.randn(batch, 1, 2, 2), str(tmp_path / f"fixed{batch}.onnx"),
                          input_names=["input"], dynamo=False)
    torch.onnx.export(model, torch.randn(2, 1, 2, 2), str(tmp_path / "dynamic.onnx"), input_names=["input"],
                      dynamic_axes={"input": {0: "batch"}}, dynamo=False)
    assert measure(tmp_path / "fixed1.onnx", runs=3).batch == 1
    found = compare(tmp_path / "dynamic.onnx", tmp_path / "dynamic.onnx", runs=3)
    assert found.export.batch == 64 and found.speedup > 0 and found.export.peak_memory_mib > 0
    with pytest.raises(UserError, match="fixed batch size of 3"):
        measure(tmp_path / "fixed3.onnx", runs=3)
