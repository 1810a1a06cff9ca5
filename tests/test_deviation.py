"""Per-class deviation: hand-computed matrices and accuracies, and the bincount path against sklearn."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays
from sklearn.metrics import confusion_matrix

from mlflow_di.deviation import deviation_matrix, largest_class_drop, matrix_rows, per_class_accuracy
from mlflow_di.errors import UserError


def test_hand_computed_matrix():
    matrix = deviation_matrix([0, 0, 1, 2, 2, 2], [0, 1, 1, 2, 0, 2])
    assert matrix.tolist() == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]
    assert matrix_rows(matrix)[2] == {"original": 2, "-> 0": 1, "-> 1": 0, "-> 2": 2}


def test_matrix_equals_sklearn_confusion_matrix_on_random_labels():
    rng = np.random.default_rng(3)
    original, compressed = rng.integers(0, 7, 500), rng.integers(0, 7, 500)
    expected = confusion_matrix(original, compressed, labels=range(10))
    np.testing.assert_array_equal(deviation_matrix(original, compressed, num_classes=10), expected)


def test_hand_computed_per_class_accuracy_and_largest_drop():
    truth = [0, 0, 0, 1, 1, 2]
    original = [0, 0, 1, 1, 1, 2]
    compressed = [0, 1, 1, 1, 0, 2]
    classes = per_class_accuracy(truth, original, compressed, num_classes=4)
    assert [c.images for c in classes] == [3, 2, 1, 0]
    assert classes[0].original_accuracy == pytest.approx(2 / 3) and classes[0].compressed_accuracy == pytest.approx(1 / 3)
    assert classes[1].accuracy_drop == pytest.approx(0.5)
    assert classes[2].accuracy_drop == 0.0
    assert math.isnan(classes[3].original_accuracy)
    worst = largest_class_drop(classes)
    assert worst.label == 1 and worst.to_row()["accuracy_drop"] == pytest.approx(0.5)


def test_mean_of_class_accuracies_weighted_by_size_is_the_overall_accuracy():
    rng = np.random.default_rng(0)
    truth, original, compressed = rng.integers(0, 10, (3, 300))
    classes = per_class_accuracy(truth, original, compressed)
    weighted = sum(c.images * c.original_accuracy for c in classes if c.images) / 300
    assert weighted == pytest.approx(np.mean(original == truth))


@pytest.mark.parametrize("call, message", [
    (lambda: deviation_matrix([0, 1], [0]), "2 original labels but 1"),
    (lambda: deviation_matrix([0.5], [0]), "integer class labels"),
    (lambda: deviation_matrix([0, 12], [0, 1], num_classes=10), "label 12 is outside the 10 classes"),
    (lambda: per_class_accuracy([0], [0, 1], [0, 1]), "differ in length"),
    (lambda: deviation_matrix([-1], [0]), "negative class label"),
])
def test_bad_labels_are_one_line_user_errors(call, message):
    with pytest.raises(UserError, match=message):
        call()


# ------------------------------------------------------------------------------ output_deviation
def _softmax(logits):
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 20), st.integers(2, 6)), elements=st.floats(-8, 8)),
       arrays(np.float64, st.tuples(st.integers(1, 20), st.integers(2, 6)), elements=st.floats(-8, 8)))
def test_output_deviation_matches_scipy_and_its_definitions(logits_p, logits_q):
    from scipy.stats import entropy

    from mlflow_di.deviation import output_deviation

    rows = min(len(logits_p), len(logits_q))
    classes = min(logits_p.shape[1], logits_q.shape[1])
    p, q = _softmax(logits_p[:rows, :classes]), _softmax(logits_q[:rows, :classes])
    labels = np.arange(rows) % classes
    got = output_deviation(p, q, labels)
    kl = entropy(np.clip(p, 1e-12, 1), np.clip(q, 1e-12, 1), axis=1)  # scipy normalises; the clip barely moves it
    assert got["kl_divergence"] == pytest.approx(float(np.mean(kl)), rel=1e-6, abs=1e-9)
    assert got["kl_divergence_max"] == pytest.approx(float(np.max(kl)), rel=1e-6, abs=1e-9)
    assert got["disagreement_rate"] == np.mean(p.argmax(1) != q.argmax(1))
    drop = np.mean(p.argmax(1) == labels) - np.mean(q.argmax(1) == labels)
    assert got["flips_right_to_wrong"] - got["flips_wrong_to_right"] == pytest.approx(drop)
    assert 0 <= got["margin_original"] <= 1 and 0 <= got["margin_compressed"] <= 1


def test_output_deviation_by_hand():
    from mlflow_di.deviation import output_deviation

    p = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]])
    q = np.array([[0.2, 0.7, 0.1], [0.1, 0.8, 0.1]])  # the first input flips 0 -> 1
    got = output_deviation(p, q, labels=[0, 1])
    assert got["disagreement_rate"] == 0.5 and got["flips_right_to_wrong"] == 0.5 and got["flips_wrong_to_right"] == 0
    assert got["kl_divergence"] == pytest.approx((0.7 * np.log(0.7 / 0.2) + 0.2 * np.log(0.2 / 0.7)) / 2)
    assert got["margin_original"] == pytest.approx((0.5 + 0.7) / 2)
    assert got["margin_compressed"] == pytest.approx((0.5 + 0.7) / 2)
    assert output_deviation(p, p)["kl_divergence"] == 0 and "flips_right_to_wrong" not in output_deviation(p, p)
