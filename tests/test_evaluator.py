"""The ``mlflow_di`` MLflow evaluator plugin on the 8x8 digits CNN, with a local sqlite tracking store."""
import mlflow
import numpy as np
import pandas as pd
import pytest

import mlflow_di  # noqa: F401  (torchvision guard before torch/zennit imports)
from mlflow_di.data import load_images
from mlflow_di.mlflow_edge.evaluator import DeepImportanceEvaluator
from mlflow_di.models.torch_model import TorchModel


CONFIG = {"input_shape": (8, 8, 1), "top_m": 4, "clusters": (2, 3)}


@pytest.fixture(scope="module")
def digits_model() -> TorchModel:
    """The digits CNN trained for a few seconds (~95% test accuracy)."""
    import torch

    from mlflow_di.models import zoo
    from mlflow_di.models.training import train_classifier

    train = load_images("digits[0:1000]")
    model = TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing,
                       name="digits-cnn")
    train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels), epochs=15,
                     seed=0, progress=False)
    return model


@pytest.fixture(scope="module")
def evaluation_rows() -> pd.DataFrame:
    """400 digits as one row of 64 raw pixels each, plus the label column."""
    data = load_images("digits[1000:1400]")
    frame = pd.DataFrame(data.images.reshape(len(data), -1).astype(np.int64), columns=[f"p{i}" for i in range(64)])
    frame["label"] = data.labels
    return frame


def expected_idc(model: TorchModel, rows: pd.DataFrame, fit_rows: int) -> float:
    """IDC the engine gives directly for the same split (first ``fit_rows`` fit, the rest scored)."""
    from mlflow_di.data import ImageSet
    from mlflow_di.coverage.idc import ImportanceDrivenCoverage

    images = rows.drop(columns="label").to_numpy().astype(np.uint8).reshape(-1, 8, 8, 1)
    data = ImageSet(images, rows["label"].to_numpy(), "rows")
    fit, score = data.split(fit_rows)
    return ImportanceDrivenCoverage(top_m=4, clusters=(2, 3), progress=False).fit(model, fit).score(score).idc


def history_length(run_id: str, key: str) -> int:
    from mlflow import MlflowClient

    return len(MlflowClient().get_metric_history(run_id, key))


def test_runs_only_for_classifiers_when_configured():
    assert not DeepImportanceEvaluator.can_evaluate(model_type="classifier", evaluator_config={})
    assert not DeepImportanceEvaluator.can_evaluate(model_type="classifier",
                                                    evaluator_config={"log_model_explainability": False})
    assert DeepImportanceEvaluator.can_evaluate(model_type="classifier", evaluator_config={"input_shape": (8, 8, 1)})
    assert not DeepImportanceEvaluator.can_evaluate(model_type="regressor", evaluator_config={"input_shape": (8, 8, 1)})


def test_registered_under_its_entry_point():
    from mlflow.models.evaluation.evaluator_registry import _model_evaluation_registry

    assert isinstance(_model_evaluation_registry.get_evaluator("mlflow_di"), DeepImportanceEvaluator)


def test_logged_pytorch_model_gets_idc_logged_once(mlflow_client, digits_model, evaluation_rows, monkeypatch):
    from mlflow_di.mlflow_edge import models as edge_models

    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # mlflow-di logs pickled modules
    with mlflow.start_run():
        info = edge_models.log_torch_model(digits_model)
    with mlflow.start_run() as run:
        result = mlflow.models.evaluate(info.model_uri, evaluation_rows, targets="label", model_type="classifier",
                                        evaluators=["mlflow_di"], evaluator_config={"mlflow_di": CONFIG})
    assert result.metrics["mlflow_di/idc"] == pytest.approx(expected_idc(digits_model, evaluation_rows, 200))
    assert result.metrics["mlflow_di/idc_fit_images"] == 200 and result.metrics["mlflow_di/idc_scored_images"] == 200
    centroids = result.artifacts["mlflow_di/coverage_model"].content["layers"][0]["centroids"]
    assert result.metrics["mlflow_di/idc_total"] == np.prod([len(c) for c in centroids])
    assert history_length(run.info.run_id, "mlflow_di/idc") == 1  # evaluate() logs it (it knows the model id)
    assert "mlflow_di/coverage_model" in result.artifacts
    assert result.artifacts["mlflow_di/coverage_model"].content["params"]["top_m"] == 4


def test_a_default_logged_pt2_model_is_white_box_with_no_pickle_and_no_input_shape(mlflow_client, digits_model,
                                                                                  evaluation_rows, monkeypatch):
    """``mlflow.pytorch.log_model`` with MLflow's defaults (pt2): the evaluator rebuilds the layers and
    reads the preprocessing from the signature and input example, as the CLI does."""
    monkeypatch.delenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", raising=False)
    example = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    with mlflow.start_run():
        info = mlflow.pytorch.log_model(digits_model.module, name="model", input_example=example)
    with mlflow.start_run():
        result = mlflow.models.evaluate(info.model_uri, evaluation_rows, targets="label", model_type="classifier",
                                        evaluators=["mlflow_di"], evaluator_config={"mlflow_di": {"top_m": 4,
                                                                                                  "clusters": (2, 3)}})
    assert result.metrics["mlflow_di/idc"] == pytest.approx(expected_idc(digits_model, evaluation_rows, 200))


