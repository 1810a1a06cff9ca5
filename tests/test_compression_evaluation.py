"""compression.evaluation on hand-computed cases: an export's figures next to its source, and whether
host and reference semantics differ beyond noise."""
import numpy as np
import pytest

from mlflow_di.compression.evaluation import compare_outputs, gzip_size
from mlflow_di.data import ImageSet


class Answers:
    """A stand-in compressed model answering fixed probabilities."""

    def __init__(self, probabilities):
        self.probabilities = np.asarray(probabilities, dtype=np.float64)

    def predict_proba(self, images):
        return self.probabilities[:len(images)]


def one_hot(labels, classes=2):
    return np.eye(classes)[labels] * 0.8 + 0.1


def test_compare_outputs_on_four_images_by_hand():
    evaluation = ImageSet(np.zeros((4, 2, 2, 1), np.uint8), np.array([0, 1, 1, 0]), "four")
    source = one_hot([0, 1, 0, 0])  # right on 3 of 4
    figures, deviation = compare_outputs(source, Answers(one_hot([0, 0, 0, 0])), evaluation)  # right on 2 of 4
    assert figures["source_accuracy"] == 0.75 and figures["compressed_accuracy"] == 0.5
    assert figures["accuracy_drop"] == 0.25 and figures["disagreements"] == 1 and figures["eval_images"] == 4
    assert figures["disagreement_rate"] == 0.25
    # class 1: the source gets 1 of 2 right, the export 0 of 2: the largest drop, 0.5
    assert figures["max_class_accuracy_drop"] == 0.5 and figures["class_accuracy_drop.1"] == 0.5
    assert figures["class_accuracy_drop.0"] == 0.0
    assert deviation["matrix"].tolist() == [[3, 0], [1, 0]]  # source label rows, export label columns
    assert deviation["labels"].tolist() == [0, 0, 0, 0]


def test_compare_outputs_without_evaluation_data_is_empty():
    assert compare_outputs(None, Answers([[1.0, 0.0]]), None) == ({}, None)


def test_gzip_size_sees_the_zeros_a_pruned_file_stores(tmp_path):
    dense, zeros = tmp_path / "dense.bin", tmp_path / "zeros.bin"
    dense.write_bytes(np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    zeros.write_bytes(bytes(100_000))
    assert gzip_size(dense) > 99_000 and gzip_size(zeros) < 1_000


@pytest.mark.parametrize("host_only, reference_only, differs", [(12, 0, True), (3, 2, False), (0, 0, False)])
def test_semantics_differ_only_beyond_noise(monkeypatch, host_only, reference_only, differs):
    """The line appears when the images only one semantics gets wrong lean one way beyond chance (binomial, p<0.05)."""
    from mlflow_di.compression import evaluation as module

    n = 40
    labels = np.zeros(n, np.int64)
    source = one_hot(labels)
    host = labels.copy()
    host[:host_only] = 1
    reference = labels.copy()
    reference[n - reference_only:] = 1

    class Reference(Answers):
        def __init__(self, *args, **kwargs):
            super().__init__(one_hot(reference))

    monkeypatch.setattr("mlflow_di.models.classifier.OnnxClassifier", Reference)
    images = ImageSet(np.zeros((n, 2, 2, 1), np.uint8), labels, "forty")
    metrics, line = module.semantics_comparison(source, "export.onnx", images, {"labels": host}, "cpu", None)
    assert metrics["host_only_disagreements"] == host_only and metrics["reference_only_disagreements"] == reference_only
    assert metrics["reference.disagreements"] == reference_only
    assert bool(line) is differs
    if differs:
        assert f"{host_only} vs {reference_only} disagreements" in line and "p=" in line
