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


def _write_split(folder, prefix, images, labels, gz):
    _write_idx(folder / f"{prefix}-images-idx3-ubyte{'.gz' if gz else ''}", images, gz=gz)
    _write_idx(folder / f"{prefix}-labels-idx1-ubyte{'.gz' if gz else ''}", labels, gz=gz)


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_mnist_train_and_test_specs_read_their_own_split(tmp_path, rng, gz):
    train_images = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    test_images = rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    _write_split(tmp_path, "train", train_images, np.array([0, 1, 2, 3, 4, 5, 6]), gz)
    _write_split(tmp_path, "t10k", test_images, np.array([9, 8, 7]), gz)
    train = load_images(f"mnist-train:{tmp_path}")
    np.testing.assert_array_equal(train.images[..., 0], train_images)
    assert train.labels.tolist() == [0, 1, 2, 3, 4, 5, 6]
    test = load_images(f"mnist-test:{tmp_path}")
    np.testing.assert_array_equal(test.images[..., 0], test_images)
    assert test.labels.tolist() == [9, 8, 7]
    np.testing.assert_array_equal(load_images(f"mnist:{tmp_path}").images, test.images)  # mnist: is the test split
    part = load_images(f"mnist-train:{tmp_path}[2:-1]")
    assert part.labels.tolist() == [2, 3, 4, 5] and part.name == f"mnist-train:{tmp_path}[2:-1]"
    np.testing.assert_array_equal(part.images[..., 0], train_images[2:-1])


def test_strict_mnist_specs_never_substitute_the_other_split(tmp_path, rng):
    _write_split(tmp_path, "train", rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), np.arange(4), gz=True)
    assert len(load_images(f"mnist:{tmp_path}")) == 4  # the compatible spec still falls back to train
    message = _one_line_user_error(f"mnist-test:{tmp_path}", "test split", "t10k-images-idx3-ubyte[.gz]")
    assert "train-" not in message
    (tmp_path / "train-labels-idx1-ubyte.gz").unlink()
    _one_line_user_error(f"mnist-train:{tmp_path}", "train split", "train-labels-idx1-ubyte[.gz]")
    _one_line_user_error(f"mnist:{tmp_path}", "test split", "train split")
    _one_line_user_error("mnist-train:", "needs a path after 'mnist-train:'")


def test_mnist_images_and_labels_of_different_lengths_name_both_files(tmp_path, rng):
    _write_split(tmp_path, "train", rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), np.arange(4), gz=False)
    _one_line_user_error(f"mnist-train:{tmp_path}", "train-images-idx3-ubyte", "5 images", "4 labels")


def test_real_mnist_train_split_has_the_published_label_counts(shared_dir):
    data = load_images(f"mnist-train:{shared_dir / 'data' / 'mnist'}")
    assert data.images.shape == (60000, 28, 28, 1)
    published = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]  # shared/README.md
    assert np.bincount(data.labels, minlength=10).tolist() == published


def test_real_mnist_test_split(mnist_spec, shared_dir):
    data = load_images(mnist_spec)
    assert data.images.shape == (10000, 28, 28, 1)
    assert data.labels[:5].tolist() == [7, 2, 1, 0, 4]
    strict = load_images(f"mnist-test:{shared_dir / 'data' / 'mnist'}[0:5]")
    assert strict.labels.tolist() == [7, 2, 1, 0, 4]


def test_image_sets_put_together_keep_order_and_refuse_other_sizes():
    first, second = load_images("digits[0:3]"), load_images("digits[10:12]")
    both = ImageSet.concatenate([first, second])
    assert both.name == "digits[0:3] + digits[10:12]" and len(both) == 5
    np.testing.assert_array_equal(both.labels, np.concatenate([first.labels, second.labels]))
    np.testing.assert_array_equal(both.images[3:], second.images)
    other = ImageSet(np.zeros((2, 4, 4, 1), np.uint8), [0, 1], "small")
    with pytest.raises(UserError, match="one image size"):
        ImageSet.concatenate([first, other])


