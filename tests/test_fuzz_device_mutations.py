"""DFlare's seven operators on a torch device (tested on the CPU device; the same code runs on CUDA): the
same names, parameter draws, rounding and saturation as the NumPy operators; salt and pepper, pixel change,
the median, the Gaussian blur and the odd box blurs byte for byte; a batch of mutants made at once is the
mutants made one at a time; and which campaigns get them."""
import dataclasses
import types

import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import pytest

from mlflow_di.fuzz import DFlare
from mlflow_di.fuzz.distributed import RayExecutor
from mlflow_di.fuzz.device_mutations import (DeviceAverageBlur, DeviceGaussianBlur, DeviceGaussianNoise,
                                             DeviceMedianBlur, DeviceMultiplicativeNoise, DevicePixelChange,
                                             DeviceSaltAndPepper, mutation_device, on_device, with_operators_on)
from mlflow_di.fuzz.mutations import (AverageBlur, GaussianBlur, GaussianNoise, MedianBlur, MultiplicativeNoise,
                                      PixelChange, SaltAndPepper, default_operators, mutate_into, operator_names,
                                      two_step)

DEVICE_OPERATORS = list(on_device(default_operators(), "cpu"))
#: the device operators that give the CPU operators' bytes for every draw
EXACT = [(DeviceSaltAndPepper(), SaltAndPepper()), (DevicePixelChange(), PixelChange()),
         (DevicePixelChange(max_values=400), PixelChange(max_values=400)),  # positions drawn twice
         (DeviceGaussianBlur(), GaussianBlur()), (DeviceMedianBlur(), MedianBlur()),
         (DeviceAverageBlur(kernels=(1, 3, 5)), AverageBlur(kernels=(1, 3, 5)))]
SHAPES = [(28, 28, 1), (9, 9, 3), (6, 6, 2), (17, 23, 4), (3, 5, 3), (2, 9, 1)]


def test_on_device_moves_every_dflare_operator_and_keeps_names_order_and_settings():
    moved = on_device(default_operators(), "cpu")
    assert operator_names(moved) == operator_names(default_operators())
    assert [type(op) for op in moved] == [DeviceGaussianNoise, DeviceSaltAndPepper, DeviceMultiplicativeNoise,
                                          DevicePixelChange, DeviceAverageBlur, DeviceGaussianBlur, DeviceMedianBlur]
    assert all(two_step(op) for op in moved)  # a campaign's population makes their mutants together
    custom = on_device([GaussianNoise(sigma=2.0), MultiplicativeNoise(0.1, 0.2, 0.01), MedianBlur(kernels=(3,))], "cpu")
    assert custom == (DeviceGaussianNoise(sigma=2.0), DeviceMultiplicativeNoise(0.1, 0.2, 0.01),
                      DeviceMedianBlur(kernels=(3,)))
    assert on_device([GaussianNoise()], "cuda:1")[0].device == "cuda:1"
    assert on_device(default_operators(), None) == default_operators()
    assert "device='cpu'" in repr(moved[0])  # in the campaign's options: a folder resumes only on the same kind


def _image(shape, seed, kind="random"):
    image = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return {"random": image, "binary": (image > 127).astype(np.uint8) * 255,
            "flat": np.full(shape, 77, np.uint8)}[kind]


