import mlflow_di  # noqa: F401  (torchvision guard before zennit imports torchvision)

import collections

import numpy as np
import pytest
import torch
from torch import nn

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.coverage.idc import CoverageReport, ImportanceDrivenCoverage
from mlflow_di.models import zoo
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel


def _hand_made_model(logit_weights=(1.0, 0.5, 0.1, 0.0)) -> TorchModel:
    """Hidden neuron j copies pixel j; class 0's logit weighs them by ``logit_weights``; class 1's logit is 0.

    So every input is classified as 0 and neuron j's relevance is pixel_j * weight_j: importance
    ranks the neurons by weight (for similar pixel means).
    """
    hidden = nn.Linear(4, 4, bias=False)
    hidden.weight.data = torch.eye(4)
    logits = nn.Linear(4, 2, bias=False)
    logits.weight.data = torch.tensor([list(logit_weights), [0.0] * 4])
    module = nn.Sequential(collections.OrderedDict(
        flatten=nn.Flatten(), hidden=nn.Sequential(hidden, nn.ReLU()), logits=logits))
    return TorchModel(module, Preprocessing(scale=1 / 255, layout="NCHW", input_shape=(1, 4, 1)), "hand-made")


def _images(rows, labels=None, name="set") -> ImageSet:
    images = np.asarray(rows, dtype=np.uint8).reshape(-1, 1, 4, 1)
    return ImageSet(images, np.zeros(len(images)) if labels is None else labels, name)


def _training_set() -> ImageSet:
    """60 correctly classified inputs: pixel 0 in {50, 200}, pixel 1 in {20, 120, 240}; plus 5 misclassified."""
    rows = [[(50, 200)[i % 2], (20, 120, 240)[i % 3], 100, 100] for i in range(60)]
    outliers = [[120, 60, 100, 100]] * 5  # labelled 1 but predicted 0
    return _images(rows + outliers, np.array([0] * 60 + [1] * 5), "train")


@pytest.fixture()
def fitted() -> ImportanceDrivenCoverage:
    return ImportanceDrivenCoverage(top_m=2, progress=False).fit(_hand_made_model(), _training_set())


def test_hand_made_network_has_the_predicted_neurons_and_clusters(fitted):
    assert fitted.layer_ == "hidden"
    assert fitted.n_analysis_ == 60
    assert fitted.important_neurons_.tolist() == [0, 1]
    assert fitted.importance_[0] > fitted.importance_[1] > fitted.importance_[2] > fitted.importance_[3] == 0
    np.testing.assert_allclose(fitted.centroids_[0], np.float32([50 / 255, 200 / 255]), rtol=1e-6)
    np.testing.assert_allclose(fitted.centroids_[1], np.float32([20 / 255, 120 / 255, 240 / 255]), rtol=1e-6)
    assert fitted.silhouettes_.tolist() == [1.0, 1.0]
    assert fitted.total_combinations_ == 6


def test_misclassified_inputs_join_the_analysis_only_when_asked():
    model = ImportanceDrivenCoverage(top_m=2, only_correct=False, progress=False)
    model.fit(_hand_made_model(), _training_set())
    assert model.n_analysis_ == 65
    assert len(model.centroids_[0]) == 3  # pixel 0 = 120 of the outliers makes a third group


def test_score_counts_combinations_and_new_contributions(fitted):
    report = fitted.score(_images([[60, 30, 0, 0], [40, 10, 0, 0], [190, 25, 0, 0]]))
    assert report.combination.tolist() == [0, 0, 1]  # id = cluster of neuron 0 + 2 * cluster of neuron 1
    assert report.contributed_new.tolist() == [True, False, True]
    assert report.growth.tolist() == [1, 1, 2]
    assert (report.covered, report.total) == (2, 6)
    assert report.idc == pytest.approx(2 / 6)
    assert report.combination_clusters(5) == [1, 2]


def test_accumulating_a_second_set_counts_only_its_new_combinations(fitted):
    first = fitted.score(_images([[60, 30, 0, 0], [190, 25, 0, 0]]))
    second = fitted.score(_images([[200, 20, 0, 0], [210, 230, 0, 0]]), accumulate=first)
    assert second.contributed_new.tolist() == [False, True]
    assert second.growth.tolist() == [2, 3]
    assert (second.covered_before, second.covered, second.idc) == (2, 3, pytest.approx(0.5))


def test_json_round_trip_scores_identically(fitted, tmp_path):
    test = _images(np.random.default_rng(0).integers(0, 256, size=(40, 4)))
    original = fitted.score(test)
    path = fitted.save(tmp_path / "idc.json")
    reloaded = ImportanceDrivenCoverage.load(path, _hand_made_model())
    again = reloaded.score(test)
    assert again.combination.tolist() == original.combination.tolist()
    assert (again.covered, again.total, again.idc) == (original.covered, original.total, original.idc)
    assert CoverageReport.from_json(original.to_json()).to_dict() == original.to_dict()