def test_an_onnx_logged_model_is_evaluated_on_its_white_box_view(mlflow_client, digits_model, evaluation_rows,
                                                                 tmp_path):
    import contextlib
    import io

    import onnx
    import torch

    example = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(digits_model.module, (torch.from_numpy(example),), str(tmp_path / "m.onnx"), dynamo=False,
                          input_names=["x"], dynamic_axes={"x": {0: "n"}})
    with mlflow.start_run():
        info = mlflow.onnx.log_model(onnx.load(str(tmp_path / "m.onnx")), name="model", input_example=example)
    with mlflow.start_run():
        result = mlflow.models.evaluate(info.model_uri, evaluation_rows, targets="label", model_type="classifier",
                                        evaluators=["mlflow_di"], evaluator_config={"mlflow_di": {"top_m": 4,
                                                                                                  "clusters": (2, 3)}})
    assert result.metrics["mlflow_di/idc"] == pytest.approx(expected_idc(digits_model, evaluation_rows, 200))


@pytest.fixture()
def pixel_model_path(digits_model, tmp_path) -> str:
    """The digits CNN saved (not logged, so without a model id) as a label-predicting python model."""
    path = str(tmp_path / "pixel-model")
    mlflow.pyfunc.save_model(path, python_model=PixelClassifier(digits_model), pip_requirements=["mlflow"])
    return path


class PixelClassifier(mlflow.pyfunc.PythonModel):
    """A python model predicting labels from pixel rows (so MLflow's classifier metrics work) that
    exposes its white-box ``torch_model`` to the mlflow_di evaluator."""

    def __init__(self, torch_model: TorchModel):
        self.torch_model = torch_model

    def predict(self, context, model_input, params=None):
        images = np.asarray(model_input, dtype=np.uint8).reshape(-1, 8, 8, 1)
        return self.torch_model.classifier().predict(images)


def test_with_mlflow_default_evaluator_each_metric_is_logged_once(mlflow_client, digits_model, evaluation_rows,
                                                                  pixel_model_path):
    model = mlflow.pyfunc.load_model(pixel_model_path)
    assert model.model_id is None  # a saved (not logged) model: the evaluator must log its metrics itself
    with mlflow.start_run() as run:
        result = mlflow.models.evaluate(
            model, evaluation_rows, targets="label", model_type="classifier", evaluators=["default", "mlflow_di"],
            evaluator_config={"default": {"log_model_explainability": False},
                              "mlflow_di": {**CONFIG, "train_fraction": 0.25}})
    expected_accuracy = float(np.mean(model.predict(evaluation_rows.drop(columns="label")) == evaluation_rows["label"]))
    assert result.metrics["accuracy_score"] == pytest.approx(expected_accuracy)
    assert result.metrics["mlflow_di/idc"] == pytest.approx(expected_idc(digits_model, evaluation_rows, 100))
    assert history_length(run.info.run_id, "mlflow_di/idc") == 1
    logged = mlflow.get_run(run.info.run_id).data.metrics
    assert {k for k in logged if k.startswith("mlflow_di/")} == {k for k in result.metrics if k.startswith("mlflow_di/")}


def test_not_named_not_run(mlflow_client, evaluation_rows, pixel_model_path):
    with mlflow.start_run():
        result = mlflow.models.evaluate(pixel_model_path, evaluation_rows, targets="label",
                                        model_type="classifier",
                                        evaluator_config={"log_model_explainability": False})
    assert "accuracy_score" in result.metrics
    assert not [key for key in result.metrics if key.startswith("mlflow_di/")]


def _rounded_copy(digits_model, tmp_path, monkeypatch):
    """A 'compressed' copy of the digits CNN with weights rounded to 1/8 (a file), and the logged original's URI."""
    import copy

    import torch

    compressed = copy.deepcopy(digits_model.module)
    with torch.no_grad():
        for parameter in compressed.parameters():
            parameter.copy_(torch.round(parameter * 8) / 8)
    path = tmp_path / "rounded.pt"
    torch.save({"module": compressed, "mlflow_di": {"preprocessing": digits_model.preprocessing.to_dict()}}, path)
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    with mlflow.start_run():
        info = mlflow.pytorch.log_model(digits_model.module, name="model", serialization_format="pickle",
                                        metadata={"mlflow_di": {"preprocessing": digits_model.preprocessing.to_dict()}})
    return compressed, path, info.model_uri


