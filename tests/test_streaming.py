"""Data bigger than memory: lazy folder:/npz: sets, the resize/center_crop step, and engines that stream.

What is checked: loading and slicing read nothing; indexing reads only what it names; coverage,
fuzzing and calibration read one batch at a time and never the whole set (``np.asarray`` of a
lazy set is made to fail); their results equal those of the same data held in memory; a bad file
met mid-stream is the same one-line error as when read directly; the raw-image step gives
torchvision's pixels.
"""
import mlflow_di  # noqa: F401  (torchvision guard first)
import numpy as np
import pytest
from PIL import Image

from mlflow_di import data as data_module
from mlflow_di.data import ImageSet, LazyImages, load_images
from mlflow_di.errors import UserError
from mlflow_di.models.preprocessing import ModelInputs, Preprocessing, center_crop, resize_shorter_side


@pytest.fixture()
def decodes(monkeypatch):
    """Every image file decode, as the list of sizes of the reads that made them."""
    reads: list[int] = []
    original = data_module._ImageFiles.read

    def counted(self, positions):
        reads.append(len(positions))
        return original(self, positions)

    monkeypatch.setattr(data_module._ImageFiles, "read", counted)
    return reads


@pytest.fixture()
def never_whole(monkeypatch):
    """Make reading a whole lazy set at once (np.asarray) fail: the engines must stream."""
    def refuse(self, dtype=None, copy=None):
        raise AssertionError(f"{self!r} was read whole")

    monkeypatch.setattr(LazyImages, "__array__", refuse)


def write_folder(root, images, labels, suffix=".png"):
    for index, (image, label) in enumerate(zip(images, labels)):
        (root / f"class{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(root / f"class{label}" / f"{index:04d}{suffix}")
    return f"folder:{root}"


@pytest.fixture(scope="module")
def digits_on_disk(tmp_path_factory):
    """The first 150 digits (sorted by label, as a folder lists them) in memory, as a PNG folder and as npz files."""
    full = load_images("digits[0:150]")
    order = np.argsort(full.labels, kind="stable")
    memory = ImageSet(full.images[order], full.labels[order], "digits sorted")
    root = tmp_path_factory.mktemp("digits")
    folder = write_folder(root / "folder", memory.images, memory.labels)
    np.savez(root / "stored.npz", x=memory.images, y=memory.labels)
    np.savez_compressed(root / "deflated.npz", x=memory.images[..., 0], y=memory.labels)
    return memory, {"folder": folder, "stored": f"npz:{root / 'stored.npz'}", "deflated": f"npz:{root / 'deflated.npz'}"}


# ------------------------------------------------------------------------------------------- lazy sets
@pytest.mark.parametrize("kind", ["folder", "stored", "deflated"])
def test_lazy_sets_index_like_the_array(digits_on_disk, kind, rng):
    memory, specs = digits_on_disk
    lazy = load_images(specs[kind])
    assert isinstance(lazy.images, LazyImages)
    assert lazy.images.shape == memory.images.shape and lazy.images.dtype == np.uint8 and lazy.images.ndim == 4
    np.testing.assert_array_equal(lazy.labels, memory.labels)
    picks = rng.permutation(len(memory))[:20]  # out of order: a deflated member restarts its stream
    mask = rng.random(len(memory)) < 0.3
    for index in (5, -1, slice(10, 30), slice(None, None, 7), picks, mask, [3, 4, 5, 90]):
        np.testing.assert_array_equal(lazy.images[index], memory.images[index])
    np.testing.assert_array_equal(lazy.images[2, 0, 0], memory.images[2, 0, 0])
    np.testing.assert_array_equal(np.asarray(lazy.images), memory.images)
    assert [len(b) for b in lazy.batches(64)] == [64, 64, 22]


def test_loading_and_slicing_a_folder_decode_nothing(digits_on_disk, decodes):
    memory, specs = digits_on_disk
    data = load_images(specs["folder"] + "[10:40]")
    part = data.subset(np.arange(0, 30, 3)).subset(slice(2, 6))
    first, rest = data.split(5)
    assert decodes == []
    assert all(isinstance(d.images, LazyImages) for d in (data, part, first, rest))
    np.testing.assert_array_equal(part.images[:], memory.images[10:40][np.arange(0, 30, 3)][2:6])
    np.testing.assert_array_equal(part.labels, memory.labels[10:40][np.arange(0, 30, 3)][2:6])
    assert sum(decodes) == 1 + 4  # the first image (to learn the shape), then the four asked for


def test_stored_npz_is_read_at_row_offsets_not_loaded(digits_on_disk, monkeypatch):
    memory, specs = digits_on_disk
    data = load_images(specs["stored"])
    rows = data.images._source
    assert rows.stored and rows.data_offset > 0
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("the images were loaded with np.load"))
    np.testing.assert_array_equal(data.images[100:103], memory.images[100:103])


