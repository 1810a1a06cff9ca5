"""Mutation operators: shape, dtype, range (no wrap-around), determinism, parameter ranges."""
import math

import mlflow_di  # noqa: F401  (torchvision guard first)
import cv2
import numpy as np
import pytest

from mlflow_di.fuzz.mutations import (AverageBlur, GaussianBlur, GaussianNoise, MedianBlur, MultiplicativeNoise,
                                      PixelChange, SaltAndPepper, default_operators, mutate_into, operator_names)

OPERATORS = default_operators()
SHAPES = [(28, 28, 1), (8, 8, 3), (5, 7, 2)]


def _images(shape):
    rng = np.random.default_rng(1)
    return {"random": rng.integers(0, 256, shape, dtype=np.uint8),
            "black": np.zeros(shape, np.uint8), "white": np.full(shape, 255, np.uint8)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("operator", OPERATORS, ids=lambda op: op.name)
def test_operator_keeps_shape_dtype_and_leaves_input_alone(operator, shape):
    rng = np.random.default_rng(0)
    for image in _images(shape).values():
        before = image.copy()
        for _ in range(20):
            out = operator(image, rng)
            assert out.shape == shape and out.dtype == np.uint8
        np.testing.assert_array_equal(image, before)


@pytest.mark.parametrize("operator", OPERATORS, ids=lambda op: op.name)
def test_operator_is_deterministic_for_a_seed(operator):
    image = _images((28, 28, 1))["random"]
    first = [operator(image, rng) for rng in [np.random.default_rng(7)] for _ in range(5)]
    again = [operator(image, rng) for rng in [np.random.default_rng(7)] for _ in range(5)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_noise_saturates_instead_of_wrapping():
    rng = np.random.default_rng(0)
    white, black = np.full((28, 28, 1), 255, np.uint8), np.zeros((28, 28, 1), np.uint8)
    for _ in range(50):
        # wrap-around would turn 255 + noise into values near 0 and 0 - noise into values near 255
        assert GaussianNoise()(white, rng).min() >= 250
        assert GaussianNoise()(black, rng).max() <= 5
        assert MultiplicativeNoise(mean_low=0.4, mean_high=0.5, var_max=0.001)(white, rng).min() == 255
    mid = np.full((28, 28, 1), 200, np.uint8)
    brightened = MultiplicativeNoise(mean_low=0.49, mean_high=0.5, var_max=0.0)(mid, rng)
    assert brightened.min() == 255  # 200 * 1.49 = 298 clips to 255


def test_saturation_rounds_half_to_even_and_clips_like_numpy():
    from mlflow_di.fuzz.mutations import _saturate

    ties = np.arange(-3, 260, 0.5, dtype=np.float32)
    spread = np.random.default_rng(0).normal(128, 200, 30_000).astype(np.float32)
    for values in (ties.reshape(1, -1, 1), spread.reshape(100, 100, 3)):
        expected = np.clip(np.rint(values), 0, 255).astype(np.uint8)
        np.testing.assert_array_equal(_saturate(values.copy()), expected)
    assert _saturate(np.array([[[0.5, 1.5, 2.5, -0.5, 255.5]]], np.float32)).tolist() == [[[0, 2, 2, 0, 255]]]


def test_gaussian_noise_is_unbiased_and_small():
    rng = np.random.default_rng(0)
    image = np.full((64, 64, 1), 128, np.uint8)
    out = np.stack([GaussianNoise()(image, rng) for _ in range(20)]).astype(int) - 128
    assert abs(out.mean()) < 0.01                      # rounding, not truncation: no darkening
    changed = np.mean(out != 0)                        # P(|N(0, 0.316)| > 0.5) = 0.114
    assert 0.10 < changed < 0.13
    assert np.abs(out).max() <= 2


def test_pixel_change_changes_at_most_nine_values_and_sometimes_none():
    rng = np.random.default_rng(0)
    image = np.full((28, 28, 1), 77, np.uint8)  # 77 is rarely drawn, so changes are visible
    counts = [int(np.sum(PixelChange()(image, rng) != image)) for _ in range(400)]
    assert max(counts) <= 9 and min(counts) == 0 and max(counts) >= 8


def test_salt_and_pepper_amount():
    rng = np.random.default_rng(0)
    image = np.full((28, 28, 1), 128, np.uint8)
    per_kind = math.ceil(0.004 * image.size * 0.5)  # 2 of 784 values each
    for _ in range(100):
        out = SaltAndPepper()(image, rng)
        assert 1 <= np.sum(out == 255) <= per_kind and 1 <= np.sum(out == 0) <= per_kind
        assert np.sum(out != image) <= 2 * per_kind


@pytest.mark.parametrize("operator", [AverageBlur(kernels=(1,)), GaussianBlur(kernels=(1,)), MedianBlur(kernels=(1,))],
                         ids=lambda op: op.name)
def test_blur_with_kernel_one_is_identity(operator):
    image = _images((9, 9, 3))["random"]
    np.testing.assert_array_equal(operator(image, np.random.default_rng(0)), image)


@pytest.mark.parametrize("shape", [(9, 9, 1), (28, 28, 1), (9, 9, 3), (32, 32, 4), (224, 224, 3)])
def test_the_kernel_one_shortcut_gives_opencv_s_bytes_in_a_new_array(shape):
    # the blurs return a copy for k = 1 instead of filtering: OpenCV's own 1x1 filters are the identity
    image = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    for operator, opencv in [(AverageBlur(kernels=(1,)), cv2.blur(image, (1, 1))),
                             (GaussianBlur(kernels=(1,)), cv2.GaussianBlur(image, (1, 1), 0))]:
        out = operator(image, np.random.default_rng(0))
        np.testing.assert_array_equal(out, opencv.reshape(shape))
        assert out.shape == shape and not np.shares_memory(out, image)


@pytest.mark.parametrize("shape", SHAPES + [(9, 9, 2), (12, 10, 5), (224, 224, 3)])
@pytest.mark.parametrize("operator", OPERATORS + (MedianBlur(kernels=(3, 5)), AverageBlur(kernels=(2, 4))),
                         ids=lambda op: repr(op))
def test_writing_into_out_gives_the_same_bytes_and_draws(operator, shape):
    # what a campaign does with each mutant: written into its row of the batch (mutate_into)
    image = _images(shape)["random"]
    before = image.copy()
    batch = np.full((3, *shape), 7, np.uint8)
    row = batch[1]
    returned, written = np.random.default_rng(4), np.random.default_rng(4)
    for _ in range(15):
        expected = operator(image, returned)
        assert mutate_into(operator, image, written, row) is row
        np.testing.assert_array_equal(row, expected)
    assert returned.random() == written.random()  # the same draws
    assert (batch[0] == 7).all() and (batch[2] == 7).all()  # the neighbouring rows untouched
    np.testing.assert_array_equal(image, before)


def test_a_row_the_operators_cannot_write_into_gets_a_copy_of_the_mutant():
    # not C-contiguous (a column slice), or another dtype: the operator returns its own image, copied in
    image = _images((6, 6, 3))["random"]
    wide = np.zeros((6, 12, 3), np.uint8)
    for operator in OPERATORS:
        expected = operator(image, np.random.default_rng(2))
        assert mutate_into(operator, image, np.random.default_rng(2), wide[:, ::2]) is not None
        np.testing.assert_array_equal(wide[:, ::2], expected)
        floats = np.zeros((6, 6, 3), np.float32)
        mutate_into(operator, image, np.random.default_rng(2), floats)
        np.testing.assert_array_equal(floats, expected)


def test_an_operator_without_out_is_copied_into_the_row():
    def brighten(image, rng):
        return np.minimum(image.astype(np.int16) + 1, 255).astype(np.uint8)

    image = _images((6, 6, 3))["random"]
    row = np.zeros_like(image)
    assert mutate_into(brighten, image, np.random.default_rng(0), row) is row
    np.testing.assert_array_equal(row, brighten(image, None))


def test_blurs_smooth_a_single_bright_pixel():
    image = np.zeros((15, 15, 1), np.uint8)
    image[7, 7] = 255
    rng = np.random.default_rng(0)
    assert AverageBlur(kernels=(3,))(image, rng)[7, 7, 0] == round(255 / 9)
    assert GaussianBlur(kernels=(3,))(image, rng)[7, 7, 0] < 255
    assert MedianBlur(kernels=(3,))(image, rng).max() == 0  # a lone pixel is an outlier


def test_kernel_sizes_follow_the_reference_ranges():
    image = np.zeros((15, 15, 1), np.uint8)
    image[7, 7] = 255
    rng = np.random.default_rng(0)
    # the blurred peak identifies the kernel: 255 / k^2 for the box filter
    peaks = {int(AverageBlur()(image, rng)[7, 7, 0]) for _ in range(200)}
    assert peaks == {round(255 / k ** 2) for k in (1, 2, 3, 4, 5)}


def test_default_operators_are_the_seven_of_the_reference():
    assert operator_names(OPERATORS) == ["gaussian_noise", "salt_and_pepper", "multiplicative_noise",
                                         "pixel_change", "average_blur", "gaussian_blur", "median_blur"]
    with pytest.raises(ValueError):
        operator_names([GaussianNoise(), GaussianNoise()])


@pytest.mark.parametrize("shape", [(28, 28, 1), (9, 9, 3), (6, 6, 2), (48, 48, 3)])  # 48x48x3: the uint8 path
@pytest.mark.parametrize("k", [3, 5, 7])
def test_median_blur_equals_opencv_on_uint8(shape, k):
    import cv2

    image = _images(shape)["random"]
    expected = np.stack([cv2.medianBlur(np.ascontiguousarray(image[:, :, c]), k) for c in range(shape[2])], axis=2)
    np.testing.assert_array_equal(MedianBlur(kernels=(k,))(image, np.random.default_rng(0)), expected)


@pytest.mark.parametrize("shape", [(28, 28, 1), (9, 9, 3), (224, 224, 3)])
@pytest.mark.parametrize("operator", OPERATORS, ids=lambda op: op.name)
def test_drawing_first_and_applying_together_gives_each_call_s_bytes_and_draws(operator, shape):
    # a campaign's population draws every seed's mutation, then makes those of one operator together
    from mlflow_di.fuzz.mutations import two_step

    assert two_step(operator)
    sources = [_images(shape)[kind] for kind in ("random", "black", "white", "random")]
    rows = np.zeros((len(sources), *shape), np.uint8)
    drawn_first = [np.random.default_rng(seed) for seed in range(len(sources))]
    unchanged = operator.apply_many(sources, [operator.draw(shape, rng) for rng in drawn_first], rows)
    for seed, source in enumerate(sources):
        alone = np.random.default_rng(seed)
        expected = operator(source, alone)
        np.testing.assert_array_equal(rows[seed], expected)
        assert unchanged[seed] == np.array_equal(expected, source)
        assert alone.random() == drawn_first[seed].random()  # the same draws, in the same order


def test_a_subclass_that_computes_otherwise_is_not_drawn_ahead():
    from mlflow_di.fuzz.mutations import two_step

    class Inverted(GaussianNoise):
        def __call__(self, image, rng, out=None):
            return 255 - image

    assert not two_step(Inverted()) and not two_step(lambda image, rng: image)