def test_compressed_model_adds_deviation_metrics(mlflow_client, digits_model, evaluation_rows, tmp_path, monkeypatch):
    """A 'compressed' copy with weights rounded to 1/8: fuzzing finds deviations and the counts add up."""
    import torch

    compressed, path, model_uri = _rounded_copy(digits_model, tmp_path, monkeypatch)
    config = {**CONFIG, "compressed_model_uri": str(path), "fuzz_seeds": 12, "fuzz_max_queries": 300}
    with mlflow.start_run():
        metrics = mlflow.models.evaluate(model_uri, evaluation_rows, targets="label", model_type="classifier",
                                         evaluators=["mlflow_di"], evaluator_config={"mlflow_di": config}).metrics
    images = evaluation_rows.drop(columns="label").to_numpy().astype(np.uint8).reshape(-1, 8, 8, 1)[200:]
    with torch.no_grad():
        disagree = (digits_model.module(digits_model.to_tensor(images)).argmax(1)
                    != compressed(digits_model.to_tensor(images)).argmax(1)).sum().item()
    assert metrics["mlflow_di/disagreements"] == disagree
    assert metrics["mlflow_di/seeds"] == 12
    fuzzed = metrics["mlflow_di/seeds"] - metrics["mlflow_di/already_deviating"]
    assert metrics["mlflow_di/success_rate"] == pytest.approx(metrics["mlflow_di/triggers"] / fuzzed)
    assert metrics["mlflow_di/triggers"] >= 1
    assert 1 <= metrics["mlflow_di/mean_queries"] <= 300


def test_the_strategys_declaration_decides_how_the_evaluator_sees_the_models(mlflow_client, digits_model,
                                                                             evaluation_rows, tmp_path, monkeypatch):
    """The evaluator fuzzes through mlflow_di.fuzz.run: the boundary walk gets the evaluated model white-box (its
    gradients), a strategy that needs a white-box compressed model is one clear error."""
    from mlflow.exceptions import MlflowException

    _, path, model_uri = _rounded_copy(digits_model, tmp_path, monkeypatch)
    config = {**CONFIG, "compressed_model_uri": str(path), "fuzz_seeds": 6, "fuzz_max_queries": 60}
    with mlflow.start_run():
        metrics = mlflow.models.evaluate(model_uri, evaluation_rows, targets="label", model_type="classifier",
                                         evaluators=["mlflow_di"],
                                         evaluator_config={"mlflow_di": {**config, "fuzz_strategy": "boundary"}}).metrics
    assert metrics["mlflow_di/seeds"] == 6 and metrics["mlflow_di/triggers"] >= 1
    with mlflow.start_run(), pytest.raises(MlflowException, match="needs a white-box compressed model"):
        mlflow.models.evaluate(model_uri, evaluation_rows, targets="label", model_type="classifier",
                               evaluators=["mlflow_di"],
                               evaluator_config={"mlflow_di": {**config, "fuzz_strategy": "deepxplore"}})


def test_bad_rows_are_one_clear_error(mlflow_client, evaluation_rows, pixel_model_path):
    from mlflow.exceptions import MlflowException

    with mlflow.start_run(), pytest.raises(MlflowException, match=r"one row of 7\*7\*1 = 49 pixels per image"):
        mlflow.models.evaluate(pixel_model_path, evaluation_rows, targets="label",
                               model_type="classifier", evaluators=["mlflow_di"],
                               evaluator_config={"mlflow_di": {"input_shape": (7, 7, 1)}})


def test_train_data_and_rows_of_other_sizes_go_through_the_models_resize_step(digits_model, tmp_path):
    """A model with a raw-image step (resize=8) fits IDC on a folder of 16x16 and 24x24 digits and scores
    16x16 rows: the step runs as each batch is read, as in the commands (a mixed batch cannot be stacked)."""
    import dataclasses
    import types

    from PIL import Image

    from mlflow_di.mlflow_edge.evaluator import EvaluatorConfig, evaluate_images

    train = load_images("digits[0:300]")
    for index, (image, label) in enumerate(zip(train.images, train.labels)):
        scale = 2 if index % 2 else 3
        (tmp_path / f"{label}").mkdir(exist_ok=True)
        big = np.kron(image[..., 0], np.ones((scale, scale), np.uint8))
        Image.fromarray(big).save(tmp_path / f"{label}" / f"{index}.png")
    scored = load_images("digits[1000:1200]")
    rows = np.kron(scored.images, np.ones((1, 2, 2, 1), np.uint8))
    resizing = dataclasses.replace(digits_model, preprocessing=digits_model.preprocessing.override("resize=8"))
    model = types.SimpleNamespace(unwrap_python_model=lambda: types.SimpleNamespace(torch_model=resizing))
    dataset = types.SimpleNamespace(features_data=rows.reshape(len(rows), -1).astype(np.int64),
                                    labels_data=scored.labels, name="rows16")
    config = EvaluatorConfig.from_dict({"input_shape": (16, 16, 1), "top_m": 4, "clusters": (2, 3),
                                        "train_data": f"folder:{tmp_path}"})
    metrics, _ = evaluate_images(model, dataset, config)
    assert metrics["mlflow_di/idc_fit_images"] == 300 and metrics["mlflow_di/idc_scored_images"] == 200
    assert 0 < metrics["mlflow_di/idc"] <= 1