def test_lazy_image_sets_put_together_stay_lazy(tmp_path, rng):
    from mlflow_di.data import LazyImages

    raw = rng.integers(0, 256, (7, 5, 5, 1), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", x=raw, y=np.arange(7))
    lazy, eager = load_images(f"npz:{tmp_path / 'a.npz'}[0:4]"), ImageSet(raw[4:], [4, 5, 6], "rest")
    both = ImageSet.concatenate([lazy, eager])
    assert isinstance(both.images, LazyImages) and both.image_shape == (5, 5, 1)
    np.testing.assert_array_equal(both.images[[0, 5, 3, 6]], raw[[0, 5, 3, 6]])
    np.testing.assert_array_equal(np.asarray(both.subset(both.labels % 2 == 0).images), raw[[0, 2, 4, 6]])


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


def _class_folders(root, names):
    from PIL import Image

    for name in names:
        (root / name).mkdir(parents=True)
        Image.fromarray(np.full((6, 6), 7, np.uint8)).save(root / name / "0.png")
    return f"folder:{root}"


def test_a_split_without_a_class_labels_the_others_as_its_siblings_do(tmp_path):
    """Labels come from the class names over every split beside the folder, not from its own index."""
    train = _class_folders(tmp_path / "data" / "train", ["bird", "cat", "dog"])
    test = _class_folders(tmp_path / "data" / "test", ["bird", "dog"])
    assert load_images(train).labels.tolist() == [0, 1, 2]
    assert load_images(test).labels.tolist() == [0, 2]
    from mlflow_di.data import class_names
    from mlflow_di.mlflow_edge.datasets import spec_dataset

    assert class_names(f"{test}[0:1]") == {0: "bird", 1: "cat", 2: "dog"}
    assert spec_dataset(load_images(test)).profile["classes"] == {"0": "bird", "1": "cat", "2": "dog"}


def test_integer_class_folders_are_their_labels(tmp_path):
    assert load_images(_class_folders(tmp_path / "digits", ["3", "7", "10"])).labels.tolist() == [10, 3, 7]


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


def _one_line_user_error(spec, *fragments):
    with pytest.raises(UserError) as caught:
        np.asarray(load_images(spec).images)  # lazy sets (folder:, npz:) find bad files as they read them
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_negative_slices_are_python_slices():
    full = load_images("digits")
    np.testing.assert_array_equal(load_images("digits[-50:]").images, full.images[-50:])
    np.testing.assert_array_equal(load_images("digits[:-1790]").labels, full.labels[:-1790])
    np.testing.assert_array_equal(load_images("digits[-10:-5]").images, full.images[-10:-5])
    np.testing.assert_array_equal(load_images("digits[ -3 : ]").labels, full.labels[-3:])


def test_a_slice_step_is_refused_clearly():
    _one_line_user_error("digits[0:10:2]", "step", "[start:stop]")
    _one_line_user_error("digits[::2]", "step")


def test_corrupt_image_in_a_folder_names_the_file(tmp_path):
    from PIL import Image

    for name in ("cat", "dog"):
        (tmp_path / name).mkdir()
        Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / name / "ok.png")
    (tmp_path / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    message = _one_line_user_error(f"folder:{tmp_path}", "broken.png", "corrupt")
    assert "delete or replace" in message


def test_truncated_png_in_a_folder_is_a_user_error(tmp_path):
    from PIL import Image

    (tmp_path / "a").mkdir()
    Image.fromarray(np.arange(64 * 64, dtype=np.uint32).reshape(64, 64).astype(np.uint8)).save(tmp_path / "a" / "x.png")
    whole = (tmp_path / "a" / "x.png").read_bytes()
    (tmp_path / "a" / "x.png").write_bytes(whole[: len(whole) // 2])
    _one_line_user_error(f"folder:{tmp_path}", "x.png")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_cifar10_batch_is_a_user_error(tmp_path, damage):
    raw = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    with open(tmp_path / "test_batch", "wb") as handle:
        pickle.dump({b"data": raw, b"labels": [1, 2]}, handle)
    whole = (tmp_path / "test_batch").read_bytes()
    (tmp_path / "test_batch").write_bytes(whole[: len(whole) // 2] if damage == "truncate" else b"garbage" * 10)
    message = _one_line_user_error(f"cifar10:{tmp_path}", "test_batch", "corrupt or truncated")
    assert "download" in message


class _RunsCode:
    """What a crafted pickle carries: unpickling it runs ``exec``, which creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_batches_of_any_pickle_protocol_are_read(tmp_path, protocol):
    raw = np.arange(2 * 3072).astype(np.uint8).reshape(2, 3072)
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": raw, b"labels": [1, 2], b"batch_label": b"test",
                                                        b"filenames": [b"a.png", b"b.png"]}, protocol=protocol))
    assert load_images(f"cifar10:{tmp_path}").labels.tolist() == [1, 2]


def test_a_cifar10_batch_that_would_run_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": _RunsCode(marker), b"labels": [1]}))
    message = _one_line_user_error(f"cifar10:{tmp_path}", "test_batch", "builtins.exec")
    assert "nothing of it was run" in message and not marker.exists()


def test_complex_pixels_are_refused(tmp_path):
    np.savez(tmp_path / "c.npz", x=np.zeros((2, 8, 8), np.complex64), y=np.array([0, 1]))
    _one_line_user_error(f"npz:{tmp_path / 'c.npz'}", "real numbers")


def test_cifar10_batch_of_the_wrong_shape_is_a_user_error(tmp_path):
    with open(tmp_path / "test_batch", "wb") as handle:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [1, 2]}, handle)
    _one_line_user_error(f"cifar10:{tmp_path}", "test_batch", "3072")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "corrupt_body"])
def test_corrupt_gzip_idx_is_a_user_error(tmp_path, rng, damage):
    images = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(6))
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    whole = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(whole[: len(whole) // 2])
    elif damage == "garbage":
        path.write_bytes(b"this is not gzip at all")
    else:
        path.write_bytes(whole[:20] + bytes(255 - b for b in whole[20:]))
    message = _one_line_user_error(f"mnist:{tmp_path}", "t10k-images-idx3-ubyte.gz")
    assert "download" in message
