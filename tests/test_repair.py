"""Drepair: the engine on small generated data, the ONNX graph against ONNX Runtime, and
`mlflow-di repair` end to end (compress -> fuzz -> repair -> fuzz the repaired version -> gate)."""
import json
import shutil

import numpy as np
import pytest

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz import load_campaign, run_campaign
from mlflow_di.models.head import ProbabilityHead, RepairedClassifier
from mlflow_di.repair import (HeadSettings, RepairCounts, RepairSet, collect_images, cross_validate, label_images,
                              repair, seed_folds, train_head)
from mlflow_di.repair.dataset import KINDS
from mlflow_di.repair.evaluate import choose_folds

SWAP = np.array([1, 0, 2, 3])  # the "compressed model" swaps classes 0 and 1


def peaked_probabilities(rng, count: int, classes: int = 4) -> np.ndarray:
    logits = rng.normal(0, 1, (count, classes))
    logits[np.arange(count), rng.integers(0, classes, count)] += 3
    p = np.exp(logits)
    return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


def swap_set(rng, seeds: int = 40, per_seed: int = 5) -> RepairSet:
    """Per seed ``per_seed`` examples; the original's label is SWAP of the compressed model's."""
    p = peaked_probabilities(rng, seeds * per_seed)
    compressed = p.argmax(axis=1)
    groups = np.repeat(np.arange(seeds), per_seed)
    kinds = np.tile([0, 1] + [2] * (per_seed - 2), seeds)
    return RepairSet(p, SWAP[compressed], compressed, groups, kinds)


def test_repair_counts_by_hand():
    original = np.array([0, 1, 2, 3, 0, 1])
    compressed = np.array([1, 1, 2, 0, 0, 2])  # deviating at 0, 3, 5; agreeing at 1, 2, 4
    repaired = np.array([0, 1, 1, 0, 0, 1])  # fixes 0 and 5, leaves 3, breaks 2
    counts = RepairCounts.of(original, compressed, repaired)
    assert (counts.deviating, counts.repaired, counts.agreeing, counts.induced) == (3, 2, 3, 1)
    assert counts.repair_ratio == pytest.approx(2 / 3) and counts.inducing_ratio == pytest.approx(1 / 3)
    assert counts.deviations_after == 2 and counts.improvement == pytest.approx(1 / 3)
    assert RepairCounts.from_json(counts.to_json()) == counts
    assert RepairCounts.of(original[[1, 2]], compressed[[1, 2]], original[[1, 2]]).improvement is None


def test_folds_split_by_seed_cover_everything_and_are_seeded():
    groups = np.repeat(np.arange(23), 3)
    folds = seed_folds(groups, 5, seed=1)
    assert np.array_equal(sum(f.astype(int) for f in folds), np.ones(len(groups), int))  # each example once
    for fold in folds:
        assert not set(groups[fold]) & set(groups[~fold])  # no seed on both sides
        assert 4 <= len(set(groups[fold])) <= 5
    assert all(np.array_equal(a, b) for a, b in zip(folds, seed_folds(groups, 5, seed=1)))
    assert not all(np.array_equal(a, b) for a, b in zip(folds, seed_folds(groups, 5, seed=2)))
    with pytest.raises(UserError, match="at least 5 triggering seeds"):
        seed_folds(np.arange(3), 5)


@pytest.mark.parametrize("seeds, stated, expected", [(40, None, 5), (5, None, 5), (4, None, 4), (2, None, 2),
                                                     (40, 3, 3), (4, 2, 2)])
def test_the_default_folds_leave_one_seed_out_when_there_are_fewer_than_five(seeds, stated, expected):
    assert choose_folds(seeds, stated) == expected


@pytest.mark.parametrize("seeds, stated", [(1, None), (0, None), (4, 5)])
def test_too_few_seeds_for_the_folds_is_one_line(seeds, stated):
    with pytest.raises(UserError, match=f"at least {stated or 2} triggering seeds, the campaigns have {seeds}"):
        choose_folds(seeds, stated)


def test_untrained_head_is_the_identity():
    p = peaked_probabilities(np.random.default_rng(0), 50)
    head = ProbabilityHead.identity(4, 8, np.random.default_rng(1))
    np.testing.assert_allclose(head(p), p / p.sum(axis=1, keepdims=True), atol=1e-5)


