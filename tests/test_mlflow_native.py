"""Models as MLflow users log them, with MLflow's own APIs and defaults: ``mlflow.pytorch.log_model``
(pt2 by default), ``serialization_format="pickle"`` and ``mlflow.onnx.log_model``; every command runs
on them with no preprocessing option, and the formats of one model give the same results."""
import json

import mlflow
import numpy as np
import pytest
import torch

from conftest import active_store, copy_store
from mlflow_di.cli import main
from mlflow_di.models import zoo
from mlflow_di.models.signature import from_signature

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HINT = "record it"


@pytest.mark.parametrize("shape, example, layout, input_shape, scale", [
    ((-1, 1, 28, 28), np.full((2, 1, 28, 28), 0.5, np.float32), "NCHW", (28, 28, 1), 1 / 255),
    ((-1, 32, 32, 3), np.full((1, 32, 32, 3), 200.0, np.float32), "NHWC", (32, 32, 3), 1.0),
    ((-1, 3, 3, 3), np.zeros((1, 3, 3, 3), np.float32), "NCHW", (3, 3, 3), 1 / 255),
])
def test_the_signature_and_example_give_layout_shape_and_range(shape, example, layout, input_shape, scale):
    inferred = from_signature(shape, "float32", example, HINT)
    assert inferred.problem is None and inferred.assumed is None
    assert inferred.preprocessing.layout == layout and inferred.preprocessing.input_shape == input_shape
    assert inferred.preprocessing.scale == pytest.approx(scale)


@pytest.mark.parametrize("shape, dtype, example, fragment", [
    ((-1, 1, 8, 8), "float32", np.full((1, 1, 8, 8), -0.4, np.float32), "normalised with a mean and std"),
    ((-1, 1, 8, 8), "float32", np.full((1, 1, 8, 8), 900.0, np.float32), "beyond 8-bit pixels"),
    ((-1, 1, 8, 8), "uint8", None, "takes uint8 inputs"),
])
def test_what_the_signature_cannot_tell_is_a_problem_naming_the_fix(shape, dtype, example, fragment):
    problem = from_signature(shape, dtype, example, HINT).problem
    assert fragment in problem and "\n" not in problem


def test_no_example_assumes_pixels_over_255_and_says_so():
    inferred = from_signature((-1, 1, 8, 8), "float32", None, HINT)
    assert inferred.problem is None and "assumed" in inferred.assumed


def test_shapes_that_are_not_images_imply_nothing():
    assert from_signature((-1, 64), "float32", None, HINT) is None
    assert from_signature((-1, 5, 8, 8), "float32", None, HINT) is None


def _digits_cnn() -> torch.nn.Module:
    return zoo.build("digits-cnn", seed=0)


def log_three_ways(module, tmp_path, prefix: str = "cnn"):
    """``module`` logged as a user would: default (pt2), pickle, ONNX; an input example in 0..1, no mlflow_di block."""
    example = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    onnx_path = tmp_path / f"{prefix}.onnx"
    torch.onnx.export(module, (torch.from_numpy(example),), str(onnx_path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}, "y": {0: "n"}}, dynamo=False)
    import onnx

    with mlflow.start_run():
        mlflow.pytorch.log_model(module, name="pt2", registered_model_name=f"{prefix}-pt2", input_example=example)
        mlflow.pytorch.log_model(module, name="pickle", registered_model_name=f"{prefix}-pickle",
                                 input_example=example, serialization_format="pickle")
        mlflow.onnx.log_model(onnx.load(str(onnx_path)), name="onnx", registered_model_name=f"{prefix}-onnx",
                              input_example=example)
    return module


@pytest.fixture(scope="module")
def three_ways_store(empty_store_file, tmp_path_factory):
    """A store in which the digits CNN was logged three ways (:func:`log_three_ways`), made once for the
    module (logging took ~20 s) and copied by :func:`three_ways` into each test's fresh store."""
    folder = tmp_path_factory.mktemp("three-ways")
    copy_store(empty_store_file, folder)
    with active_store(folder):
        log_three_ways(_digits_cnn(), folder)
    return folder / "mlflow.db"