def test_reloaded_model_refuses_other_weights_and_needs_a_model(fitted):
    text = fitted.to_json()
    with pytest.raises(UserError, match="weights differ"):
        ImportanceDrivenCoverage.from_json(text, _hand_made_model(logit_weights=(1.0, 0.5, 0.2, 0.0)))
    with pytest.raises(UserError, match="attach"):
        ImportanceDrivenCoverage.from_json(text).score(_images([[1, 2, 3, 4]]))


def test_accumulating_onto_another_models_report_is_refused(fitted):
    other = ImportanceDrivenCoverage(top_m=3, progress=False).fit(_hand_made_model(), _training_set())
    earlier = other.score(_images([[60, 30, 0, 0]]))
    with pytest.raises(UserError, match="another coverage model"):
        fitted.score(_images([[60, 30, 0, 0]]), accumulate=earlier)


def test_unknown_layer_lists_the_available_ones():
    with pytest.raises(UserError, match=r"unknown layer 'fc9'; available layers: flatten, hidden"):
        ImportanceDrivenCoverage(layers="fc9", progress=False).fit(_hand_made_model(), _training_set())


def test_top_m_above_the_layer_width_is_a_user_error():
    with pytest.raises(UserError, match=r"top_m=5 exceeds the 4 neurons of layer 'hidden'"):
        ImportanceDrivenCoverage(top_m=5, progress=False).fit(_hand_made_model(), _training_set())


def test_too_few_analysis_inputs_is_a_user_error():
    few = _images([[50, 20, 100, 100]] * 3 + [[1, 1, 1, 1]] * 5, np.array([0] * 3 + [1] * 5))
    with pytest.raises(UserError, match="only 3 correctly classified analysis inputs .* at least 4"):
        ImportanceDrivenCoverage(top_m=2, progress=False).fit(_hand_made_model(), few)


def _random_lenet():
    return TorchModel(zoo.build("lenet5", seed=0), zoo.MNIST_PREPROCESSING, "lenet5-random")


def _random_mnist_like(n: int, seed: int) -> ImageSet:
    rng = np.random.default_rng(seed)
    return ImageSet(rng.integers(0, 256, size=(n, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, n), f"random{seed}")


def test_same_seed_same_fit_and_layers_fit_together_match_single_fits():
    train, test = _random_mnist_like(120, 0), _random_mnist_like(50, 1)
    settings = dict(top_m=4, only_correct=False, progress=False, seed=3)
    first = ImportanceDrivenCoverage(layers="fc1", **settings).fit(_random_lenet(), train)
    second = ImportanceDrivenCoverage(layers="fc1", **settings).fit(_random_lenet(), train)
    assert first.to_json() == second.to_json()
    together = ImportanceDrivenCoverage(layers=["conv2", "fc1"], **settings).fit(_random_lenet(), train)
    assert together.fitted_layers_["fc1"].to_dict()["centroids"] == first.fitted_layers_["fc1"].to_dict()["centroids"]
    reports = together.score(test)
    assert reports["fc1"].combination.tolist() == first.score(test).combination.tolist()
    assert reports["conv2"].total == together.fitted_layers_["conv2"].total_combinations


def test_all_layers_use_at_most_each_layers_width():
    models = ImportanceDrivenCoverage(layers="all", top_m=8, only_correct=False, progress=False).fit(
        _random_lenet(), _random_mnist_like(60, 2))
    assert list(models.fitted_layers_) == ["conv1", "conv2", "fc1", "fc2"]
    assert [m.top_m for m in models.fitted_layers_.values()] == [6, 8, 8, 8]  # conv1 has 6 channels


@pytest.mark.slow
def test_lenet5_idc_falls_as_more_neurons_count(shared_dir, mnist_spec):
    from mlflow_di.data import load_images
    from mlflow_di.models.keras_import import import_keras

    model = import_keras("lenet5", shared_dir / "models" / "deepimportance" / "LeNet5.h5")
    analysis, test = load_images(mnist_spec + "[0:2000]"), load_images(mnist_spec + "[9000:10000]")
    scores = [ImportanceDrivenCoverage(top_m=m, progress=False).fit(model, analysis).score(test).idc
              for m in (4, 8, 12)]
    assert scores[0] > scores[1] > scores[2] > 0


def _fingerprint_one_tensor_at_a_time(module: nn.Module) -> str:
    """The fingerprint as saved coverage models hold it: each tensor to NumPy, hashed in turn."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        array = tensor.detach().cpu().contiguous().numpy()
        digest.update(f"{name}:{array.dtype}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def test_the_fingerprint_hashes_what_saved_coverage_models_hashed():
    from mlflow_di.coverage.idc import module_fingerprint

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    module.register_buffer("mask", torch.tensor([True, False, True]))
    module.register_buffer("scale", torch.tensor(2.5, dtype=torch.float64))
    module[3].weight = nn.Parameter(torch.randn(2, 4).T.contiguous().T)  # a non-contiguous parameter
    assert not module[3].weight.is_contiguous()
    assert module_fingerprint(module) == _fingerprint_one_tensor_at_a_time(module)
    with torch.no_grad():
        module[0].weight[0, 0, 0, 0] += 1e-6
    assert module_fingerprint(module) == _fingerprint_one_tensor_at_a_time(module)
