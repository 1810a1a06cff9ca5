"""Preprocessing: the arithmetic, layouts, overrides and shape checks."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlflow_di.errors import UserError
from mlflow_di.models.preprocessing import Preprocessing


def test_apply_scales_normalises_and_transposes():
    images = np.array([[[[0, 255, 51]]]], np.uint8)  # one 1x1 RGB image
    prep = Preprocessing(scale=1 / 255, mean=(0.0, 0.5, 0.1), std=(1.0, 0.5, 0.1))
    x = prep.apply(images)
    assert x.shape == (1, 3, 1, 1) and x.dtype == np.float32
    np.testing.assert_allclose(x[0, :, 0, 0], [0.0, 1.0, 1.0], atol=1e-6)  # (0.2-0.1)/0.1 = 1
    assert Preprocessing(layout="NHWC").apply(images).shape == (1, 1, 1, 3)


@settings(max_examples=150, deadline=None)
@given(channels=st.integers(1, 5), height=st.integers(1, 12), width=st.integers(1, 12), count=st.integers(1, 4),
       scale=st.sampled_from([1.0, 1 / 255, 0.0173]), per_channel=st.booleans(),
       layout=st.sampled_from(["NCHW", "NHWC"]), flipped=st.booleans(), seed=st.integers(0, 2**16))
def test_the_uint8_lookup_gives_the_arithmetic_s_bits(channels, height, width, count, scale, per_channel, layout,
                                                       flipped, seed):
    rng = np.random.default_rng(seed)
    k = channels if per_channel else 1
    prep = Preprocessing(scale=scale, mean=tuple(rng.normal(0, 100, k)), std=tuple(rng.uniform(0.01, 80, k)),
                         layout=layout, input_shape=(height, width, channels))
    images = rng.integers(0, 256, (count, height, width, channels), dtype=np.uint8)
    images[0, 0, 0] = 0  # both ends of the table
    images[-1, -1, -1] = 255
    if flipped:  # a strided view, as slices of a larger set are
        images = images[:, ::-1]
    looked_up, computed = prep.apply(images), prep.arithmetic(images)
    assert looked_up.shape == computed.shape and looked_up.dtype == np.float32 and looked_up.flags.c_contiguous
    np.testing.assert_array_equal(looked_up.view(np.uint32), computed.view(np.uint32))


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("channels", [4, 5, 128, 129, 300])
def test_the_lookup_takes_any_number_of_channels(layout, channels):
    images = np.random.default_rng(channels).integers(0, 256, (2, 3, 2, channels), dtype=np.uint8)
    prep = Preprocessing(scale=1 / 255, mean=tuple(np.linspace(0, 1, channels)), std=(0.3,), layout=layout,
                         input_shape=(3, 2, channels))
    np.testing.assert_array_equal(prep.apply(images).view(np.uint32), prep.arithmetic(images).view(np.uint32))


def test_settings_that_differ_only_in_the_sign_of_zero_get_their_own_table():
    images = np.zeros((1, 2, 2, 1), np.uint8)
    for mean in (0.0, -0.0, 0.0):  # -0.0 == 0.0 for a cache key, not for the bits it gives
        prep = Preprocessing(scale=-1 / 255, mean=(mean,))
        np.testing.assert_array_equal(prep.apply(images).view(np.uint32), prep.arithmetic(images).view(np.uint32))


def test_images_of_another_dtype_take_the_arithmetic():
    images = np.array([[[[0.5, 255.0, 51.0]]]], np.float32)
    prep = Preprocessing(scale=1 / 255, mean=(0.0, 0.5, 0.1), std=(1.0, 0.5, 0.1))
    np.testing.assert_array_equal(prep.apply(images), prep.arithmetic(images))
    assert prep.apply(images)[0, 0, 0, 0] == np.float32(0.5) * np.float32(1 / 255)


def test_softmax_of_logits_and_passthrough_of_probabilities():
    logits = np.array([[0.0, np.log(3.0)]])
    np.testing.assert_allclose(Preprocessing().to_probabilities(logits), [[0.25, 0.75]], atol=1e-6)
    probs = np.array([[0.1, 0.9]])
    np.testing.assert_allclose(Preprocessing(output="probabilities").to_probabilities(probs), probs, atol=1e-7)


def test_override_and_round_trip():
    prep = Preprocessing(input_shape=(28, 28, 1)).override("scale=1,mean=125.3/123/113.9,layout=NHWC,input_shape=32/32/3")
    assert prep.scale == 1.0 and prep.mean == (125.3, 123.0, 113.9) and prep.input_shape == (32, 32, 3)
    assert Preprocessing.from_json(prep.to_json()) == prep


@pytest.mark.parametrize("text, fragment", [("scale", "key=value"), ("colour=1", "unknown preprocessing field"),
                                            ("scale=x", "must be a number"), ("layout=CHW", "layout")])
def test_bad_overrides(text, fragment):
    with pytest.raises(UserError, match=fragment):
        Preprocessing().override(text)


def test_shape_and_channel_checks_name_the_fix():
    prep = Preprocessing(input_shape=(28, 28, 1))
    with pytest.raises(UserError, match="expects 28x28x1"):
        prep.apply(np.zeros((2, 8, 8, 1), np.uint8))
    with pytest.raises(UserError, match="empty"):
        prep.apply(np.zeros((0, 28, 28, 1), np.uint8))
    with pytest.raises(UserError, match="3 values but images have 1 channels"):
        Preprocessing(mean=(0, 0, 0)).apply(np.zeros((1, 4, 4, 1), np.uint8))