@pytest.fixture()
def three_ways(three_ways_store, tracking_uri, tmp_path):
    """The digits CNN logged three ways (:func:`log_three_ways`) in the test's fresh store."""
    copy_store(three_ways_store, tmp_path)  # nothing has opened tracking_uri's empty store yet
    return _digits_cnn()


def coverage_of_three_ways(prefix: str, tmp_path, capsys) -> dict[str, dict]:
    results = {}
    for name in (f"{prefix}-pt2", f"{prefix}-pickle", f"{prefix}-onnx"):
        out = tmp_path / f"{name}.json"
        # 5 resamples for the IDC interval (50 by default): the formats must still give the same interval
        assert main(["coverage", "--model-uri", f"models:/{name}/1", "--train-data", "digits[0:300]",
                     "--test-data", "digits[300:500]", "--idc-resamples", "5", "--json-out", str(out)]) == 0, \
            capsys.readouterr().err
        results[name] = json.loads(out.read_text())
    return results


def test_coverage_is_the_same_on_pt2_pickle_and_onnx_with_no_preprocessing_option(three_ways, tmp_path, capsys):
    results = coverage_of_three_ways("cnn", tmp_path, capsys)
    assert results["cnn-pt2"] == results["cnn-pickle"] == results["cnn-onnx"]
    assert {"idc", "nc", "kmnc", "nbc", "snac", "tknc", "lsc", "dsc"} <= set(results["cnn-pt2"])


def test_a_network_written_with_torch_relu_has_one_coverage_however_it_was_logged(tracking_uri, tmp_path, capsys):
    """Its ReLUs are calls, not modules: the pt2 program has them as ATen operators, the ONNX graph as
    Relu nodes (modules in the white-box view). Each layer is measured after its ReLU in all three."""
    from tests.test_format_invariance import SmallCNN

    log_three_ways(SmallCNN(functional=True), tmp_path, "relu-calls")
    results = coverage_of_three_ways("relu-calls", tmp_path, capsys)
    assert results["relu-calls-pt2"] == results["relu-calls-pickle"] == results["relu-calls-onnx"]
    assert results["relu-calls-pt2"]["layer"] == "fc1"


def test_fuzzing_from_the_pt2_or_the_pickled_original_gives_the_same_campaign(three_ways, tmp_path, capsys):
    """dflare from a pt2 or a pickled original, and the boundary walk from pt2, pickle or ONNX: the
    same campaign each, against one int8 export."""
    assert main(["compress", "--model-uri", "models:/cnn-pickle/1", "--method", "int8-dynamic",
                 "--eval-data", "digits[300:400]"]) == 0, capsys.readouterr().err
    summaries = []
    for original in ("models:/cnn-pt2/1", "models:/cnn-pickle/1"):
        out = tmp_path / f"{len(summaries)}.json"
        assert main(["fuzz", "--original", original, "--compressed", "models:/cnn-pickle-int8-dynamic/1",
                     "--seed-data", "digits[300:330]", "--max-queries", "50", "--seed", "3",
                     "--out-dir", str(tmp_path / f"campaign-{len(summaries)}"), "--json-out", str(out)]) == 0
        summary = json.loads(out.read_text())
        summaries.append({key: value for key, value in summary.items() if "seconds" not in key})
    assert summaries[0] == summaries[1]
    # --strategy boundary takes the original's gradients: from each way of logging it, with no
    # preprocessing option, the same campaign against the same export (the export made above, reused)
    walks = {}
    for original in ("models:/cnn-pt2/1", "models:/cnn-pickle/1", "models:/cnn-onnx/1"):
        out = tmp_path / f"walk-{len(walks)}.json"
        assert main(["fuzz", "--original", original, "--compressed", "models:/cnn-pickle-int8-dynamic/1",
                     "--seed-data", "digits[300:316]", "--strategy", "boundary", "--max-linf", "128",
                     "--max-queries", "50", "--out-dir", str(tmp_path / f"walk-{len(walks)}"),
                     "--json-out", str(out)]) == 0, capsys.readouterr().err
        summary = json.loads(out.read_text())
        walks[original] = {key: value for key, value in summary.items() if "seconds" not in key}
    first = walks["models:/cnn-pt2/1"]
    assert first["strategy"] == "boundary" and first["triggers"] > 0 and first["mean_original_passes"] > 0
    assert all(walk == first for walk in walks.values()), walks


