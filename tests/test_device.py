"""--device: parsing, CUDA asked for where there is none, and engines following the module's device."""
import numpy as np
import pytest
import torch
from torch import nn

from mlflow_di.cli import main
from mlflow_di.errors import UserError
from mlflow_di.models.device import check_device_spec, module_device, onnx_providers, resolve_device


@pytest.mark.parametrize("spec, expected", [("auto", "auto"), (" CPU ", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")])
def test_device_specs_are_normalised(spec, expected):
    assert check_device_spec(spec) == expected


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "mps", ""])
def test_unknown_device_specs_name_the_accepted_forms(spec):
    with pytest.raises(UserError, match="give auto .* cpu, cuda or cuda:N"):
        check_device_spec(spec)


def test_auto_is_the_cpu_without_a_gpu_and_cpu_is_always_the_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line_with_the_fix(capsys, tmp_path):
    with pytest.raises(UserError, match="--device cuda:0 asks for a CUDA GPU, but .* use --device cpu or auto"):
        resolve_device("cuda:0")
    torch.save(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)), tmp_path / "model.pt")
    assert main(["describe", str(tmp_path / "model.pt"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "asks for a CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_a_bad_device_is_a_usage_error_before_any_work(capsys):
    assert main(["describe", "model.pt", "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_module_device_follows_parameters_then_buffers():
    assert module_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert module_device(nn.ReLU()) == torch.device("cpu")


def test_onnx_runtime_gets_the_cpu_provider_when_asked_or_without_a_gpu_build():
    assert onnx_providers("cpu") == ["CPUExecutionProvider"]
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert onnx_providers("cuda:0") == ["CPUExecutionProvider"]
        assert onnx_providers(None) == ["CPUExecutionProvider"]


def test_out_of_memory_becomes_one_line_naming_the_batch_size():
    from mlflow_di.models.device import out_of_memory_as_user_error

    with pytest.raises(UserError, match=r"ran out of memory during coverage; lower --batch-size \(e.g. --batch-size 64\)"):
        with out_of_memory_as_user_error("coverage", 256):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_preprocessing_on_a_device_equals_the_numpy_path():
    from mlflow_di.models.preprocessing import Preprocessing

    images = np.random.default_rng(0).integers(0, 256, (3, 5, 4, 3), dtype=np.uint8)
    for layout in ("NCHW", "NHWC"):
        preprocessing = Preprocessing(scale=1 / 255, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.25), layout=layout,
                                      input_shape=(5, 4, 3))
        on_device = preprocessing.apply_on(images, torch.device("cpu")).numpy()
        np.testing.assert_array_equal(on_device, preprocessing.apply(images))


def test_coverage_inputs_are_preprocessed_where_their_batches_go(monkeypatch):
    """On a GPU the uint8 slice travels and torch preprocesses it there; on the CPU NumPy does it."""
    from mlflow_di.coverage.activations import PreprocessedImages, iter_batches
    from mlflow_di.models.preprocessing import Preprocessing

    images = np.random.default_rng(1).integers(0, 256, (5, 4, 4, 3), dtype=np.uint8)
    preprocessing = Preprocessing(scale=1 / 255, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.25), input_shape=(4, 4, 3))
    inputs = PreprocessedImages(images, preprocessing)
    on_cpu = [batch.numpy() for batch in iter_batches(inputs, 2, torch.device("cpu"))]
    np.testing.assert_array_equal(np.concatenate(on_cpu), preprocessing.apply(images))
    assert inputs.on("cpu").device is None  # the CPU keeps NumPy's preprocessing
    asked = []
    original_on = PreprocessedImages.on
    monkeypatch.setattr(PreprocessedImages, "on", lambda self, device: asked.append(device) or original_on(self, device))
    list(iter_batches(inputs, 2, torch.device("cpu")))
    assert asked == [torch.device("cpu")]  # iter_batches hands the batches' device to the images

    calls = []
    def apply_on(self, raw, device):
        calls.append((len(raw), device))
        return torch.from_numpy(self.apply(raw))
    monkeypatch.setattr(Preprocessing, "apply_on", apply_on)
    on_gpu = inputs.on("cuda:0")
    np.testing.assert_array_equal(on_gpu[1:4].numpy(), preprocessing.apply(images[1:4]))
    assert calls == [(3, torch.device("cuda:0"))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_coverage_inputs_preprocessed_on_the_gpu_equal_numpy_s():
    from mlflow_di.coverage.activations import PreprocessedImages, iter_batches
    from mlflow_di.models.preprocessing import Preprocessing

    images = np.random.default_rng(2).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    preprocessing = Preprocessing(scale=1.0, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375),
                                  input_shape=(32, 32, 3))
    batches = list(iter_batches(PreprocessedImages(images, preprocessing), 4, torch.device("cuda")))
    assert all(batch.is_cuda for batch in batches)
    np.testing.assert_array_equal(torch.cat(batches).cpu().numpy(), preprocessing.apply(images))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_overlapped_campaign_on_the_gpu_has_the_records_of_a_plain_one():
    # CUDA models, the device operators in the main thread, the models' calls on the thread's own streams
    from mlflow_di.data import ImageSet
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.device_mutations import with_operators_on
    from mlflow_di.fuzz.dflare import DFlare
    from mlflow_di.fuzz.results import comparable_records
    from mlflow_di.models.classifier import TorchClassifier
    from mlflow_di.models.preprocessing import Preprocessing

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    preprocessing = Preprocessing(scale=1 / 255, input_shape=(32, 32, 3))
    original = TorchClassifier(net.to("cuda"), preprocessing, "net")
    copy = TorchClassifier(nn.Sequential(*net), preprocessing, "copy")  # the same weights: budgets end the searches
    images = np.random.default_rng(0).integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    seeds = ImageSet(images, np.zeros(16, np.int64), "generated")
    strategy = with_operators_on(DFlare(), torch.device("cuda"))
    plain, overlapped = (run_campaign(original, copy, seeds, strategy=strategy, max_queries=40, batch=4,
                                      progress=False, overlap=overlap) for overlap in (False, True))
    assert comparable_records(plain) == comparable_records(overlapped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True])
def test_a_campaign_that_keeps_its_batches_on_the_gpu_has_the_records_of_one_that_copies_them(monkeypatch, overlap):
    # the models take the mutants where the operators made them (fuzz/population.py); overlapped, the models'
    # thread reads them on its own CUDA stream
    from mlflow_di.data import ImageSet
    from mlflow_di.fuzz import lockstep
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.device_mutations import with_operators_on
    from mlflow_di.fuzz.dflare import DFlare
    from mlflow_di.fuzz.results import comparable_records
    from tests.test_fuzz_device_mutations import _torch_pair

    original, compressed = _torch_pair(0.002)
    original.module.to("cuda")
    compressed.module.to("cuda")
    images = np.random.default_rng(5).integers(0, 256, (12, 12, 12, 3), dtype=np.uint8)
    seeds = ImageSet(images, np.zeros(12, np.int64), "generated")
    strategy = with_operators_on(DFlare(), torch.device("cuda"))

    def campaign():
        return run_campaign(original, compressed, seeds, strategy=strategy, max_queries=60, timeout=1e6, batch=6,
                            progress=False, overlap=overlap)

    kept = campaign()
    monkeypatch.setattr(lockstep, "takes_device_batches", lambda model, device: False)
    copied = campaign()
    assert kept.summary.triggers > 0 and comparable_records(kept) == comparable_records(copied)
    np.testing.assert_array_equal(kept.triggers, copied.triggers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_exact_device_operators_give_the_cpu_bytes_on_the_gpu():
    # salt and pepper, pixel change, the Gaussian and median blurs and the odd box blurs (fuzz/device_mutations.py)
    from mlflow_di.fuzz.device_mutations import on_device
    from mlflow_di.fuzz.mutations import AverageBlur, GaussianBlur, MedianBlur, PixelChange, SaltAndPepper

    cpu = (SaltAndPepper(), PixelChange(max_values=400), GaussianBlur(), MedianBlur(), AverageBlur(kernels=(1, 3, 5)))
    images = [np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8) for seed in range(4)]
    for host, device in zip(cpu, on_device(cpu, torch.device("cuda"))):
        draws = [host.draw(images[0].shape, np.random.default_rng(seed)) for seed in range(4)]
        rows = np.zeros((4, 224, 224, 3), np.uint8)
        device.apply_many(images, draws, rows)
        for image, row, seed in zip(images, rows, range(4)):
            np.testing.assert_array_equal(row, host(image, np.random.default_rng(seed)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_criteria_s_cells_scored_on_the_gpu_are_the_host_s(monkeypatch):
    # the same CUDA model's activations: cells batch by batch on the GPU, or every value to the host first
    from mlflow_di.coverage import criteria as criteria_module
    from mlflow_di.coverage.criteria import ClassicCoverage
    from mlflow_di.data import ImageSet
    from mlflow_di.models.preprocessing import Preprocessing
    from mlflow_di.models.torch_model import TorchModel
    from tests.test_criteria_device import _assert_same_report

    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("conv1", nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()))
    net.add_module("pool", nn.AdaptiveAvgPool2d(2))
    net.add_module("flatten", nn.Flatten())
    net.add_module("fc1", nn.Sequential(nn.Linear(32, 16), nn.ReLU()))
    net.add_module("logits", nn.Linear(16, 10))
    model = TorchModel(net, Preprocessing(scale=1 / 255, input_shape=(32, 32, 3)), "net").to("cuda")
    rng = np.random.default_rng(0)
    train, test = (ImageSet(rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), np.zeros(n, np.int64), name)
                   for n, name in ((300, "train"), (70, "test")))
    coverage = ClassicCoverage(batch_size=32, progress=False, criterion_settings={"kmnc_sections": 100}).fit(model, train)
    on_gpu = coverage.score(test)
    assert "activations_and_cells" in coverage.seconds_
    monkeypatch.setattr(criteria_module, "cells_on_device", lambda device: False)  # LSA and DSA on the host too
    _assert_same_report(on_gpu, coverage.score(test))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_module_s_fingerprint_is_the_same_on_the_gpu():
    from mlflow_di.coverage.idc import module_fingerprint

    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    assert module_fingerprint(module.to("cuda")) == module_fingerprint(module.to("cpu"))
