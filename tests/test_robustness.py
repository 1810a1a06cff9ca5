"""The robustness suite: the corruption catalogue (shapes, severity grading, determinism), the
suite's accuracy/agreement counts on fake classifiers, and `mlflow-di robustness` end to end on
small generated models against a local sqlite store (with the gate reading its result)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.robustness import CORRUPTIONS, SEVERITIES, RobustnessResult, corrupt, example_rows, run_suite
from mlflow_di.robustness.corruptions import describe


def smooth_images(n: int, shape: tuple[int, int, int], seed: int = 0) -> np.ndarray:
    """uint8 images with structure at several scales (blurred noise plus a little fine noise)."""
    from scipy.ndimage import gaussian_filter

    rng = np.random.default_rng(seed)
    images = [gaussian_filter(rng.normal(128, 200, shape), (2, 2, 0)) + rng.normal(0, 10, shape) for _ in range(n)]
    return np.clip(images, 0, 255).astype(np.uint8)


SHAPES = [(28, 28, 1), (32, 32, 3), (40, 24, 3)]


# ------------------------------------------------------------------------------ the catalogue
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_corruption_builds_at_every_severity_and_keeps_shape_and_dtype(shape):
    images = smooth_images(3, shape)
    for name in CORRUPTIONS:
        for severity in SEVERITIES:
            out = corrupt(images, name, severity, seed=1)
            assert out.shape == images.shape and out.dtype == np.uint8, (name, severity)
            assert not np.array_equal(out, images) or name == "occlusion", (name, severity)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_the_mean_pixel_change_grows_with_the_severity_for_every_corruption(shape):
    images = smooth_images(32, shape, seed=3)
    for name in CORRUPTIONS:
        change = [np.abs(corrupt(images, name, s, seed=5).astype(float) - images).mean() for s in SEVERITIES]
        assert all(np.diff(change) > 0), f"{name}: mean |change| per severity {np.round(change, 2)}"


def test_corruptions_depend_on_seed_corruption_severity_and_index_only():
    images = smooth_images(6, (28, 28, 1))
    whole = corrupt(images, "gaussian_noise", 3, seed=7)
    again = corrupt(images, "gaussian_noise", 3, seed=7)
    assert np.array_equal(whole, again)
    # the image at index 4, alone or in a batch, gets the same noise
    assert np.array_equal(corrupt(images[4:5], "gaussian_noise", 3, indices=[4], seed=7)[0], whole[4])
    assert not np.array_equal(corrupt(images, "gaussian_noise", 3, seed=8), whole)
    assert not np.array_equal(corrupt(images[4:5], "gaussian_noise", 3, indices=[5], seed=7)[0], whole[4])


def test_contrast_and_brightness_are_the_imagenet_c_formulas():
    images = smooth_images(2, (16, 16, 1))
    for severity, c in zip(SEVERITIES, (0.4, 0.3, 0.2, 0.1, 0.05)):
        out = corrupt(images, "contrast", severity).astype(float)
        mean = images.reshape(2, -1).mean(axis=1)[:, None, None, None]
        expected = np.clip((images - mean) * c + mean, 0, 255)
        assert np.abs(out - expected).max() <= 1.0, severity
    out = corrupt(images, "brightness", 2).astype(float)
    assert np.abs(out - np.clip(images + 0.2 * 255, 0, 255)).max() <= 1.0


def test_unknown_corruptions_and_severities_are_user_errors():
    images = smooth_images(1, (8, 8, 1))
    with pytest.raises(UserError, match="unknown corruption 'fog'"):
        corrupt(images, "fog", 1)
    for severity in (0, 6):
        with pytest.raises(UserError, match="severity"):
            corrupt(images, "jpeg", severity)
    with pytest.raises(UserError, match="uint8"):
        corrupt(images.astype(np.float32), "jpeg", 1)


def test_describe_lists_each_corruption_and_severity_with_its_arguments():
    rows = describe(["jpeg", "motion_blur"], [1, 5], (28, 28, 1))
    assert [(r["corruption"], r["severity"]) for r in rows] == [("jpeg", 1), ("jpeg", 5), ("motion_blur", 1),
                                                               ("motion_blur", 5)]
    assert "quality_range=(25, 25)" in rows[0]["arguments"] and "quality_range=(7, 7)" in rows[1]["arguments"]
    assert "blur_limit=(11, 11)" in rows[3]["arguments"]


# ------------------------------------------------------------------------------ the suite
class ThresholdClassifier:
    """Fake black box: class 1 when the mean pixel exceeds ``threshold``, else 0; counts its calls."""

    def __init__(self, threshold: float, name: str):
        self.threshold, self.name, self.calls = threshold, name, 0

    def predict(self, images, batch_size=None):
        self.calls += 1
        return (np.asarray(images).reshape(len(images), -1).mean(axis=1) > self.threshold).astype(np.int64)


def dataset(n: int = 10, shape=(12, 12, 1)) -> ImageSet:
    """Images of constant grey levels 0, 25, 50, ...; label 1 from level 100 up."""
    levels = np.arange(n) * 25
    images = np.broadcast_to(levels[:, None, None, None], (n, *shape)).astype(np.uint8)
    return ImageSet(np.ascontiguousarray(images), (levels >= 100).astype(np.int64), "levels")


def test_accuracy_and_agreement_by_hand_on_brightness():
    """Brightness adds 0.1 x 255 (severity 1) or 0.5 x 255 (severity 5) to every pixel, which a
    threshold classifier turns into a count that can be checked by hand."""
    data = dataset()  # levels 0, 25, ..., 225; labels 1 for 100..225 (6 of 10)
    original, other = ThresholdClassifier(99, "original"), ThresholdClassifier(149, "other")
    result = run_suite(original, [other], data, ["brightness"], [1, 5], progress=False)
    # clean: original right on all 10; other says 0 for 100 and 125 (2 wrong, disagrees on 2)
    assert result.clean_accuracy == 1.0 and result.clean_compressed_accuracy == [0.8]
    assert result.clean_agreement == [0.8]
    s1, s5 = result.cell("brightness", 1), result.cell("brightness", 5)
    # severity 1 (+25.5): levels >= 75 pass 99 (wrong on 75 only), levels >= 125 pass 149 (wrong on 100 only);
    # they differ on 75 and 100
    assert (s1.accuracy, s1.compressed_accuracy, s1.agreement) == (0.9, [0.9], [0.8])
    # severity 5 (+127.5): every level passes 99; all but level 0 (127.5) pass 149, right there, so they differ once
    assert (s5.accuracy, s5.compressed_accuracy, s5.agreement) == (0.6, [0.7], [0.9])
    summary = result.summary[0]
    assert summary.agreement_mean == pytest.approx(0.85) and summary.agreement_min == 0.8
    assert (summary.worst_corruption, summary.worst_severity) == ("brightness", 1)
    assert summary.accuracy_mean == pytest.approx(0.8) and result.accuracy_mean == pytest.approx(0.75)
    assert result.grid("agreement", 0).tolist() == [[0.8, 0.9]] and result.grid("accuracy").tolist() == [[0.9, 0.6]]


def test_the_same_model_as_compressed_agrees_everywhere():
    data = ImageSet(smooth_images(20, (16, 16, 1)), np.arange(20) % 2, "smooth")
    model = ThresholdClassifier(128, "m")
    result = run_suite(model, [model, ThresholdClassifier(128, "twin")], data, severities=[1, 5], progress=False)
    assert all(cell.agreement == [1.0, 1.0] for cell in result.cells) and result.clean_agreement == [1.0, 1.0]
    assert [s.agreement_min for s in result.summary] == [1.0, 1.0]
    assert len(result.cells) == len(CORRUPTIONS) * 2


def test_results_do_not_depend_on_the_batch_size_and_round_trip_through_json():
    data = ImageSet(smooth_images(23, (16, 16, 3), seed=2), np.arange(23) % 2, "smooth")
    original, compressed = ThresholdClassifier(120, "a"), ThresholdClassifier(135, "b")
    results = [run_suite(original, [compressed], data, seed=4, batch=batch, progress=False) for batch in (1, 7, 64)]
    assert results[0] == results[1] == results[2]
    assert original.calls == 23 * 41 + 4 * 41 + 41  # one call per model, cell (clean + 40) and batch
    assert RobustnessResult.from_json(results[1].to_json()) == results[1]
    other_seed = run_suite(original, [compressed], data, seed=5, batch=7, progress=False)
    assert other_seed.cells != results[0].cells  # the seed matters (noise on mid-grey images)


def test_the_suite_reads_lazy_sets_by_batches(tmp_path):
    from mlflow_di.data import LazyImages, load_images

    images = smooth_images(9, (16, 16, 1))
    np.savez(tmp_path / "set.npz", x=images, y=np.arange(9) % 2)
    lazy = load_images(f"npz:{tmp_path / 'set.npz'}")
    assert isinstance(lazy.images, LazyImages)
    eager = ImageSet(images, np.arange(9) % 2, lazy.name)
    model, other = ThresholdClassifier(110, "a"), ThresholdClassifier(140, "b")
    assert run_suite(model, [other], lazy, ["jpeg", "elastic"], batch=4, progress=False) == \
        run_suite(model, [other], eager, ["jpeg", "elastic"], batch=4, progress=False)


def test_no_compressed_model_measures_the_original_alone_and_bad_requests_are_user_errors():
    data = dataset()
    result = run_suite(ThresholdClassifier(99, "o"), [], data, ["jpeg"], [2], progress=False)
    assert result.summary == [] and result.cells[0].agreement == [] and result.clean_accuracy == 1.0
    with pytest.raises(UserError, match="holds no images"):
        run_suite(ThresholdClassifier(99, "o"), [], data.subset(slice(0, 0)), progress=False)
    with pytest.raises(UserError, match="unknown corruption"):
        run_suite(ThresholdClassifier(99, "o"), [], data, ["snow"], progress=False)
    with pytest.raises(UserError, match="severity"):
        run_suite(ThresholdClassifier(99, "o"), [], data, ["jpeg"], [6], progress=False)


def test_example_rows_show_the_suites_corruption_of_that_image():
    images = smooth_images(3, (16, 16, 1))
    rows = example_rows(images[2], ["gaussian_noise", "occlusion"], [1, 4], seed=9, index=2)
    assert [row.shape for row in rows] == [(3, 16, 16, 1)] * 2
    assert np.array_equal(rows[0][0], images[2])
    assert np.array_equal(rows[0][2], corrupt(images, "gaussian_noise", 4, seed=9)[2])


# ------------------------------------------------------------------------------ the command
@pytest.fixture()
def cnn_pair(registered_cnn, capsys):
    """models:/cnn/1 (briefly trained digits-cnn) and its int8-dynamic export models:/cnn-int8-dynamic/1."""
    from mlflow_di.cli import main

    assert main(["compress", "--model-uri", registered_cnn, "--method", "int8-dynamic"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return registered_cnn, "models:/cnn-int8-dynamic/1"


def test_command_logs_metrics_table_heatmaps_report_and_the_gate_reads_it(cnn_pair, tmp_path, capsys):
    import mlflow

    from mlflow_di.cli import main

    original, compressed = cnn_pair
    out = tmp_path / "robustness.json"
    code = main(["robustness", "--model-uri", original, "--compressed", compressed, "--compressed", original,
                 "--data", "digits[1300:1400]", "--corruptions", "gaussian_noise,occlusion", "--severities", "1,5",
                 "--batch", "32", "--json-out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(out.read_text())
    assert summary["images"] == 100 and summary["corruptions"] == ["gaussian_noise", "occlusion"]
    by_uri = {c["uri"]: c for c in summary["compressed"]}
    assert by_uri[original]["agreement_min"] == 1.0  # the original against itself
    assert 0 <= by_uri[compressed]["agreement_min"] <= by_uri[compressed]["agreement_mean"] <= 1
    assert f"{compressed}: agreement clean" in captured.out

    client = mlflow.MlflowClient()
    run = mlflow.search_runs(filter_string="tags.`mlflow_di.command` = 'robustness'", search_all_experiments=True,
                             output_format="list")[0]
    assert run.info.status == "FINISHED" and run.data.tags["mlflow_di.model_version"] == "1"
    slugs = json.loads(run.data.tags["mlflow_di.robustness_compressed"])
    assert slugs == {compressed: "cnn-int8-dynamic_1", original: "cnn_1"}
    metrics = run.data.metrics
    assert metrics["robustness_agreement_min.cnn_1"] == 1.0
    result = RobustnessResult.from_json(pathlib.Path(client.download_artifacts(
        run.info.run_id, "robustness/result.json", str(tmp_path))).read_text())
    assert metrics["agreement.cnn-int8-dynamic_1.gaussian_noise.5"] == result.cell("gaussian_noise", 5).agreement[0]
    assert metrics["robustness_agreement_min"] == min(metrics[f"agreement.{slug}.{c}.{s}"] for slug in slugs.values()
                                                      for c in ("gaussian_noise", "occlusion") for s in (1, 5))
    assert {"accuracy.original.occlusion.1", "robustness_clean_accuracy", "robustness_agreement_mean"} <= set(metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "robustness")}
    assert artifacts == {f"robustness/{name}" for name in (
        "result.json", "cells.json", "agreement_cnn-int8-dynamic_1.png", "agreement_cnn_1.png",
        "accuracy_original.png", "examples.png", "report.html")}
    report = client.download_artifacts(run.info.run_id, "robustness/report.html", str(tmp_path))
    assert "Heatmaps" in open(report).read() and "ImageCompression" not in open(report).read()  # jpeg not run

    # the gate reads the export's worst cell with its interval (Clopper-Pearson per cell at 1 - 0.05/4, 100 images):
    # a threshold at its low end passes, one above its high end fails, one at the value itself is inconclusive
    key = "robustness_agreement_min.cnn-int8-dynamic_1"
    worst, low, high = metrics[key], metrics[f"{key}_low"], metrics[f"{key}_high"]
    assert low <= worst <= high and metrics[f"{key}_n"] == 100
    from mlflow_di.intervals import clopper_pearson

    assert low == pytest.approx(min(clopper_pearson(round(metrics[f"agreement.cnn-int8-dynamic_1.{c}.{s}"] * 100), 100,
                                                    1 - 0.05 / 4).low for c in ("gaussian_noise", "occlusion")
                                    for s in (1, 5)))
    gate = ["gate", "--model-uri", original, "--compressed", compressed, "--min-robustness-agreement"]
    assert main([*gate, str(low)]) == 0
    if high < 1:
        assert main([*gate, str(min(1.0, high + 0.001))]) == 1
    if low < worst:
        assert main([*gate, str(worst)]) == 3


@pytest.mark.parametrize("args, fragment", [
    (["--corruptions", "snow"], "unknown corruption 'snow'"),
    (["--severities", "0"], "from 1 to 5"),
    (["--compressed", "{pt}", "--compressed", "{pt}"], "named twice"),
])
def test_bad_robustness_requests_fail_in_one_line_before_any_run(args, fragment, tracking_uri, tmp_path, capsys):
    import torch

    from mlflow_di.cli import main
    from mlflow_di.models import zoo

    pt = tmp_path / "cnn.pt"
    torch.save({"module": zoo.build("digits-cnn", seed=0),
                "mlflow_di": {"preprocessing": zoo.architecture("digits-cnn").preprocessing.to_dict()}}, pt)
    argv = ["robustness", "--model-uri", str(pt), "--data", "digits[0:10]", *[a.format(pt=pt) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