@pytest.mark.parametrize("kind", ["random", "binary", "flat"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pair", EXACT, ids=lambda pair: repr(pair[1]))
def test_device_operator_gives_the_cpu_bytes_and_draws(pair, shape, kind):
    device, cpu = pair
    image = _image(shape, len(shape) + shape[0], kind)
    cpu_rng, device_rng = np.random.default_rng(5), np.random.default_rng(5)
    for _ in range(8):  # random kernel sizes, positions and levels
        np.testing.assert_array_equal(device(image, device_rng), cpu(image, cpu_rng))
    assert cpu_rng.random() == device_rng.random()  # the same draws from the seed's generator


@pytest.mark.parametrize("k", [2, 4])
def test_device_box_blur_with_an_even_kernel_is_within_one_level_of_opencv(k):
    # OpenCV's own fixed-point rounding for even windows is not reproduced (fuzz/device_mutations.py)
    image = _image((37, 41, 3), 0)
    device = DeviceAverageBlur(kernels=(k,))(image, np.random.default_rng(0))
    difference = np.abs(device.astype(int) - AverageBlur(kernels=(k,))(image, np.random.default_rng(0)))
    assert difference.max() <= 1 and difference.mean() < 0.3


@pytest.mark.parametrize("operator", DEVICE_OPERATORS, ids=lambda op: op.name)
def test_a_batch_of_mutants_made_at_once_is_each_mutant_made_alone(operator):
    # a campaign's population makes one operator's mutants of many seeds in one call: each seed's mutant must
    # be the one it gets searched alone (its own draws, its own image), and its "unchanged" flag exact
    shape = (11, 13, 3)
    sources = [_image(shape, seed, kind) for seed, kind in enumerate(["random", "binary", "flat", "random"])]
    draws = [operator.draw(shape, np.random.default_rng(seed)) for seed in range(len(sources))]
    rows = np.zeros((len(sources), *shape), np.uint8)
    unchanged = operator.apply_many(sources, draws, rows)
    for seed, source in enumerate(sources):
        alone = operator(source, np.random.default_rng(seed))
        np.testing.assert_array_equal(rows[seed], alone)
        assert unchanged[seed] == np.array_equal(alone, source)


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
    if operator.name.endswith("noise"):
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


def test_a_median_group_larger_than_its_window_budget_goes_through_in_chunks(monkeypatch):
    from mlflow_di.fuzz import device_mutations

    images = [_image((9, 9, 3), seed) for seed in range(5)]
    draws = [7, 7, 7, 3, 7]
    whole = np.zeros((5, 9, 9, 3), np.uint8)
    DeviceMedianBlur().apply_many(images, draws, whole)
    monkeypatch.setattr(device_mutations, "_MEDIAN_WINDOW_BYTES", 2 * 49 * 3 * 81 * 4)  # two images at a time
    chunked = np.zeros_like(whole)
    DeviceMedianBlur().apply_many(images, draws, chunked)
    np.testing.assert_array_equal(chunked, whole)
    for image, k, row in zip(images, draws, chunked):
        np.testing.assert_array_equal(row, MedianBlur(kernels=(k,))(image, np.random.default_rng(0)))


def test_a_step_of_host_and_device_groups_puts_every_mutant_in_its_row(monkeypatch):
    # device groups are brought back together (one copy per run of consecutive device groups): with a host
    # group between two device ones, and several seeds per group, each row is its mutation's mutant
    from mlflow_di.fuzz import population
    from mlflow_di.fuzz.population import Mutation, apply_mutations

    copies = []
    original_copy = population._bring_back
    monkeypatch.setattr(population, "_bring_back", lambda groups, rows: copies.append(len(groups))
                        or original_copy(groups, rows))
    shape = (9, 9, 3)
    operators = [DeviceGaussianBlur(), AverageBlur(kernels=(1, 3)), DeviceSaltAndPepper(), DeviceMedianBlur()]
    mutations, alone = [], []
    for seed in range(12):
        operator, source = operators[seed % 4], _image(shape, seed, ["random", "flat", "binary"][seed % 3])
        mutations.append(Mutation(operator, source, operator.draw(shape, np.random.default_rng(seed))))
        alone.append((operator(source, np.random.default_rng(seed)), source))
    rows = np.zeros((12, *shape), np.uint8)
    placed = apply_mutations(mutations, rows)
    assert sorted(placed) == list(range(12)) and copies == [3]
    for mutation, row, (mutant, source) in zip(mutations, placed, alone):
        np.testing.assert_array_equal(rows[row], mutant)
        assert mutation.row is not None and np.shares_memory(mutation.row, rows[row])
        assert mutation.unchanged == np.array_equal(mutant, source)
        assert (mutation.made is None) == (mutation.operator.device is None)
        if mutation.made is not None:
            np.testing.assert_array_equal(mutation.kept().numpy(), mutant)


def test_a_step_left_on_the_device_is_the_batch_apply_mutations_brings_back():
    # apply_mutations_on_device: the same rows in the same order, kept on the device; no host row until asked
    from mlflow_di.fuzz.population import Mutation, apply_mutations, apply_mutations_on_device

    shape = (9, 9, 3)
    operators = [DeviceGaussianBlur(), DeviceSaltAndPepper(), DeviceMedianBlur()]
    drawn = []
    for seed in range(10):
        operator, source = operators[seed % 3], _image(shape, seed, ["random", "flat", "binary"][seed % 3])
        drawn.append((operator, source, operator.draw(shape, np.random.default_rng(seed))))
    on_host = [Mutation(*d) for d in drawn]
    rows = np.zeros((10, *shape), np.uint8)
    placed_host = apply_mutations(on_host, rows)
    left = [Mutation(*d) for d in drawn]
    placed, batch = apply_mutations_on_device(left)
    assert placed == placed_host and batch.shape == (10, *shape)
    np.testing.assert_array_equal(batch.numpy(), rows)
    for mutation, host_mutation, row in zip(left, on_host, placed):
        assert mutation.row is None and mutation.unchanged == host_mutation.unchanged
        np.testing.assert_array_equal(mutation.image(), rows[row])
        np.testing.assert_array_equal(mutation.kept().numpy(), rows[row])


def _torch_pair(noise: float):
    """A linear classifier of 12x12x3 images and a copy with ``noise`` added to its weights (as a quantized
    export differs): PyTorch classifiers on the CPU, which here stands in for the GPU both would run on."""
    import copy as copying

    import torch

    from mlflow_di.models.classifier import TorchClassifier
    from mlflow_di.models.preprocessing import Preprocessing

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(432, 3))
    copy = copying.deepcopy(net)
    with torch.no_grad():
        copy[1].weight += noise * torch.randn_like(copy[1].weight)
    preprocessing = Preprocessing(scale=1 / 255, input_shape=(12, 12, 3), layout="NHWC")
    return TorchClassifier(net, preprocessing, "net"), TorchClassifier(copy, preprocessing, "copy")


def test_a_campaign_whose_models_run_on_the_operators_device_keeps_its_batches_there(monkeypatch):
    # both models where the operators run: the mutants never come to the host (the models take the device's
    # batch), with the records and triggers of the campaign that copies every batch to the host and back
    from mlflow_di.data import ImageSet
    from mlflow_di.fuzz import lockstep, run_campaign
    from mlflow_di.fuzz.campaign import run_campaigns
    from mlflow_di.fuzz.results import comparable_records
    from mlflow_di.models.classifier import TorchClassifier, takes_device_batches

    original, compressed = _torch_pair(0.002)  # triggers after 2-51 queries, and seeds that run their budget
    images = np.random.default_rng(5).integers(0, 256, (12, 12, 12, 3), dtype=np.uint8)
    seeds = ImageSet(images, np.zeros(12, np.int64), "generated")
    strategy = with_operators_on(DFlare(), "cpu")
    calls = []
    real = TorchClassifier.predict_device_batch
    monkeypatch.setattr(TorchClassifier, "predict_device_batch",
                        lambda self, batch: calls.append(len(batch)) or real(self, batch))
    # torch's CPU stands in for the GPU (on a real CPU the batch comes to the host rows, see takes_device_batches)
    monkeypatch.setattr(lockstep, "takes_device_batches", lambda model, device: isinstance(model, TorchClassifier))

    def campaign():
        return run_campaign(original, compressed, seeds, strategy=strategy, max_queries=60, timeout=1e6, batch=6,
                            progress=False)

    kept = campaign()
    assert calls and kept.summary.triggers > 0
    with monkeypatch.context() as host:
        host.setattr(lockstep, "takes_device_batches", lambda model, device: False)
        calls.clear()
        copied = campaign()
        assert not calls
    with monkeypatch.context() as host:  # as it is on the CPU
        host.setattr(lockstep, "takes_device_batches", takes_device_batches)
        assert comparable_records(campaign()) == comparable_records(kept) and not calls
    assert comparable_records(kept) == comparable_records(copied)
    for name in ("triggers", "trigger_seeds", "trigger_indices"):
        np.testing.assert_array_equal(getattr(kept, name), getattr(copied, name))
    calls.clear()  # two exports share the original's calls by the images' bytes: their batches come to the host
    run_campaigns(original, [compressed, compressed], seeds, strategy=strategy, max_queries=10, timeout=1e6,
                  progress=False)
    assert not calls
