"""IDC per class: each class equals an IDC fitted and scored on that class alone, classes that cannot
be scored are skipped with their reason, the result round-trips through JSON, and the coverage
command logs and reports it."""
import mlflow_di  # noqa: F401  (torchvision guard before zennit imports torchvision)

import json
import pathlib

import numpy as np
import pytest
import torch

from mlflow_di.coverage.base import FORMAT_VERSION
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.coverage.per_class import NO_ANALYSIS_INPUTS, NO_TEST_INPUTS, PerClassCoverage, PerClassResult
from mlflow_di.data import load_images
from mlflow_di.errors import UserError
from mlflow_di.models import zoo
from mlflow_di.models.torch_model import TorchModel

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TRAIN, TEST = "digits[0:1000]", "digits[1000:1400]"


@pytest.fixture(scope="module")
def digits_model() -> TorchModel:
    """digits-cnn trained briefly (seeded): accurate enough that most classes keep their inputs."""
    from mlflow_di.models.training import train_classifier

    model = TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing, name="digits-cnn")
    train = load_images(TRAIN)
    train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels), epochs=8,
                     seed=0, progress=False)
    model.module.eval()
    return model


def _per_class(**params) -> PerClassCoverage:
    return PerClassCoverage(ImportanceDrivenCoverage(**dict(dict(top_m=3, progress=False), **params)), progress=False)


def test_each_class_equals_idc_fitted_and_scored_on_that_class_alone(digits_model):
    train, test = load_images(TRAIN), load_images(TEST)
    result = _per_class().fit(digits_model, train).score(test)
    assert [c.label for c in result.classes] == list(range(10)) and result.layer == "fc1"
    assert not result.skipped
    for row in result.classes:
        alone = ImportanceDrivenCoverage(top_m=3, progress=False).fit(
            digits_model, train.subset(train.labels == row.label))
        report = alone.score(test.subset(test.labels == row.label))
        assert (row.idc, row.covered, row.total) == (report.idc, report.covered, report.total), row.label
        assert row.important_neurons == list(report.important_neurons)
        assert row.analysis_inputs == alone.n_analysis_
        assert row.test_inputs == int(np.sum(test.labels == row.label))
    idcs = [c.idc for c in result.classes]
    assert result.mean_idc == pytest.approx(np.mean(idcs))
    assert len(set(idcs)) > 1  # the classes differ, so "least covered" means something
    least = result.least_covered()
    assert [c.idc for c in least] == sorted(idcs)[:3]
    assert result.metrics()["idc_per_class_mean"] == pytest.approx(np.mean(idcs))
    assert result.metrics()["idc_class_4"] == result.classes[4].idc


def test_classes_that_cannot_be_scored_are_skipped_with_the_reason(digits_model):
    full = load_images(TRAIN)
    # class 3 keeps 2 analysis inputs (clustering needs 4), class 7 none; the test set lacks class 5
    keep = ~np.isin(full.labels, [3, 7]) | (np.cumsum(full.labels == 3) <= 2) & (full.labels == 3)
    train = full.subset(keep, "train")
    test = load_images(TEST)
    test = test.subset(test.labels != 5, "test")
    result = _per_class(only_correct=False).fit(digits_model, train).score(test)
    by_label = {c.label: c for c in result.classes}
    assert by_label[3].analysis_inputs == 2 and by_label[3].idc is None
    assert by_label[3].skipped == ("only 2 analysis inputs but clustering needs at least 4 "
                                   "(the largest cluster count)")
    assert by_label[7].skipped == NO_ANALYSIS_INPUTS and by_label[7].test_inputs == int(np.sum(test.labels == 7))
    assert by_label[5].skipped == NO_TEST_INPUTS and by_label[5].test_inputs == 0
    assert sorted(c.label for c in result.skipped) == [3, 5, 7]
    scored = [c.idc for c in result.scored]
    assert len(scored) == 7 and result.mean_idc == pytest.approx(np.mean(scored))
    assert set(result.metrics()) == {"idc_per_class_mean", *(f"idc_class_{c.label}" for c in result.scored)}
    rows = result.table()
    assert rows[3]["skipped"].startswith("only 2") and rows[0]["skipped"] == ""
    assert all(list(row) == list(rows[0]) for row in rows)  # equal keys: an MLflow table


