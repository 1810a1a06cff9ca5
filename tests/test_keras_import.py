"""Keras HDF5 -> PyTorch: exact MNIST accuracies of the reference models, agreement with the
TFLite compressed models, clear errors for a file that does not fit, and (without ../shared)
a round trip through a Keras-layout file written here."""
import dataclasses
import json

import h5py
import numpy as np
import pytest
import torch

import mlflow_di  # noqa: F401  (torchvision guard first)
from mlflow_di.data import load_images
from mlflow_di.errors import UserError
from mlflow_di.models import zoo
from mlflow_di.models.keras_import import import_keras, load_keras_weights, weighted_modules


# --- without ../shared: a Keras-layout file written from a PyTorch model ---------------------

def keras_layer_arrays(module: torch.nn.Module, flatten_chw: dict[str, tuple[int, int, int]]):
    """The module's weights as Keras would store them: HWIO kernels, (in, out) dense kernels
    with (h, w, c) row order after a flatten, BN gamma/beta/moving statistics."""
    layers = []
    for name, target in weighted_modules(module):
        if isinstance(target, torch.nn.BatchNorm2d):
            arrays = {"gamma": target.weight, "beta": target.bias,
                      "moving_mean": target.running_mean, "moving_variance": target.running_var}
        elif isinstance(target, torch.nn.Conv2d):
            arrays = {"kernel": target.weight.permute(2, 3, 1, 0), "bias": target.bias}
        else:
            kernel = target.weight.T
            if name in flatten_chw:
                c, h, w = flatten_chw[name]
                kernel = kernel.reshape(c, h, w, -1).permute(1, 2, 0, 3).reshape(c * h * w, -1)
            arrays = {"kernel": kernel, "bias": target.bias}
        layers.append((f"keras_{len(layers)}", {k: v.detach().numpy().copy() for k, v in arrays.items()}))
    return layers


def write_keras_h5(path, layers, model_config=None):
    with h5py.File(path, "w") as handle:
        group = handle.create_group("model_weights")
        group.attrs["layer_names"] = [b"input_1"] + [name.encode() for name, _ in layers]
        group.create_group("input_1").attrs["weight_names"] = []
        for name, arrays in layers:
            layer_group = group.create_group(name)
            layer_group.attrs["weight_names"] = [f"{name}/{key}:0".encode() for key in arrays]
            for key, value in arrays.items():
                layer_group.create_dataset(f"{name}/{key}:0", data=value)
        if model_config is not None:
            handle.attrs["model_config"] = json.dumps(model_config).encode()


def test_digits_cnn_round_trips_through_a_keras_layout_file(tmp_path):
    original = zoo.build("digits-cnn", seed=5)
    path = tmp_path / "digits.h5"
    write_keras_h5(path, keras_layer_arrays(original, {"fc1.0": (16, 2, 2)}))
    imported = load_keras_weights("digits-cnn", path)
    x = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(imported(x), original(x), atol=1e-6)
        assert not torch.allclose(imported(x), zoo.build("digits-cnn", seed=0)(x), atol=1e-2)