def test_head_learns_a_label_permutation_on_held_out_seeds(rng):
    result = cross_validate(swap_set(rng), HeadSettings(), folds=5, seed=0)
    assert result.pooled.inputs == 200 and len(result.folds) == 5
    assert result.pooled.repair_ratio > 0.9 and result.pooled.inducing_ratio < 0.1
    assert result.pooled.improvement > 0.8
    assert result.paper_kinds.inputs == 80  # one seed and one trigger per seed


def test_training_is_seeded(rng):
    data = swap_set(rng, seeds=10)
    settings = HeadSettings(epochs=50, seed=3)
    a, b = (train_head(data.probabilities, data.original_labels, settings) for _ in range(2))
    for name in ("w1", "b1", "w2", "b2"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c = train_head(data.probabilities, data.original_labels, HeadSettings(epochs=50, seed=4))
    assert not np.array_equal(a.w1, c.w1)


def test_head_saves_and_loads(tmp_path, rng):
    head = ProbabilityHead.identity(4, 6, rng)
    head.w2[:] = rng.normal(size=head.w2.shape)
    head.save(tmp_path / "head.npz")
    loaded = ProbabilityHead.load(tmp_path / "head.npz")
    p = peaked_probabilities(rng, 10)
    np.testing.assert_array_equal(loaded(p), head(p))


# ----------------------------------------------------------------- from campaigns, on generated models
class Threshold:
    """Black box over 8x8 images: class = how many of 3 thresholds the mean brightness exceeds."""

    def __init__(self, thresholds, name="m"):
        self.thresholds, self.name = np.asarray(thresholds), name

    def predict_proba(self, images, batch_size=None):
        b = np.asarray(images[:]).reshape(len(images), -1).mean(axis=1) / 255.0
        score = -40.0 * np.abs(b[:, None] - (np.r_[0, self.thresholds] + np.r_[self.thresholds, 1]) / 2)
        p = np.exp(score - score.max(axis=1, keepdims=True))
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, images, batch_size=None):
        return self.predict_proba(images).argmax(axis=1)


@pytest.fixture(scope="module")
def campaign():
    rng = np.random.default_rng(3)
    seeds = ImageSet(rng.integers(20, 90, (20, 8, 8, 1), dtype=np.uint8), np.zeros(20, int), "dark")
    original, compressed = Threshold([0.3, 0.6, 0.8], "original"), Threshold([0.33, 0.6, 0.8], "compressed")
    result = run_campaign(original, compressed, seeds, max_queries=2000, timeout=30, progress=False)
    assert result.summary.triggers >= 10
    return result, original, compressed


def test_collect_images_from_a_campaign(campaign):
    result, original, compressed = campaign
    images = collect_images([result, result], mutants_per_seed=3, seed=0)
    triggers = len(result.triggers)
    distinct = len({seed.tobytes() for seed in result.trigger_seeds})
    assert len(images) == 2 * triggers * 5 and len(images.group_names) == distinct  # one group per seed image
    assert np.array_equal(np.bincount(images.kinds), [2 * triggers, 2 * triggers, 6 * triggers])
    np.testing.assert_array_equal(images.images[1], result.triggers[0])
    np.testing.assert_array_equal(images.images[0], result.trigger_seeds[0])
    again = collect_images([result, result], mutants_per_seed=3, seed=0)
    np.testing.assert_array_equal(images.images, again.images)
    data = label_images(images, original, compressed)
    assert data.deviating[images.kinds == KINDS.index("trigger")].all()  # every trigger deviates
    assert not data.deviating[images.kinds == KINDS.index("seed")].any()  # no seed does
    with pytest.raises(UserError, match="no triggering input"):
        collect_images([])


def test_one_seed_image_is_one_group_whatever_campaign_it_comes_from(campaign):
    """The same campaign twice (or the same seeds fuzzed again) must not put a seed image in two
    groups: cross-validation would train and test on it."""
    result = campaign[0]
    once = collect_images([result], mutants_per_seed=2, seed=0)
    twice = collect_images([result, result], mutants_per_seed=2, seed=0)
    assert len(twice.group_names) == len(once.group_names) == len(np.unique(once.groups))
    assert np.array_equal(twice.groups, np.concatenate([once.groups, once.groups]))
    for test in seed_folds(twice.groups, 5, seed=0):
        held = {image.tobytes() for image in twice.images[test & (twice.kinds == KINDS.index("seed"))]}
        trained = {image.tobytes() for image in twice.images[~test & (twice.kinds == KINDS.index("seed"))]}
        assert not held & trained


