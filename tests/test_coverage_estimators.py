"""The contract every coverage estimator keeps: scikit-learn parameters, NotFittedError, one save format."""
import mlflow_di  # noqa: F401  (torchvision guard before zennit imports torchvision)

import json

import numpy as np
import pytest
import sklearn.exceptions
import torch
from sklearn.base import clone
from torch import nn

from mlflow_di.coverage.base import FORMAT_VERSION, NotFittedError
from mlflow_di.coverage.criteria import ClassicCoverage
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.coverage.suite import CoverageSuite
from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel


def _tiny_cnn(seed: int = 0) -> TorchModel:
    torch.manual_seed(seed)  # fixed weights: deterministic test model
    module = nn.Sequential()
    module.add_module("conv1", nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU()))
    module.add_module("pool1", nn.MaxPool2d(2))
    module.add_module("flatten", nn.Flatten())
    module.add_module("fc1", nn.Sequential(nn.Linear(4 * 3 * 3, 6), nn.ReLU()))
    module.add_module("logits", nn.Linear(6, 3))
    return TorchModel(module, Preprocessing(scale=1 / 255, layout="NCHW", input_shape=(8, 8, 1)), "tiny")


def _images(count: int, seed: int, name: str) -> ImageSet:
    rng = np.random.default_rng(seed)
    return ImageSet(rng.integers(0, 256, (count, 8, 8, 1), dtype=np.uint8), rng.integers(0, 3, count), name)


def _idc(**params) -> ImportanceDrivenCoverage:
    return ImportanceDrivenCoverage(**dict(dict(top_m=3, only_correct=False, progress=False), **params))


def _suite(**params) -> CoverageSuite:
    return CoverageSuite(**dict(dict(top_m=3, only_correct=False, progress=False), **params))


ESTIMATORS = [
    ImportanceDrivenCoverage(),
    ImportanceDrivenCoverage(layers=["conv1", "fc1"], top_m=2, clusters=[2, 5], rule="z", epsilon=1e-3,
                             only_correct=False, seed=4, batch_size=7, progress=False, reference_quirks=True),
    ClassicCoverage(),
    ClassicCoverage(criteria=("nc", "dsc"), layers=["fc1"], sa_layers=["fc1"], batch_size=3, progress=False,
                    criterion_settings={"nc_threshold": 0.5, "kmnc_sections": 9}),
    CoverageSuite(),
    CoverageSuite(criteria="idc,nc", layers="all", top_m=2, clusters=(2, 3), rule="zplus", seed=1, progress=False),
]


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_clone_keeps_every_parameter_unchanged(estimator):
    copy = clone(estimator)
    assert type(copy) is type(estimator) and copy is not estimator
    assert copy.get_params() == estimator.get_params()
    params = estimator.get_params()
    rebuilt = type(estimator)(**params)
    for name, value in params.items():
        assert getattr(rebuilt, name) is value, name  # stored as given: no conversion in __init__


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_scoring_before_fit_raises_not_fitted(estimator):
    images = _images(2, 0, "t")
    with pytest.raises(sklearn.exceptions.NotFittedError, match="not fitted yet"):
        estimator.score(images)
    with pytest.raises(NotFittedError):  # also a UserError, so the CLI prints it as one line
        clone(estimator).score(images.images)
    assert issubclass(NotFittedError, UserError)


def test_fitted_estimators_pass_sklearns_fitted_check():
    from sklearn.utils.validation import check_is_fitted

    model, train = _tiny_cnn(), _images(40, 1, "train")
    for estimator in (_idc(), ClassicCoverage(progress=False), _suite(criteria="idc,nc")):
        with pytest.raises(sklearn.exceptions.NotFittedError):
            check_is_fitted(estimator)
        check_is_fitted(estimator.fit(model, train))
        assert estimator.model_ is model


def test_invalid_settings_are_user_errors_at_fit_not_at_construction():
    model, train = _tiny_cnn(), _images(40, 1, "train")
    bad = {ImportanceDrivenCoverage(top_m=0): "top_m must be a positive integer",
           ImportanceDrivenCoverage(rule="nope"): "unknown LRP rule",
           ImportanceDrivenCoverage(layers=[]): "no IDC layers",
           ClassicCoverage(criteria=("nc", "idc")): "unknown criteria",
           CoverageSuite(criteria="idc,xyz"): "unknown criteria"}
    for estimator, message in bad.items():
        with pytest.raises(UserError, match=message):
            estimator.fit(model, train)