def test_float_npz_is_scaled_from_a_range_found_by_scanning(tmp_path, rng, monkeypatch):
    raw = rng.integers(0, 256, (40, 5, 5, 3), dtype=np.uint8)
    np.savez(tmp_path / "unit.npz", x=raw / 255.0, y=np.zeros(40))
    monkeypatch.setattr(data_module, "_SCAN_BYTES", 5 * 5 * 3 * 8 * 7)  # 7 rows per scan chunk
    data = load_images(f"npz:{tmp_path / 'unit.npz'}")
    np.testing.assert_array_equal(data.images[:], raw)
    bad = raw / 255.0
    bad[33, 0, 0, 0] = np.nan  # in a later chunk than the first
    np.savez(tmp_path / "nan.npz", x=bad, y=np.zeros(40))
    with pytest.raises(UserError, match="NaN"):
        load_images(f"npz:{tmp_path / 'nan.npz'}")


def test_fortran_ordered_npz_is_read_whole(tmp_path, rng):
    raw = np.asfortranarray(rng.integers(0, 256, (6, 4, 4, 1), dtype=np.uint8))
    np.savez(tmp_path / "f.npz", x=raw, y=np.arange(6))
    np.testing.assert_array_equal(load_images(f"npz:{tmp_path / 'f.npz'}").images, raw)


def test_truncated_npz_is_a_one_line_error_when_read(tmp_path, rng):
    np.savez(tmp_path / "t.npz", x=rng.integers(0, 256, (50, 16, 16, 3), dtype=np.uint8), y=np.arange(50))
    data = load_images(f"npz:{tmp_path / 't.npz'}")
    whole = (tmp_path / "t.npz").read_bytes()
    (tmp_path / "t.npz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match="truncated") as caught:
        data.images[40:50]
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------------------- raw-image step
def test_resize_and_center_crop_by_hand():
    image = np.arange(4 * 6, dtype=np.uint8).reshape(4, 6, 1)
    assert resize_shorter_side(image, 2).shape == (2, 3, 1)  # shorter side 4 -> 2, longer 6 -> int(2 * 6 / 4)
    assert resize_shorter_side(image, 4) is image  # already that size: untouched
    flat = np.full((4, 6, 3), 77, np.uint8)
    assert (resize_shorter_side(flat, 9) == 77).all()  # bilinear keeps a flat image flat
    crop = center_crop(image, 2, 2)  # rows round((4-2)/2)=1.., columns round((6-2)/2)=2..
    np.testing.assert_array_equal(crop[..., 0], [[8, 9], [14, 15]])
    padded = center_crop(np.full((2, 2, 1), 5, np.uint8), 4, 4)  # smaller: zero-padded around, as torchvision
    np.testing.assert_array_equal(padded[..., 0], [[0, 0, 0, 0], [0, 5, 5, 0], [0, 5, 5, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("shape", [(300, 500, 3), (500, 300, 3), (100, 120, 3), (224, 224, 3), (37, 300, 3), (200, 150, 1)])
def test_raw_step_is_torchvisions_eval_transform(shape, rng):
    from torchvision import transforms

    image = rng.integers(0, 256, shape, dtype=np.uint8)
    ours = Preprocessing().override("resize=256,center_crop=224").raw_image(image)
    pil = Image.fromarray(image[..., 0] if shape[2] == 1 else image)
    theirs = np.asarray(transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224)])(pil))
    np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))


def test_raw_step_fields_round_trip_and_bad_values_are_one_line():
    pre = Preprocessing().override("resize=40,center_crop=32/24")
    assert (pre.resize, pre.center_crop) == (40, (32, 24))
    assert Preprocessing.from_json(pre.to_json()) == pre
    assert "resize" not in Preprocessing().to_dict()  # models without the step: the metadata older readers know
    for text, fragment in (("resize=0", "resize"), ("center_crop=1/2/3", "center_crop"), ("resize=2.5", "resize")):
        with pytest.raises(UserError, match=fragment) as caught:
            Preprocessing().override(text)
        assert "\n" not in str(caught.value)