def test_repair_of_a_threshold_shift_fixes_held_out_triggers(campaign):
    result, original, compressed = campaign
    test = ImageSet(np.random.default_rng(5).integers(0, 256, (200, 8, 8, 1), dtype=np.uint8),
                    np.zeros(200, int), "noise")
    test.labels = original.predict(test.images)
    report, head, data = repair([result], original, compressed, folds=5, mutants_per_seed=6, seed=0, test_data=test)
    assert report.training_set["seeds"] == len(result.triggers)
    assert report.cross_validation.pooled.repair_ratio > 0.5
    assert report.clean.original_accuracy == 1.0
    assert report.clean.repaired_accuracy >= report.clean.compressed_accuracy - 0.02
    assert json.loads(report.to_json())["cross_validation"]["pooled"]["repair_ratio"] > 0.5
    assert head.predict(compressed.predict_proba(result.triggers)).shape == (len(result.triggers),)


# ----------------------------------------------------------------- the ONNX graph
def _linear_onnx(path, classes=4, logits=True, seed=0):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from mlflow_di.models.metadata import ModelMetadata
    from mlflow_di.models.preprocessing import Preprocessing

    w = np.random.default_rng(seed).normal(0, 1, (16, classes)).astype(np.float32)
    nodes = [helper.make_node("Flatten", ["input"], ["flat"]), helper.make_node("MatMul", ["flat", "w"], ["z"])]
    if not logits:
        nodes.append(helper.make_node("Softmax", ["z"], ["out"], axis=-1))
    out = "z" if logits else "out"
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                              ["batch", 1, 4, 4])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", classes])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    preprocessing = Preprocessing(layout="NCHW", input_shape=(4, 4, 1), output="logits" if logits else "probabilities")
    for key, value in ModelMetadata(preprocessing).to_onnx_props().items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return preprocessing


@pytest.mark.parametrize("logits", [True, False])
def test_onnx_graph_with_the_head_equals_the_engine(tmp_path, rng, logits):
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.repair.onnx_graph import append_head

    preprocessing = _linear_onnx(tmp_path / "export.onnx", logits=logits)
    head = ProbabilityHead.identity(4, 8, rng)
    head.w2[:] = rng.normal(0, 1, head.w2.shape)
    head.b2[:] = rng.normal(0, 1, 4)
    path = append_head(tmp_path / "export.onnx", head, preprocessing, tmp_path / "repaired.onnx", {"repairs": "x"})
    repaired = OnnxClassifier(path)
    export = OnnxClassifier(tmp_path / "export.onnx")
    assert repaired.preprocessing.output == "probabilities"
    assert repaired.preprocessing.input_shape == (4, 4, 1)
    images = rng.integers(0, 256, (37, 4, 4, 1), dtype=np.uint8)
    got = repaired.predict_proba(images)
    expected = RepairedClassifier(export, head).predict_proba(images)
    assert got.shape == (37, 4)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_array_equal(got.argmax(axis=1), expected.argmax(axis=1))