def test_multi_layer_idc_equals_one_idc_per_layer():
    model, train = _tiny_cnn(), _images(60, 1, "train")
    first, second = _images(30, 2, "first"), _images(20, 3, "second")
    together = _idc(layers=["conv1", "fc1"], seed=2).fit(model, train)
    assert together.layers_ == ["conv1", "fc1"]
    reports = together.score(first)
    accumulated = together.score(second, accumulate=reports)
    for layer in ("conv1", "fc1"):
        alone = _idc(layers=layer, seed=2).fit(model, train)
        assert together.fitted_layers_[layer].to_dict() == alone.fitted_layers_[layer].to_dict()
        single = alone.score(first)
        assert reports[layer].to_dict() == single.to_dict()
        assert accumulated[layer].to_dict() == alone.score(second, accumulate=single).to_dict()
    with pytest.raises(AttributeError, match="use fitted_layers_"):
        together.important_neurons_  # noqa: B018  (several layers: no single-layer shortcut)


def test_all_layers_idc_equals_the_named_hidden_layers():
    model, train, test = _tiny_cnn(), _images(60, 1, "train"), _images(30, 2, "test")
    every = _idc(layers="all", top_m=5).fit(model, train)
    assert every.layers_ == ["conv1", "fc1"]
    assert [f.top_m for f in every.fitted_layers_.values()] == [4, 5]  # conv1 has 4 channels
    named = _idc(layers=["fc1"], top_m=5).fit(model, train)
    assert every.score(test)["fc1"].to_dict() == named.score(test)["fc1"].to_dict()


def test_suite_scores_like_its_parts_and_reloads(tmp_path):
    model, train, first, second = _tiny_cnn(), _images(60, 1, "train"), _images(30, 2, "a"), _images(20, 3, "b")
    suite = _suite(criteria="idc,nc,kmnc,dsc").fit(model, train)
    assert suite.criteria_ == ("idc", "nc", "kmnc", "dsc") and suite.primary_ == "fc1"
    result = suite.score(first)
    both = suite.score(second, accumulate=result)
    idc = _idc().fit(model, train)
    assert result.idc["fc1"].to_dict() == idc.score(first).to_dict()
    classic = ClassicCoverage(criteria=("nc", "kmnc", "dsc"), progress=False).fit(model, train)
    assert result.criteria.to_json() == classic.score(first).to_json()
    loaded = CoverageSuite.load(suite.save(tmp_path / "suite"), model)
    assert loaded.get_params() == dict(suite.get_params(), criteria=["idc", "nc", "kmnc", "dsc"], clusters=[2, 3, 4])
    again = loaded.score(first)
    assert again.summary() == result.summary() and again.criteria.to_json() == result.criteria.to_json()
    assert loaded.score(second, accumulate=again).summary() == both.summary()
    assert loaded.important_neurons_table() == suite.important_neurons_table()


def _rewrite_version(path, version):
    values = json.loads(path.read_text())
    assert values["format_version"] == FORMAT_VERSION
    values["format_version"] = version
    path.write_text(json.dumps(values))


def _one_line_error(excinfo, version) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    assert f"format version {version!r} cannot be read" in message and f"reads version {FORMAT_VERSION}" in message
    return message


def test_every_saved_file_carries_the_format_version_and_refuses_another(tmp_path):
    model, train = _tiny_cnn(), _images(60, 1, "train")
    idc_path = _idc().fit(model, train).save(tmp_path / "idc.json")
    _rewrite_version(idc_path, 1)
    with pytest.raises(UserError) as excinfo:
        ImportanceDrivenCoverage.load(idc_path, model)
    assert "idc.json" in _one_line_error(excinfo, 1)

    folder = ClassicCoverage(criteria=("nc",), progress=False).fit(model, train).save(tmp_path / "criteria")
    _rewrite_version(folder / "classic_criteria.json", 99)
    with pytest.raises(UserError) as excinfo:
        ClassicCoverage.load(folder, model=model)
    _one_line_error(excinfo, 99)

    suite_folder = _suite(criteria="idc,nc").fit(model, train).save(tmp_path / "suite")
    _rewrite_version(suite_folder / "suite.json", 3)
    with pytest.raises(UserError) as excinfo:
        CoverageSuite.load(suite_folder, model)
    _one_line_error(excinfo, 3)


def test_a_version_1_idc_file_is_named_in_the_error(tmp_path):
    old = tmp_path / "old.json"  # what mlflow-di wrote before the shared format
    old.write_text(json.dumps({"format": "mlflow-di/idc", "version": 1, "params": {}, "layer": "fc1"}))
    with pytest.raises(UserError, match=r"saved idc format version 1 cannot be read .* fit and save it again"):
        ImportanceDrivenCoverage.load(old)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(UserError, match="holds no saved idc"):
        ImportanceDrivenCoverage.load(other)