@pytest.fixture()
def mixed_folder(tmp_path, rng):
    sizes = [(30, 40), (50, 20), (64, 64), (28, 28), (33, 90)]
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    for index, image in enumerate(images):
        (tmp_path / f"c{index % 2}").mkdir(exist_ok=True)
        Image.fromarray(image).save(tmp_path / f"c{index % 2}" / f"{index}.png")
    order = [0, 2, 4, 1, 3]  # c0 holds 0, 2, 4; c1 holds 1, 3
    return f"folder:{tmp_path}", [images[i] for i in order]


def test_mixed_sizes_come_out_at_the_model_size(mixed_folder, decodes):
    spec, images = mixed_folder
    pre = Preprocessing(resize=32, center_crop=28, input_shape=(28, 28, 3))
    data = pre.prepare(load_images(spec))
    assert decodes == [] and data.images.shape == (5, 28, 28, 3)
    got = data.images[:]
    for image, out in zip(images, got):
        np.testing.assert_array_equal(out, center_crop(resize_shorter_side(image, 32), 28, 28))
    assert pre.apply(got).shape == (5, 3, 28, 28)
    raw = np.stack([images[4], images[4]])  # 28x28 already: apply leaves it as it is
    np.testing.assert_array_equal(pre.apply(raw), Preprocessing(input_shape=(28, 28, 3)).apply(raw))
    other = np.stack([images[1], images[1]])  # a 64x64 raw array: apply runs the step itself
    np.testing.assert_array_equal(pre.apply(other), pre.apply(np.stack([pre.raw_image(images[1])] * 2)))


def test_mixed_sizes_without_a_step_name_the_file_and_the_fix(mixed_folder):
    spec, _ = mixed_folder
    data = load_images(spec)
    assert data.images[0].shape == (30, 40, 3)
    with pytest.raises(UserError) as caught:
        data.images[:]
    message = str(caught.value)
    assert "\n" not in message and "2.png" in message and "64x64x3" in message and "resize=" in message


# ------------------------------------------------------------------------- engines that stream
def tiny_model():
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    return TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing, name="digits-cnn")


@pytest.mark.parametrize("kind", ["folder", "stored"])
def test_coverage_streams_and_equals_the_in_memory_result(digits_on_disk, kind, decodes, never_whole):
    from mlflow_di.coverage.suite import CoverageSuite

    memory, specs = digits_on_disk
    model = tiny_model()
    lazy = load_images(specs[kind])

    def run(train):
        suite = CoverageSuite(top_m=3, only_correct=False, batch_size=32, progress=False).fit(model, train)
        return suite.score(train.subset(slice(0, 100), "test"))

    streamed, held = run(lazy), run(memory)
    assert streamed.metrics() == held.metrics()
    np.testing.assert_array_equal(streamed.idc[streamed.primary].combination, held.idc[held.primary].combination)
    assert max(decodes, default=0) <= 32


def test_a_bad_file_mid_stream_is_the_same_one_line_error(digits_on_disk, tmp_path):
    from mlflow_di.coverage.suite import CoverageSuite

    memory, _ = digits_on_disk
    spec = write_folder(tmp_path, memory.images[:80], np.zeros(80, int))
    victim = tmp_path / "class0" / "0070.png"
    victim.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    data = load_images(spec)
    with pytest.raises(UserError) as direct:
        data.images[70]
    with pytest.raises(UserError) as streamed:
        CoverageSuite(criteria="idc,nc", top_m=2, only_correct=False, batch_size=16, progress=False).fit(tiny_model(), data)
    assert str(streamed.value) == str(direct.value)
    assert "\n" not in str(direct.value) and "0070.png" in str(direct.value)


def test_an_interrupt_mid_stream_propagates(digits_on_disk, monkeypatch):
    from mlflow_di.coverage.suite import CoverageSuite

    memory, specs = digits_on_disk
    calls = []

    def interrupted(path):
        calls.append(path)
        if len(calls) > 40:
            raise KeyboardInterrupt
        return np.zeros((8, 8), np.uint8)

    monkeypatch.setattr(data_module, "_read_image", interrupted)
    with pytest.raises(KeyboardInterrupt):
        CoverageSuite(criteria="nc", batch_size=16, progress=False).fit(tiny_model(), load_images(specs["folder"]))
    assert len(calls) == 41


