"""The reference architectures build with the named layers and shapes users rely on, and the
digits CNN trains quickly and deterministically."""
import pickle

import numpy as np
import pytest
import torch

import mlflow_di  # noqa: F401  (torchvision guard first)
from mlflow_di.data import load_images
from mlflow_di.errors import UserError
from mlflow_di.models import zoo
from mlflow_di.models.training import train_classifier


@pytest.mark.parametrize("arch", sorted(zoo.ARCHITECTURES))
def test_each_architecture_gives_ten_logits_for_its_input_shape(arch):
    spec = zoo.ARCHITECTURES[arch]
    height, width, channels = spec.input_shape
    model = zoo.build(arch)
    with torch.no_grad():
        logits = model(torch.rand(3, channels, height, width, generator=torch.Generator().manual_seed(0)))
    assert logits.shape == (3, 10)
    assert spec.preprocessing.input_shape == spec.input_shape
    assert spec.preprocessing.output == "logits" and spec.preprocessing.layout == "NCHW"
    assert not model.training
    # logits, not probabilities: rows do not sum to 1
    assert not torch.allclose(logits.sum(dim=1), torch.ones(3), atol=1e-3)


def test_lenet5_layers_are_the_named_top_level_children():
    names = [name for name, _ in zoo.build("lenet5").named_children()]
    assert names == ["conv1", "pool1", "conv2", "pool2", "flatten", "fc1", "fc2", "before_softmax"]


def test_conv_and_dense_blocks_output_post_relu_values():
    model = zoo.build("lenet5")
    outputs = {}
    hooks = [getattr(model, n).register_forward_hook(lambda m, i, o, n=n: outputs.__setitem__(n, o))
             for n in ("conv1", "fc1", "fc2", "before_softmax")]
    with torch.no_grad():
        model(torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1)))
    for hook in hooks:
        hook.remove()
    assert outputs["conv1"].shape == (8, 6, 24, 24)
    assert outputs["fc1"].shape == (8, 120) and outputs["fc2"].shape == (8, 84)
    assert outputs["conv1"].min() >= 0 and outputs["fc2"].min() >= 0
    assert outputs["before_softmax"].min() < 0  # the logits layer has no ReLU


@pytest.mark.parametrize("arch, flatten_features, parameters", [
    ("lenet1", 192, 3246), ("lenet4", 256, 25010), ("lenet5", 256, 44426),
    ("lenet1-same", 588, 7206), ("lenet5-same", 784, 107786),  # DFlare README: 7,206 and 107,786
])
def test_lenet_flatten_size_and_parameter_count_match_the_keras_models(arch, flatten_features, parameters):
    model = zoo.build(arch)
    with torch.no_grad():
        features = model[:5](torch.zeros(1, 1, 28, 28))
    assert features.shape == (1, flatten_features)
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_resnet20_downsamples_in_stages_two_and_three():
    model = zoo.build("resnet20")
    shapes = {}
    hooks = [module.register_forward_hook(lambda m, i, o, n=name: shapes.__setitem__(n, tuple(o.shape[1:])))
             for name, module in model.named_children()]
    with torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    for hook in hooks:
        hook.remove()
    assert shapes["stage1_block3"] == (16, 32, 32)
    assert shapes["stage2_block1"] == (32, 16, 16)
    assert shapes["stage3_block3"] == (64, 8, 8)
    assert shapes["flatten"] == (64,)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) == 21  # 19 + 2 shortcut convs


def test_stride_two_convolution_pads_bottom_right_like_tensorflow():
    block = zoo.PreActResidualBlock(16, 32, stride=2)
    pad = block.conv_a[0]
    assert isinstance(pad, torch.nn.ZeroPad2d) and pad.padding == (0, 1, 0, 1)  # left, right, top, bottom


def test_unknown_architecture_is_a_user_error_listing_the_known_ones():
    with pytest.raises(UserError, match="unknown architecture 'lenet6'.*lenet5-same.*resnet20.*digits-cnn"):
        zoo.build("lenet6")


def test_build_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = zoo.build("lenet1", seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    same = zoo.build("lenet1", seed=7)
    other = zoo.build("lenet1", seed=8)
    assert torch.equal(first.conv1[0].weight, same.conv1[0].weight)
    assert not torch.equal(first.conv1[0].weight, other.conv1[0].weight)


def test_models_survive_a_pickle_round_trip():
    model = zoo.build("resnet20")
    copy = pickle.loads(pickle.dumps(model))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x), copy(x))


@pytest.fixture(scope="module")
def digits_split():
    """A fixed 80/20 split of scikit-learn's digits (permutation from seed 0)."""
    data = load_images("digits")
    order = np.random.default_rng(0).permutation(len(data))
    cut = int(0.8 * len(data))
    return data.subset(order[:cut]), data.subset(order[cut:])


def test_digits_cnn_trains_to_over_95_percent_on_held_out_digits(digits_split):
    train, test = digits_split
    preprocessing = zoo.ARCHITECTURES["digits-cnn"].preprocessing
    model = zoo.build("digits-cnn", seed=0)
    losses = train_classifier(model, preprocessing.apply(train.images), train.labels, seed=0, progress=False)
    with torch.no_grad():
        predicted = model(torch.from_numpy(preprocessing.apply(test.images))).argmax(1).numpy()
    accuracy = float(np.mean(predicted == test.labels))
    assert len(test) == 360
    assert accuracy >= 0.95, accuracy
    assert losses[-1] < 0.2 * losses[0]
    assert not model.training


def test_training_is_deterministic_for_a_seed(digits_split):
    train, _ = digits_split
    images = zoo.ARCHITECTURES["digits-cnn"].preprocessing.apply(train.images[:400])
    labels = train.labels[:400]

    def run(seed):
        model = zoo.build("digits-cnn", seed=0)
        return train_classifier(model, images, labels, epochs=2, seed=seed, progress=False), model

    losses_a, model_a = run(seed=3)
    losses_b, model_b = run(seed=3)
    losses_c, _ = run(seed=4)
    assert losses_a == losses_b
    assert all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    assert losses_a != losses_c  # the seed drives the batch order


def test_training_rejects_mismatched_data():
    model = zoo.build("digits-cnn")
    with pytest.raises(UserError, match="10 training images but 9 labels"):
        train_classifier(model, np.zeros((10, 1, 8, 8), np.float32), np.zeros(9), progress=False)
    with pytest.raises(UserError, match=r"\(N, C, H, W\)"):
        train_classifier(model, np.zeros((10, 8, 8), np.float32), np.zeros(10), progress=False)


def test_training_restores_the_thread_count():
    before = torch.get_num_threads()
    model = zoo.build("digits-cnn")
    train_classifier(model, np.zeros((4, 1, 8, 8), np.float32), np.arange(4), epochs=1, progress=False, num_threads=1)
    assert torch.get_num_threads() == before
