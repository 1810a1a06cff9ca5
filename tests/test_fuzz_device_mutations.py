"""DFlare's noise operators and median blur on a torch device (tested on the CPU device; the same
code runs on CUDA): the same names, parameter draws, rounding and saturation as the NumPy
operators, the median byte for byte, and which campaigns get them."""
import dataclasses
import types

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import pytest

from mlflow_di.fuzz import DFlare
from mlflow_di.fuzz.distributed import RayExecutor
from mlflow_di.fuzz.device_mutations import (DeviceGaussianNoise, DeviceMedianBlur, DeviceMultiplicativeNoise,
                                             mutation_device, on_device, with_operators_on)
from mlflow_di.fuzz.mutations import (AverageBlur, GaussianNoise, MedianBlur, MultiplicativeNoise, default_operators,
                                      mutate_into, operator_names)

DEVICE_OPERATORS = [DeviceGaussianNoise(), DeviceMultiplicativeNoise(), DeviceMedianBlur()]


def test_on_device_moves_the_costly_operators_and_keeps_names_order_and_settings():
    moved = on_device(default_operators(), "cpu")
    assert operator_names(moved) == operator_names(default_operators())
    assert [type(op) for op in moved][:3] == [DeviceGaussianNoise, type(default_operators()[1]), DeviceMultiplicativeNoise]
    assert type(moved[-1]) is DeviceMedianBlur and moved[4] == AverageBlur()
    custom = on_device([GaussianNoise(sigma=2.0), MultiplicativeNoise(0.1, 0.2, 0.01), MedianBlur(kernels=(3,))], "cpu")
    assert custom == (DeviceGaussianNoise(sigma=2.0), DeviceMultiplicativeNoise(0.1, 0.2, 0.01),
                      DeviceMedianBlur(kernels=(3,)))
    assert on_device([GaussianNoise()], "cuda:1")[0].device == "cuda:1"
    assert on_device(default_operators(), None) == default_operators()
    assert "device='cpu'" in repr(moved[0])  # in the campaign's options: a folder resumes only on the same kind


@pytest.mark.parametrize("shape", [(28, 28, 1), (9, 9, 3), (6, 6, 2), (17, 23, 4)])
@pytest.mark.parametrize("k", [1, 3, 5, 7])
def test_device_median_blur_gives_the_cpu_bytes_and_draws(shape, k):
    image = np.random.default_rng(k).integers(0, 256, shape, dtype=np.uint8)
    cpu_rng, device_rng = np.random.default_rng(5), np.random.default_rng(5)
    expected = MedianBlur()(image, cpu_rng)  # a random kernel size
    np.testing.assert_array_equal(DeviceMedianBlur()(image, device_rng), expected)
    assert cpu_rng.random() == device_rng.random()  # the same draws from the seed's generator
    np.testing.assert_array_equal(DeviceMedianBlur(kernels=(k,))(image, np.random.default_rng(0)),
                                  MedianBlur(kernels=(k,))(image, np.random.default_rng(0)))


@pytest.mark.parametrize("operator", DEVICE_OPERATORS, ids=lambda op: op.name)
def test_device_operator_keeps_shape_dtype_leaves_input_alone_and_is_deterministic(operator):
    image = np.random.default_rng(0).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    before = image.copy()
    first = [operator(image, rng) for rng in [np.random.default_rng(7)] for _ in range(4)]
    again = [operator(image, rng) for rng in [np.random.default_rng(7)] for _ in range(4)]
    for a, b in zip(first, again):
        assert a.shape == image.shape and a.dtype == np.uint8
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(image, before)
    if operator.name != "median_blur":
        assert not np.array_equal(first[0], first[1])  # fresh noise on each call


@pytest.mark.parametrize("shape", [(12, 10, 3), (9, 9, 1), (8, 8, 5)])
@pytest.mark.parametrize("operator", DEVICE_OPERATORS + [DeviceMedianBlur(kernels=(1, 3))],
                         ids=lambda op: repr(op))