def test_fuzz_seeds_stream_and_match_the_in_memory_campaign(digits_on_disk, decodes, never_whole):
    from mlflow_di.fuzz import run_campaign
    from mlflow_di.fuzz.seeds import seed_fingerprint

    memory, specs = digits_on_disk
    lazy = load_images(specs["folder"])
    assert seed_fingerprint(lazy) == seed_fingerprint(memory)
    model = tiny_model()
    original = model.classifier()
    compressed = tiny_model().classifier()
    import torch

    with torch.no_grad():  # a slightly different "compressed" twin, so the pair can disagree
        next(compressed.module.parameters()).mul_(0.9)

    def run(seeds):
        result = run_campaign(original, compressed, seeds.subset(slice(0, 40)), max_queries=3, batch=8, seed=1,
                              progress=False)
        return [{k: v for k, v in r.to_dict().items() if k != "seconds"} for r in result.records]

    decodes.clear()
    assert run(lazy) == run(memory)
    assert max(decodes) <= 40


def test_calibration_reads_one_batch_at_a_time(digits_on_disk, never_whole, monkeypatch):
    from mlflow_di.compression import methods, quantize

    memory, specs = digits_on_disk
    model = tiny_model()
    lazy = load_images(specs["stored"])
    inputs = methods.calibration_inputs(lazy.images, model.preprocessing)
    assert isinstance(inputs, ModelInputs) and inputs.shape == (150, 1, 8, 8)
    reader = quantize.ArrayCalibrationReader("x", inputs, batch_size=64, progress=False)
    sizes = []
    while (batch := reader.get_next()) is not None:
        sizes.append(len(batch["x"]))
        assert batch["x"].dtype == np.float32
    assert sizes == [64, 64, 22]
    np.testing.assert_array_equal(inputs[0:150], model.preprocessing.apply(memory.images))


def test_static_int8_from_lazy_images_equals_the_in_memory_one(digits_on_disk, tmp_path, never_whole):
    from mlflow_di.compression import compress
    from mlflow_di.models.classifier import OnnxClassifier

    memory, specs = digits_on_disk
    model = tiny_model()
    lazy = compress(model.module, model.preprocessing, "int8-static", tmp_path / "lazy",
                    calib_inputs=load_images(specs["stored"]).images)
    held = compress(model.module, model.preprocessing, "int8-static", tmp_path / "held", calib_inputs=memory.images)
    probe = memory.images[:50]
    np.testing.assert_array_equal(OnnxClassifier(lazy.path).predict_proba(probe),
                                  OnnxClassifier(held.path).predict_proba(probe))
    assert lazy.params["calibration_samples"] == 150


def _fitted_bytes(value, seen=None) -> int:
    """Bytes of every numpy array a fitted estimator holds (its attached model left out)."""
    import torch

    from mlflow_di.models.torch_model import TorchModel

    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (TorchModel, torch.nn.Module)):
        return 0
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_fitted_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_fitted_bytes(v, seen) for v in value)
    return sum(_fitted_bytes(v, seen) for v in getattr(value, "__dict__", {}).values())


def test_a_fit_keeps_only_the_surprise_traces_per_training_input():
    """Fitted state grows with the training set only by what SA needs: each input's SA trace (held as
    ClassicCoverage.sa_traces_ float32, DSA's float64 references, LSA's whitened float64 points) and a few
    scalars per input (classes, DSA's reference distance, LSA's squared norm); IDC keeps nothing per input (the
    combinations the analysis inputs realise are at most all of its combinations, 4^3 here, whatever their count)."""
    from mlflow_di.coverage.suite import CoverageSuite

    model, full = tiny_model(), load_images("digits[0:600]")

    def fitted(count):
        return CoverageSuite(top_m=3, only_correct=False, batch_size=64, progress=False).fit(
            model, full.subset(slice(0, count), f"{count}"))

    small, big = fitted(150), fitted(600)
    for suite in (small, big):  # importance per neuron; per important neuron: index, silhouette, <= 4 centroids;
        layer = suite.idc_.fitted_layers_[suite.primary_]  # the reachable combination ids: at most 4^3
        assert _fitted_bytes(suite.idc_) <= 8 * len(layer.importance) + 3 * (8 + 8 + 4 * 8) + 8 * 4 ** 3
    width = big.classic_.sa_traces_.shape[1]
    per_input = (_fitted_bytes(big.classic_) - _fitted_bytes(small.classic_)) / 450
    assert per_input <= (4 + 8 + 8) * width + 5 * 8, per_input