def test_compress_fuzz_and_gate_run_on_a_default_logged_model(three_ways, tmp_path, capsys):
    original = "models:/cnn-pt2/1"
    assert main(["compress", "--model-uri", original, "--method", "int8-dynamic",
                 "--eval-data", "digits[300:400]"]) == 0, capsys.readouterr().err
    exports = {}
    for compressed in ("models:/cnn-pt2-int8-dynamic/1", "models:/cnn-onnx/1"):
        out = tmp_path / f"fuzz-{len(exports)}.json"
        assert main(["fuzz", "--original", original, "--compressed", compressed, "--seed-data", "digits[300:320]",
                     "--max-queries", "20", "--out-dir", str(tmp_path / f"campaign-{len(exports)}"),
                     "--json-out", str(out)]) == 0, capsys.readouterr().err
        exports[compressed] = json.loads(out.read_text())
    # the ONNX export of the same network never disagrees with it
    assert exports["models:/cnn-onnx/1"]["seeds"] == 20 and exports["models:/cnn-onnx/1"]["triggers"] == 0
    # an ONNX original is compressed through its white-box view, ONNX Runtime quantizing the re-export
    assert main(["compress", "--model-uri", "models:/cnn-onnx/1", "--method", "int8-static,prune-l1",
                 "--calib-data", "digits[0:100]", "--eval-data", "digits[300:400]"]) == 0, capsys.readouterr().err
    assert {"cnn-onnx-int8-static", "cnn-onnx-prune-l1"} <= {m.name for m in mlflow.MlflowClient().search_registered_models()}
    code = main(["gate", "--model-uri", original, "--compressed", "models:/cnn-pt2-int8-dynamic/1",
                 "--max-accuracy-drop", "1"])
    assert code in (0, 1), capsys.readouterr().err
    assert mlflow.MlflowClient().get_model_version("cnn-pt2", "1").tags["mlflow_di.verdict"] in ("PASS", "FAIL")


def test_a_normalised_example_asks_once_for_the_preprocessing_then_every_command_uses_it(tracking_uri, tmp_path,
                                                                                        capsys):
    example = (np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32) - 0.5) / 0.25
    with mlflow.start_run():
        mlflow.pytorch.log_model(_digits_cnn(), name="m", registered_model_name="normalised", input_example=example)
    capsys.readouterr()  # MLflow's own logging while the model was logged
    uri = "models:/normalised/1"
    arguments = ["coverage", "--model-uri", uri, "--train-data", "digits[0:200]", "--test-data", "digits[200:300]",
                 "--criteria", "nc"]
    assert main(arguments) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"mlflow-di describe {uri} --set-preprocessing" in err
    assert mlflow.search_runs(filter_string="attributes.status = 'RUNNING'").empty
    assert main(["describe", uri, "--set-preprocessing", "mean=0.5,std=0.25"]) == 0
    out = capsys.readouterr().out
    assert "recorded the preprocessing" in out and "mean [0.5]" in out
    recorded = mlflow.MlflowClient().get_model_version("normalised", "1").tags["mlflow_di.preprocessing"]
    assert json.loads(recorded)["std"] == [0.25] and json.loads(recorded)["input_shape"] == [8, 8, 1]
    assert main(arguments) == 0, capsys.readouterr().err


def test_a_policy_states_the_preprocessing_and_trusts_no_pickle_for_a_pt2_version(tracking_uri, tmp_path, capsys):
    """The pipeline (what the service runs) on a default-logged version: pt2 runs no code when
    loaded, so a policy that trusts no pickles analyses it; the policy gives the normalisation."""
    example = (np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32) - 0.5) / 0.25
    with mlflow.start_run():
        mlflow.pytorch.log_model(_digits_cnn(), name="m", registered_model_name="cnn", input_example=example)
    gate_with_a_small_pipeline("cnn", tmp_path, capsys, "preprocessing:\n  cnn: {mean: [0.5], std: [0.25]}\n")
    coverage = mlflow.search_runs(filter_string="tags.`mlflow_di.command` = 'coverage'")
    assert len(coverage) == 1 and 0 < coverage["metrics.idc"][0] <= 1