# ----------------------------------------------------------------- the command, end to end
def test_repair_command_registers_an_onnx_model_that_fuzz_and_gate_accept(registered_cnn, tmp_path, capsys):
    import mlflow

    from mlflow_di.cli import main
    from mlflow_di.models.loading import load_classifier

    assert main(["compress", "--model-uri", registered_cnn, "--method", "prune-l1", "--amount", "0.6"]) == 0
    campaign = tmp_path / "campaign"
    assert main(["fuzz", "--original", registered_cnn, "--compressed", "models:/cnn-prune-l1/1",
                 "--seed-data", "digits[1300:1340]", "--max-queries", "300", "--out-dir", str(campaign)]) == 0
    assert main(["fuzz", "--original", registered_cnn, "--compressed", "models:/cnn-prune-l1/1",
                 "--seed-data", "digits[1340:1360]", "--max-queries", "300"]) == 0
    fuzz_runs = [run.info.run_id for run in mlflow.search_runs(search_all_experiments=True, output_format="list",
                                                                filter_string="tags.`mlflow_di.command` = 'fuzz'",
                                                                order_by=["attributes.start_time DESC"])]
    capsys.readouterr()
    out = tmp_path / "repair.json"
    code = main(["repair", "--compressed", "models:/cnn-prune-l1/1", "--campaign", "all",
                 "--eval-data", "digits[1400:]", "--folds", "3", "--mutants", "4", "--epochs", "200",
                 "--json-out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "repaired model -> models:/cnn-prune-l1-repaired/1 (ONNX graph)" in captured.out
    assert f"--campaign all: fuzz runs {', '.join(fuzz_runs)}" in captured.out  # both campaigns, named
    report = json.loads(out.read_text())
    assert report["registered"] == "models:/cnn-prune-l1-repaired/1"
    assert 0 <= report["cross_validation"]["pooled"]["repair_ratio"] <= 1
    client = mlflow.MlflowClient()
    version = client.get_model_version("cnn-prune-l1-repaired", "1")
    assert version.tags["mlflow_di.repairs"] == "models:/cnn-prune-l1/1"
    assert json.loads(version.tags["mlflow_di.repair_campaigns"]) == fuzz_runs
    assert report["training_set"]["seeds"] > 0 and len(fuzz_runs) == 2
    assert version.tags["mlflow_di.source_name"] == "cnn" and version.tags["mlflow_di.method"] == "prune-l1+drepair"
    run = client.get_run(version.run_id)
    assert run.data.tags["mlflow_di.command"] == "repair" and run.info.status == "FINISHED"
    assert run.data.metrics["onnx_max_abs_diff"] < 1e-4
    assert {"cv_repair_ratio", "cv_inducing_ratio", "repaired_accuracy", "accuracy_drop"} <= set(run.data.metrics)
    repaired = load_classifier("models:/cnn-prune-l1-repaired/1")
    assert repaired.backend == "onnxruntime" and repaired.preprocessing.output == "probabilities"
    assert main(["fuzz", "--original", registered_cnn, "--compressed", "models:/cnn-prune-l1-repaired/1",
                 "--seed-data", "digits[1340:1350]", "--max-queries", "100", "--out-dir", str(tmp_path / "again")]) == 0
    verdict = tmp_path / "gate.json"
    code = main(["gate", "--model-uri", "models:/cnn-prune-l1-repaired/1", "--max-accuracy-drop", "1",
                 "--max-success-rate", "1", "--json-out", str(verdict)])
    assert code == 0, capsys.readouterr().err
    measured = {m["metric"]: m["value"] for m in json.loads(verdict.read_text())["measurements"]}
    assert measured["accuracy_drop"] == pytest.approx(run.data.metrics["accuracy_drop"])


@pytest.fixture(scope="module")
def file_pair(tmp_path_factory):
    """ONNX files on 4x4 images: m.onnx (compressed), o.onnx (original), twin.onnx (= m.onnx),
    other.onnx; campaigns pair/ (o vs m), none/ (twin vs m: no trigger), other/ (o vs other);
    seeds.npz (the seed images, labelled)."""
    from mlflow_di.models.loading import load_classifier

    root = tmp_path_factory.mktemp("file-pair")
    for name, seed in (("m", 0), ("twin", 0), ("o", 1), ("other", 2)):
        _linear_onnx(root / f"{name}.onnx", seed=seed)
    images = np.random.default_rng(7).integers(0, 256, (60, 4, 4, 1), dtype=np.uint8)
    np.savez(root / "seeds.npz", x=images, y=np.zeros(60, np.int64))
    np.savez(root / "held.npz", x=255 - images[:1] // 2, y=np.zeros(1, np.int64))
    seeds = ImageSet(images, np.zeros(60, int), "seeds")
    model = {name: load_classifier(str(root / f"{name}.onnx")) for name in ("m", "twin", "o", "other")}
    for folder, original, compressed, queries in (("pair", "o", "m", 300), ("none", "twin", "m", 5),
                                                  ("other", "o", "other", 300)):
        run_campaign(model[original], model[compressed], seeds, max_queries=queries, timeout=30, progress=False,
                     out_dir=root / folder)
    return root


@pytest.mark.parametrize("args, fragment", [
    (["--campaign", "no-such-folder"], "neither a campaign folder nor a fuzz run"),
    (["--campaign", "0123456789abcdef0123456789abcdef"], "cannot fetch the campaign"),
    (["--campaign", "{root}/none", "--original", "{root}/twin.onnx"], "no triggering input"),
    (["--campaign", "{root}/other", "--original", "{root}/o.onnx"], "fuzzed the compressed model 'other.onnx', not"),
    (["--campaign", "{root}/pair", "--original", "{root}/o.onnx", "--folds", "500"],
     "needs at least 500 triggering seeds"),
    (["--campaign", "{root}/pair", "--original", "{root}/o.onnx", "--eval-data", "npz:{root}/seeds.npz"],
     "--eval-data shares"),
    (["--campaign", "{root}/pair"], "pass --original"),
    (["--campaign", "{root}/pair", "--original", "{root}/twin.onnx"], "nothing to repair"),
])
def test_bad_repair_requests_fail_in_one_line_without_a_run(tracking_uri, file_pair, capsys, monkeypatch, tmp_path,
                                                             args, fragment):
    import mlflow

    from mlflow_di.cli import main

    monkeypatch.chdir(tmp_path)  # a decoy of the name a file campaign records its original by must not be loaded
    (tmp_path / "o.onnx").write_bytes(b"not the original")
    args = [arg.format(root=file_pair) for arg in args]
    assert main(["repair", "--compressed", str(file_pair / "m.onnx"), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert not mlflow.search_runs(output_format="list", search_all_experiments=True)


def test_a_campaign_given_twice_is_used_once(tracking_uri, file_pair, capsys, tmp_path):
    from mlflow_di.cli import main

    out = tmp_path / "repair.json"
    pair = str(file_pair / "pair")
    code = main(["repair", "--compressed", str(file_pair / "m.onnx"), "--campaign", pair, "--campaign", pair + "/",
                 "--original", str(file_pair / "o.onnx"), "--eval-data", f"npz:{file_pair / 'held.npz'}",
                 "--folds", "2", "--mutants", "1", "--epochs", "20", "--json-out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "using it once" in captured.err
    triggers = len(load_campaign(file_pair / "pair").triggers)
    assert json.loads(out.read_text())["training_set"]["examples"] == 3 * triggers  # seed, trigger, 1 mutant, once


def test_an_onnx_graph_unlike_the_engine_is_not_registered(tracking_uri, file_pair, capsys, monkeypatch):
    import mlflow

    from mlflow_di.cli import main
    from mlflow_di.repair import onnx_graph

    def headless(export, head, preprocessing, path, props):  # the export alone: not what the engine computes
        shutil.copy(export, path)
        return path

    monkeypatch.setattr(onnx_graph, "append_head", headless)
    code = main(["repair", "--compressed", str(file_pair / "m.onnx"), "--campaign", str(file_pair / "pair"),
                 "--original", str(file_pair / "o.onnx"), "--folds", "2", "--mutants", "1", "--epochs", "50"])
    err = capsys.readouterr().err
    assert code == 2 and "differs from the compressed model + head by up to" in err
    assert len(err.strip().splitlines()) == 1
    assert not mlflow.MlflowClient().search_registered_models()


@pytest.mark.parametrize("base", ["/etc/model.onnx", "../model.onnx", "a/../../model.onnx", ""])
def test_a_repaired_model_names_its_base_file_inside_its_folder(tmp_path, base):
    from mlflow_di.models.loading import load_repaired
    from mlflow_di.models.metadata import ModelMetadata

    with pytest.raises(UserError, match="not a path inside the model folder"):
        load_repaired(tmp_path, ModelMetadata(None, {"repaired_base": base}).to_mlflow())


def test_a_repaired_tflite_model_registers_as_a_pyfunc_that_loads_back(tracking_uri, shared_dir, rng):
    from mlflow_di.mlflow_edge import models as edge_models, runs as tracking
    from mlflow_di.models.classifier import TFLiteClassifier
    from mlflow_di.models.loading import load_classifier

    lite = shared_dir / "models" / "dflare" / "lenet1-quan.lite"
    base = TFLiteClassifier(lite)
    head = ProbabilityHead.identity(10, 8, rng)
    head.w2[:] = rng.normal(0, 1, head.w2.shape)
    with tracking.tracked_run("repair"):
        lineage = {"mlflow_di.repairs": str(lite)}
        info = edge_models.log_repaired_pyfunc(lite, head, base.preprocessing, lineage)
        version = edge_models.register_logged_model(info, "lenet1-repaired", lineage)
    assert version.tags["mlflow_di.repairs"] == str(lite)
    loaded = load_classifier(f"models:/lenet1-repaired/{version.version}")
    images = rng.integers(0, 256, (9, 28, 28, 1), dtype=np.uint8)
    np.testing.assert_allclose(loaded.predict_proba(images), RepairedClassifier(base, head).predict_proba(images),
                               atol=1e-6)
    assert loaded.preprocessing.input_shape == (28, 28, 1)