def test_batchnorm_statistics_and_epsilon_come_from_the_file(tmp_path):
    original = zoo.build("resnet20", seed=3)
    generator = torch.Generator().manual_seed(1)
    for module in original.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) * 0.01 + 0.005)
            module.eps = 0.01
    layers = keras_layer_arrays(original, {})
    config = {"class_name": "Model", "config": {"layers": [
        {"class_name": "BatchNormalization" if "gamma" in arrays else ("Conv2D" if arrays["kernel"].ndim == 4 else "Dense"),
         "config": {"name": name, "epsilon": 0.01}}
        for name, arrays in layers]}}
    path = tmp_path / "resnet.h5"
    write_keras_h5(path, layers, config)
    imported = load_keras_weights("resnet20", path)
    assert {m.eps for m in imported.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {0.01}
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(imported(x), original.eval()(x), rtol=1e-4, atol=1e-4)


def test_an_unused_weight_in_the_file_is_an_error(tmp_path):
    layers = keras_layer_arrays(zoo.build("digits-cnn"), {"fc1.0": (16, 2, 2)})
    layers[0][1]["extra"] = np.zeros(3, np.float32)
    path = tmp_path / "extra.h5"
    write_keras_h5(path, layers)
    with pytest.raises(UserError, match=r"keras_0.*\['extra'\].*cannot use"):
        load_keras_weights("digits-cnn", path)


def test_missing_or_non_hdf5_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_keras_weights("lenet5", tmp_path / "nothing.h5")
    text = tmp_path / "notes.h5"
    text.write_text("not hdf5")
    with pytest.raises(UserError, match="not a Keras HDF5 file"):
        load_keras_weights("lenet5", text)


def test_unknown_architecture_is_reported_before_reading(tmp_path):
    with pytest.raises(UserError, match="unknown architecture 'vgg16'"):
        load_keras_weights("vgg16", tmp_path / "any.h5")


# --- with ../shared: the reference models --------------------------------------------------

@pytest.fixture(scope="module")
def mnist(mnist_spec):
    return load_images(mnist_spec)


@pytest.mark.slow
@pytest.mark.parametrize("arch, file, correct", [
    ("lenet1", "deepimportance/LeNet1.h5", 9808),
    ("lenet4", "deepimportance/LeNet4.h5", 9856),
    ("lenet5", "deepimportance/LeNet5.h5", 9879),
    ("lenet1-same", "dflare/lenet1.h5", 9788),
    ("lenet5-same", "dflare/lenet5.h5", 9881),
])
def test_imported_reference_models_score_their_published_mnist_accuracy(shared_dir, mnist, arch, file, correct):
    model = import_keras(arch, shared_dir / "models" / file)
    predicted = model.classifier().predict(mnist.images)
    assert len(mnist) == 10_000
    assert int(np.sum(predicted == mnist.labels)) == correct
    assert model.metadata["arch"] == arch


@pytest.mark.slow
@pytest.mark.parametrize("arch, original, compressed, lite_correct, min_agreement", [
    ("lenet1-same", "lenet1.h5", "lenet1-quan.lite", 9784, 9980),  # measured agreement 9991
    ("lenet5-same", "lenet5.h5", "lenet5-quan.lite", 9879, 9980),  # measured agreement 9995
])
def test_tflite_compressed_lenets_agree_with_the_ported_originals(
        shared_dir, mnist, arch, original, compressed, lite_correct, min_agreement):
    from mlflow_di.models.classifier import TFLiteClassifier

    folder = shared_dir / "models" / "dflare"
    ported = import_keras(arch, folder / original).classifier().predict(mnist.images)
    lite = TFLiteClassifier(folder / compressed).predict(mnist.images)
    assert int(np.sum(lite == mnist.labels)) == lite_correct
    assert int(np.sum(ported == lite)) >= min_agreement


def smooth_random_images(count: int, seed: int) -> np.ndarray:
    """Gaussian-blurred noise stretched to 0..255: image-like inputs with spatial structure."""
    from scipy.ndimage import gaussian_filter

    noise = gaussian_filter(np.random.default_rng(seed).normal(size=(count, 32, 32, 3)), sigma=(0, 1.5, 1.5, 0))
    low = noise.min(axis=(1, 2, 3), keepdims=True)
    high = noise.max(axis=(1, 2, 3), keepdims=True)
    return np.rint((noise - low) / (high - low) * 255).astype(np.uint8)


@pytest.mark.slow
def test_resnet20_port_agrees_with_its_tflite_compression(shared_dir):
    from mlflow_di.models.classifier import TFLiteClassifier

    folder = shared_dir / "models" / "dflare"
    model = import_keras("resnet20", folder / "resnet.h5")
    lite = TFLiteClassifier(folder / "resnet-quan.lite",
                            dataclasses.replace(model.preprocessing, layout="NHWC", output="probabilities"))
    images = smooth_random_images(300, seed=0)
    ported = model.classifier().predict_proba(images)
    compressed = lite.predict_proba(images)
    # measured: 94.7% top-1 agreement, mean |dp| 0.011; with symmetric (wrong) stride-2
    # padding the same check gives 62% and 0.068
    assert np.mean(ported.argmax(1) == compressed.argmax(1)) >= 0.90
    assert np.abs(ported - compressed).mean() <= 0.025
    assert len(np.unique(compressed.argmax(1))) >= 4  # the inputs do not all fall in one class


def test_wrong_architecture_for_the_file_names_the_layer_both_shapes_and_the_fitting_arch(shared_dir):
    weights = shared_dir / "models" / "dflare" / "lenet5.h5"
    with pytest.raises(UserError) as error:
        load_keras_weights("lenet5", weights)
    message = str(error.value)
    assert "Keras layer 'fc1' kernel has shape (784, 120)" in message
    assert "expects (256, 120)" in message
    assert "fits architecture 'lenet5-same'" in message
    assert "\n" not in message


def test_file_with_a_different_layer_count_is_rejected_with_a_hint(shared_dir):
    with pytest.raises(UserError, match=r"has 41 layers with weights .* 'lenet1' has 3 .*fits architecture 'resnet20'"):
        load_keras_weights("lenet1", shared_dir / "models" / "dflare" / "resnet.h5")