def test_no_scored_class_gives_no_mean_and_no_metrics(digits_model):
    train = load_images("digits[0:30]")
    result = _per_class(clusters=(2, 3, 4, 5)).fit(digits_model, train).score(load_images("digits[30:40]"))
    assert not result.scored and result.mean_idc is None and result.metrics() == {}


def test_json_round_trip_and_version_stamp(digits_model, tmp_path):
    result = _per_class().fit(digits_model, load_images("digits[0:300]")).score(load_images("digits[300:400]"))
    text = result.to_json()
    values = json.loads(text)
    assert values["format"] == "mlflow-di/idc-per-class" and values["format_version"] == FORMAT_VERSION
    again = PerClassResult.from_json(text)
    assert again == result and again.to_json() == text
    values["format_version"] = 1
    with pytest.raises(UserError, match="format version 1"):
        PerClassResult.from_dict(values)


def test_a_saved_result_of_this_format_version_still_loads_byte_for_byte():
    text = (FIXTURES / f"idc_per_class_v{FORMAT_VERSION}.json").read_text()
    result = PerClassResult.from_json(text)
    assert [c.label for c in result.least_covered(2)] == [2, 0]
    assert result.skipped[0].skipped == NO_TEST_INPUTS
    assert result.to_json() == text


def test_settings_are_checked_before_any_work(digits_model):
    with pytest.raises(UserError, match="one layer name"):
        _per_class(layers="all").fit(digits_model, load_images("digits[0:20]"))
    with pytest.raises(UserError, match="one layer name"):
        _per_class(layers=["conv1", "fc1"]).fit(digits_model, load_images("digits[0:20]"))
    with pytest.raises(UserError, match="cluster counts"):
        _per_class(clusters=(1,)).fit(digits_model, load_images("digits[0:20]"))
    with pytest.raises(UserError, match="not fitted"):
        _per_class().score(load_images("digits[0:20]"))


# ------------------------------------------------------------------------------- command
@pytest.fixture()
def model_file(digits_model, tmp_path) -> pathlib.Path:
    """The trained digits-cnn as a .pt file the CLI loads."""
    path = tmp_path / "digits.pt"
    torch.save({"module": digits_model.module, "mlflow_di": {"preprocessing": digits_model.preprocessing.to_dict()}},
               path)
    return path


def test_coverage_command_logs_and_reports_per_class_idc(digits_model, model_file, tracking_uri, tmp_path):
    import mlflow

    from mlflow_di.cli import main

    out = tmp_path / "coverage.json"
    code = main(["coverage", "--model-uri", str(model_file), "--train-data", TRAIN, "--test-data", "digits[1000:1200]",
                 "--test-data", "digits[1200:1400]", "--criteria", "idc", "--top-m", "3", "--per-class",
                 "--json-out", str(out)])
    assert code == 0
    summary = json.loads(out.read_text())
    per_class = PerClassResult.from_dict(summary["per_class"])
    assert per_class.data == "digits[1000:1200] + digits[1200:1400]"
    assert sum(c.test_inputs for c in per_class.classes) == 400
    direct = _per_class().fit(digits_model, load_images(TRAIN)).score(load_images(TEST))
    assert [c.idc for c in per_class.classes] == [c.idc for c in direct.classes]
    assert summary["idc_per_class_mean"] == pytest.approx(direct.mean_idc)
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    assert run.data.metrics["idc_per_class_mean"] == pytest.approx(direct.mean_idc)
    assert run.data.metrics["idc_class_0"] == pytest.approx(direct.classes[0].idc)
    assert run.data.params["per_class"] == "True"
    artifacts = pathlib.Path(run.info.artifact_uri.removeprefix("file://"))
    assert (artifacts / "coverage" / "idc_per_class.json").exists()
    assert (artifacts / "coverage" / "idc_per_class.png").exists()
    report = (artifacts / "coverage" / "report.html").read_text()
    assert "IDC per class" in report
    least = direct.least_covered(1)[0]
    assert f"least covered: class {least.label} ({least.idc:.1%})" in report


def test_per_class_without_idc_is_a_usage_error(model_file, tracking_uri, capsys):
    from mlflow_di.cli import main

    code = main(["coverage", "--model-uri", str(model_file), "--train-data", "digits[0:50]", "--test-data",
                 "digits[50:60]", "--criteria", "nc", "--per-class"])
    assert code == 2
    assert "--per-class needs idc" in capsys.readouterr().err