def test_a_torchvision_model_logged_with_defaults_runs_through_every_command(tracking_uri, tmp_path, capsys):
    """ResNet-18 (random weights, 32x32 RGB) as a user logs it: pt2, an input example, nothing else."""
    from benchmarks.check_lrp_conservation import family_model

    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.torch_model import TorchModel

    model = family_model("resnet18")
    images = np.random.default_rng(0).integers(0, 256, (48, 32, 32, 3), dtype=np.uint8)
    labels = TorchModel(model, Preprocessing(input_shape=(32, 32, 3))).classifier().predict(images)
    np.savez(tmp_path / "images.npz", x=images, y=labels)  # labelled by the model: IDC has correct inputs
    data = f"npz:{tmp_path / 'images.npz'}"
    with mlflow.start_run():
        mlflow.pytorch.log_model(model, name="model", registered_model_name="resnet18",
                                 input_example=np.random.default_rng(1).random((2, 3, 32, 32), dtype=np.float32))
    uri = "models:/resnet18/1"
    assert main(["describe", uri]) == 0
    assert "layer4.1.conv2" in capsys.readouterr().out
    summary = tmp_path / "coverage.json"
    assert main(["coverage", "--model-uri", uri, "--train-data", f"{data}[0:32]", "--test-data", f"{data}[32:48]",
                 "--top-m", "3", "--clusters", "2", "--criteria", "idc,nc,kmnc", "--batch-size", "16",
                 "--idc-resamples", "5", "--json-out", str(summary)]) == 0, capsys.readouterr().err
    assert 0 < json.loads(summary.read_text())["idc"] <= 1
    assert main(["compress", "--model-uri", uri, "--method", "int8-dynamic", "--eval-data", f"{data}[32:48]"]) == 0
    assert main(["fuzz", "--original", uri, "--compressed", "models:/resnet18-int8-dynamic/1", "--seed-data",
                 f"{data}[32:40]", "--max-queries", "10", "--out-dir", str(tmp_path / "campaign")]) == 0
    assert main(["gate", "--model-uri", uri, "--compressed", "models:/resnet18-int8-dynamic/1",
                 "--min-idc", "0.01", "--max-accuracy-drop", "1"]) in (0, 1)
    import pandas as pd

    rows = pd.DataFrame(images.reshape(len(images), -1).astype(np.int64)).assign(label=labels)
    with mlflow.start_run():
        result = mlflow.models.evaluate(uri, rows, targets="label", model_type="classifier", evaluators=["mlflow_di"],
                                        evaluator_config={"mlflow_di": {"top_m": 3, "clusters": (2,)}})
    assert 0 < result.metrics["mlflow_di/idc"] <= 1


def test_the_pipeline_runs_on_an_onnx_original(three_ways, tmp_path, capsys):
    gate_with_a_small_pipeline("cnn-onnx", tmp_path, capsys)


#: Every kind of pipeline step, in seconds on the digits CNN.
SMALL_PIPELINE = ("compress: {methods: [int8-dynamic], eval_data: 'digits[300:400]'}\n"
                  "coverage: {train_data: 'digits[0:200]', test_data: ['digits[200:300]'], criteria: [idc, nc]}\n"
                  "fuzz: {seed_data: 'digits[300:400]', num_seeds: 5, max_queries: 10}\n"
                  "gate: {thresholds: {max_accuracy_drop: 1}}\n")


def gate_with_a_small_pipeline(name: str, tmp_path, capsys, settings: str = "") -> None:
    """Run :data:`SMALL_PIPELINE` (after ``settings``) on ``models:/NAME/1``; its version gets a verdict."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(settings + SMALL_PIPELINE)
    code = main(["pipeline", "--policy", str(policy), "--model-uri", f"models:/{name}/1",
                 "--state-dir", str(tmp_path / "state")])
    assert code in (0, 1), capsys.readouterr().err
    assert mlflow.MlflowClient().get_model_version(name, "1").tags["mlflow_di.verdict"] in ("PASS", "FAIL")
