"""Data specs -> ImageSet: every spec form, slicing, and one-line errors for bad specs."""
import gzip
import pickle

import numpy as np
import pytest

from mlflow_di.data import ImageSet, load_images, to_uint8
from mlflow_di.errors import UserError


def _write_idx(path, array, gz=True):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    opener = gzip.open if gz else open
    with opener(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def test_digits_is_raw_uint8_nhwc():
    data = load_images("digits")
    assert data.images.shape == (1797, 8, 8, 1) and data.images.dtype == np.uint8
    assert data.images.max() == 255 and data.images.min() == 0  # 0..16 scaled to 0..255
    assert sorted(np.unique(data.labels)) == list(range(10))


def test_slice_suffix_keeps_the_window():
    full = load_images("digits")
    part = load_images("digits[10:15]")
    np.testing.assert_array_equal(part.images, full.images[10:15])
    assert len(load_images("digits[-7:]")) == 7
    assert len(load_images("digits[:3]")) == 3


def test_mnist_idx_reader(tmp_path, rng):
    images = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5, 9], dtype=np.uint8)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels, gz=False)
    data = load_images(f"mnist:{tmp_path}[1:4]")
    np.testing.assert_array_equal(data.images[..., 0], images[1:4])
    np.testing.assert_array_equal(data.labels, [1, 4, 1])


def test_real_mnist_test_split(mnist_spec):
    data = load_images(mnist_spec)
    assert data.images.shape == (10000, 28, 28, 1)
    assert data.labels[:5].tolist() == [7, 2, 1, 0, 4]


def test_npz_accepts_uint8_and_unit_floats(tmp_path, rng):
    raw = rng.integers(0, 256, (4, 5, 5, 3), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", x=raw, y=[0, 1, 2, 3])
    np.savez(tmp_path / "b.npz", x=raw / 255.0, y=[0, 1, 2, 3])
    np.testing.assert_array_equal(load_images(f"npz:{tmp_path / 'a.npz'}").images, raw)
    np.testing.assert_array_equal(load_images(f"npz:{tmp_path / 'b.npz'}").images, raw)


def test_folder_of_class_subfolders(tmp_path):
    from PIL import Image

    for label, name in enumerate(["cat", "dog"]):
        (tmp_path / name).mkdir()
        for i in range(2):
            Image.fromarray(np.full((6, 6), 40 * label + i, np.uint8)).save(tmp_path / name / f"{i}.png")
    data = load_images(f"folder:{tmp_path}")
    assert data.images.shape == (4, 6, 6, 1)
    assert data.labels.tolist() == [0, 0, 1, 1]
    assert data.images[2, 0, 0, 0] == 40


def test_cifar10_python_batch(tmp_path, rng):
    raw = rng.integers(0, 256, (3, 3 * 32 * 32), dtype=np.uint8)
    with open(tmp_path / "test_batch", "wb") as handle:
        pickle.dump({b"data": raw, b"labels": [7, 8, 9]}, handle)
    data = load_images(f"cifar10:{tmp_path}")
    assert data.images.shape == (3, 32, 32, 3)
    assert data.images[0, 0, 0].tolist() == [raw[0, 0], raw[0, 1024], raw[0, 2048]]  # planar RGB -> HWC


@pytest.mark.parametrize("spec, fragment", [
    ("", "empty data spec"),
    ("imagenet:/x", "unknown data spec"),
    ("mnist:", "needs a path"),
    ("mnist:/does/not/exist", "does not exist"),
    ("digits[5:2]", "selects no images"),
    ("digits[a:b]", "bad slice"),
    ("digits:foo", "takes no path"),
])
def test_bad_specs_say_what_is_wrong(spec, fragment):
    with pytest.raises(UserError, match=fragment):
        load_images(spec)


def test_nan_and_out_of_range_values_are_rejected(tmp_path):
    np.savez(tmp_path / "nan.npz", x=np.array([[[np.nan]]]), y=[0])
    np.savez(tmp_path / "big.npz", x=np.array([[[300.0]]]), y=[0])
    with pytest.raises(UserError, match="NaN"):
        load_images(f"npz:{tmp_path / 'nan.npz'}")
    with pytest.raises(UserError, match="values in"):
        load_images(f"npz:{tmp_path / 'big.npz'}")
    with pytest.raises(UserError, match="needs arrays"):
        np.savez(tmp_path / "bad.npz", images=np.zeros((1, 2, 2)))
        load_images(f"npz:{tmp_path / 'bad.npz'}")


def test_imageset_checks_lengths_and_dtype():
    with pytest.raises(UserError, match="labels"):
        ImageSet(np.zeros((2, 4, 4, 1), np.uint8), np.zeros(3), "x")
    with pytest.raises(UserError, match="uint8"):
        ImageSet(np.zeros((2, 4, 4, 1), np.float32), np.zeros(2), "x")
    assert to_uint8(np.array([0.0, 0.5, 1.0]), "x").tolist() == [0, 128, 255]