def test_device_operator_writes_into_out_the_bytes_and_draws_it_returns(operator, shape):
    # a campaign hands each mutant its row of the batch: one copy from the device, straight there
    image = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    batch = np.full((3, *shape), 9, np.uint8)
    returned, written = np.random.default_rng(5), np.random.default_rng(5)
    row = batch[1]
    for _ in range(6):
        expected = operator(image, returned)
        assert mutate_into(operator, image, written, row) is row
        np.testing.assert_array_equal(row, expected)
    assert returned.random() == written.random()
    assert (batch[0] == 9).all() and (batch[2] == 9).all()


def test_device_noise_rounds_saturates_and_matches_the_cpu_distribution():
    rng = np.random.default_rng(0)
    white, black = np.full((28, 28, 1), 255, np.uint8), np.zeros((28, 28, 1), np.uint8)
    for _ in range(20):
        assert DeviceGaussianNoise()(white, rng).min() >= 250 and DeviceGaussianNoise()(black, rng).max() <= 5
    mid = np.full((64, 64, 1), 128, np.uint8)
    delta = np.stack([DeviceGaussianNoise()(mid, rng) for _ in range(20)]).astype(int) - 128
    assert abs(delta.mean()) < 0.01
    assert abs(np.mean(delta != 0) - 0.1138) < 0.005  # P(|N(0, sqrt(0.1))| > 0.5), as the CPU operator
    # no variance: the factor is exactly 1 + mean, drawn as on the CPU, so the bytes are the CPU operator's
    image = np.random.default_rng(1).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    fixed = dict(mean_low=-0.5, mean_high=0.5, var_max=0.0)
    np.testing.assert_array_equal(DeviceMultiplicativeNoise(**fixed)(image, np.random.default_rng(3)),
                                  MultiplicativeNoise(**fixed)(image, np.random.default_rng(3)))
    brightened = DeviceMultiplicativeNoise(0.49, 0.5, 0.0)(np.full((4, 4, 1), 200, np.uint8), rng)
    assert brightened.min() == 255  # 200 * 1.49 = 298 clips to 255


def test_mutation_device_is_a_cuda_original_searched_where_it_runs():
    cuda = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda", index=0))
    assert mutation_device(cuda) is cuda.device
    assert mutation_device(cuda, executor=RayExecutor(workers=2, gpus_per_worker=0.5)) is cuda.device
    assert mutation_device(cuda, executor=RayExecutor(workers=2)) is None  # workers without a GPU share
    assert mutation_device(types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))) is None
    assert mutation_device(object()) is None  # ONNX, TFLite, a Keras import: no torch device


def test_with_operators_on_replaces_only_dflare_operators():
    strategy = with_operators_on(DFlare(fitness="gap"), "cpu")
    assert strategy.fitness == "gap" and type(strategy.operators[0]) is DeviceGaussianNoise
    assert with_operators_on(DFlare(), None) == DFlare()
    other = types.SimpleNamespace(name="diffchaser")
    assert with_operators_on(other, "cpu") is other
    assert "device='cpu'" in dataclasses.replace(strategy).options()["operators"][0]


def test_a_campaign_folder_resumes_only_with_the_operators_it_started_with(tmp_path):
    from mlflow_di.data import ImageSet
    from mlflow_di.errors import UserError
    from mlflow_di.fuzz import run_campaign
    from tests.test_fuzz_campaign import Brightness, HIGH, LOW

    rng = np.random.default_rng(3)
    seeds = ImageSet(rng.integers(0, 100, (4, 8, 8, 1), dtype=np.uint8), rng.integers(0, 2, 4), "dark")
    pair = (Brightness(LOW, classes=3), Brightness(HIGH, classes=3))
    run_campaign(*pair, seeds, max_queries=5, timeout=1e6, out_dir=tmp_path / "c", progress=False)
    with pytest.raises(UserError, match="strategy_options differ"):  # the noise would not be the same draws
        run_campaign(*pair, seeds, strategy=with_operators_on(DFlare(), "cpu"), max_queries=5, timeout=1e6,
                     out_dir=tmp_path / "c", resume=True, progress=False)
