"""DeepXplore on tiny digits CNNs: the objective climbs, every generated input keeps its domain
constraint, records do not depend on the batch, more than two models, resume, and the CLI end to end
(with the NC it reached, and a one-line refusal of a model that is not PyTorch)."""
import json

import numpy as np
import pytest
import torch

from mlflow_di.cli import main
from mlflow_di.data import load_images
from mlflow_di.errors import UserError
from mlflow_di.fuzz import deepxplore as dx
from mlflow_di.fuzz import load_campaign, run_campaign
from mlflow_di.fuzz.deepxplore import DeepXplore, run_deepxplore
from mlflow_di.fuzz.results import comparable_records

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEDS = "digits[1300:1340]"


@pytest.fixture(scope="module")
def trained(trained_cnns):
    """digits-cnn trained briefly, and two pruned copies (50% unstructured, 30% channels)."""
    return trained_cnns


@pytest.fixture(scope="module")
def seeds():
    return load_images(SEEDS)


def _objective(models, pixels, labels, targets, neurons, strategy):
    passes = [dx.forward(m, pixels, dx.neuron_layers(m)) for m in models]
    return dx.objective([o for o, _ in passes], [a for _, a in passes], labels, targets, neurons,
                        strategy.lambda1, strategy.lambda2)


@pytest.mark.parametrize("constraint", ["lighting", "occlusion", "blackout"])
def test_a_constrained_gradient_step_increases_the_objective(trained, seeds, constraint):
    models = trained[:2]
    strategy = DeepXplore(constraint=constraint, occlusion_size=(4, 4), blackout_size=(2, 2), blackout_count=16)
    images = seeds.images[:6].astype(np.float32)
    labels = models[0].classifier().predict(seeds.images[:6])
    targets, neurons = [0, 1, 0, 1, 0, 1], [[(0, 1), (1, 2)]] * 6
    pixels = torch.from_numpy(images).requires_grad_(True)
    before = _objective(models, pixels, labels, targets, neurons, strategy)
    before.sum().backward()
    rng = np.random.default_rng(0)
    stepped = images.copy()
    for b, gradient in enumerate(pixels.grad.numpy()):
        gradient = gradient / np.sqrt(np.mean(gradient ** 2))
        direction, _ = strategy.constrain(gradient, rng)
        assert np.any(direction), "the step moves something"
        stepped[b] += 0.5 * direction  # a small step: first-order ascent
    with torch.no_grad():
        after = _objective(models, torch.from_numpy(stepped), labels, targets, neurons, strategy)
    assert torch.all(after > before.detach())


@pytest.fixture()
def generated(monkeypatch):
    """Every image a search generates: (seed index, seed, image, the step's operators), as it is made."""
    seen = []
    move = dx._Runner._move

    def spy(self, s, gradient):
        before = len(s.operators)
        move(self, s, gradient)
        seen.append((s.index, s.image, s.current.copy(), s.operators[before:]))

    monkeypatch.setattr(dx._Runner, "_move", spy)
    return seen


def test_lighting_changes_every_pixel_by_the_same_amount(trained, seeds, generated):
    result = run_deepxplore(list(trained[:2]), seeds, DeepXplore(constraint="lighting"), progress=False)
    assert result.summary.triggers >= 1 and generated
    for _, seed, image, operators in generated:
        assert operators == ["lighting"]
        difference = image.astype(int) - seed
        shifts = set(difference[(image > 0) & (image < 255)].tolist())  # pixels the clipping left alone
        assert len(shifts) <= 1
        for shift in shifts:
            np.testing.assert_array_equal(image, np.clip(seed.astype(int) + shift, 0, 255))


def test_occlusion_changes_only_its_rectangle(trained, seeds, generated):
    strategy = DeepXplore(constraint="occlusion", occlusion_at=(2, 3), occlusion_size=(4, 3))
    result = run_deepxplore(list(trained[:2]), seeds, strategy, progress=False)
    assert result.summary.triggers >= 1 and generated
    outside = np.ones((8, 8, 1), bool)
    outside[2:6, 3:6] = False
    for _, seed, image, _ in generated:
        np.testing.assert_array_equal(image[outside], seed[outside])
    for trigger, seed in zip(result.triggers, result.trigger_seeds):
        np.testing.assert_array_equal(trigger[outside], seed[outside])
        assert np.any(trigger != seed)


def test_blackout_only_darkens_small_rectangles(trained, seeds, generated):
    strategy = DeepXplore(constraint="blackout", blackout_size=(2, 2), blackout_count=2, step=40)
    result = run_deepxplore(list(trained[:2]), seeds, strategy, progress=False)
    assert generated
    rectangles: dict[int, np.ndarray] = {}
    for index, seed, image, operators in generated:
        assert np.all(image <= seed), "blackout only darkens"
        allowed = rectangles.setdefault(index, np.zeros((8, 8, 1), bool))
        for name in operators:
            if name != "blackout-none":
                row, column = map(int, name.split("@")[1].split(","))
                allowed[row:row + 2, column:column + 2] = True
        assert not np.any((image != seed) & ~allowed), "only the darkened rectangles change"
    assert any(np.any(image != seed) for _, seed, image, _ in generated)
    for record in result.records:
        if record.success:
            assert all(op.startswith("blackout") for op in record.operators)


def test_a_fruitless_climb_starts_again_from_the_seed_toward_each_target_then_with_each_finer_step(
        trained, seeds, monkeypatch):
    strategy = DeepXplore(step=1e-3, iterations=3, finer_steps=(2e-3,))  # steps too small to change a pixel
    assert strategy.climbs(1, 3) == [(1e-3, 1), (1e-3, 0), (1e-3, 2), (2e-3, 1), (2e-3, 0), (2e-3, 2)]
    moves = []
    move = dx._Runner._move

    def spy(self, s, gradient):
        moves.append((s.index, s.climbs[s.climb], s.climb_steps, s.current.copy(), s.image))
        move(self, s, gradient)

    monkeypatch.setattr(dx._Runner, "_move", spy)
    result = run_deepxplore(list(trained), seeds, strategy, max_queries=10_000, progress=False)
    fuzzed = [r for r in result.records if not r.already_deviating]
    assert fuzzed and all(r.queries == 3 * 6 and r.stop.value == "max_queries" for r in fuzzed)
    for record in fuzzed:
        mine = [(climb, steps) for index, climb, steps, _, _ in moves if index == record.index]
        expected = [(climb, step) for climb in strategy.climbs(mine[0][0][1], 3) for step in range(3)]
        assert mine == expected  # the last evaluation of each climb takes no step
        assert all(np.array_equal(current, image) for index, _, steps, current, image in moves
                   if index == record.index and steps == 0)  # every climb starts at the seed


def test_one_climb_is_the_references_and_caps_the_queries(trained, seeds):
    one = DeepXplore(step=1e-3, iterations=4, retarget=False, finer_steps=())
    assert one.climbs(0, 2) == [(1e-3, 0)]
    result = run_deepxplore(list(trained[:2]), seeds, one, progress=False)
    assert all(r.queries == 4 for r in result.records if not r.already_deviating)
    capped = run_deepxplore(list(trained[:2]), seeds, DeepXplore(step=1e-3, iterations=4), max_queries=6,
                            progress=False)
    assert all(r.queries == 6 for r in capped.records if not r.already_deviating)


def test_records_do_not_depend_on_the_batch(trained, seeds):
    models = list(trained[:2])
    strategy = DeepXplore(constraint="occlusion", occlusion_size=(5, 5))
    alone = run_deepxplore(models, seeds, strategy, batch=1, seed=3, timeout=1e6, progress=False)
    together = run_deepxplore(models, seeds, strategy, batch=8, seed=3, timeout=1e6, progress=False)
    assert comparable_records(alone) == comparable_records(together)
    np.testing.assert_array_equal(alone.triggers, together.triggers)
    assert alone.summary.triggers >= 1
    assert alone.neuron_coverage == together.neuron_coverage


def test_three_models_deviate_together_and_records_say_which(trained, seeds):
    result = run_deepxplore(list(trained), seeds, DeepXplore(constraint="occlusion", occlusion_size=(5, 5)),
                            max_queries=10, progress=False)
    assert result.config.compressed == "cnn-pruned,cnn-channels"
    assert set(result.neuron_coverage) == {"original", "compressed_1", "compressed_2", "all"}
    assert {r.target_model for r in result.records if not r.already_deviating} == {0, 1, 2}
    found = [r for r in result.records if r.success]
    assert found and all(r.queries <= 10 for r in result.records)
    p = [m.classifier().predict_proba(result.triggers) for m in trained]
    for row, record in enumerate(found):
        labels = [int(q[row].argmax()) for q in p]
        assert record.model_labels == labels and len(set(labels)) > 1
        first = next(k for k in (1, 2) if labels[k] != labels[0])
        assert record.trigger_labels == (labels[0], labels[first])
    deviating = [r for r in result.records if r.already_deviating]
    assert all(len(set(r.model_labels)) > 1 for r in deviating)


def test_an_interrupted_campaign_resumes_to_the_same_records(trained, seeds, tmp_path, monkeypatch):
    models = list(trained[:2])
    strategy = DeepXplore(constraint="occlusion", occlusion_size=(5, 5))
    reference = run_deepxplore(models, seeds, strategy, batch=4, timeout=1e6, progress=False)
    calls = {"n": 0}
    forward = dx.forward

    def interrupting(*args):
        calls["n"] += 1
        if calls["n"] == 40:  # mid-campaign, as Ctrl-C would
            raise KeyboardInterrupt
        return forward(*args)

    monkeypatch.setattr(dx, "forward", interrupting)
    out = tmp_path / "campaign"
    partial = run_deepxplore(models, seeds, strategy, batch=4, timeout=1e6, out_dir=out, progress=False)
    assert not partial.complete and 0 < len(partial.records) < len(seeds)
    resumed = run_deepxplore(models, seeds, strategy, batch=4, timeout=1e6, out_dir=out, resume=True, progress=False)
    assert resumed.complete and comparable_records(resumed) == comparable_records(reference)
    np.testing.assert_array_equal(resumed.triggers, reference.triggers)
    loaded = load_campaign(out)
    assert loaded.neuron_coverage == reference.neuron_coverage
    with pytest.raises(UserError, match="strategy_options"):
        run_deepxplore(models, seeds, DeepXplore(constraint="lighting"), out_dir=out, resume=True, progress=False)


def test_the_black_box_runner_and_bad_settings_are_refused(trained, seeds):
    with pytest.raises(UserError, match="needs a PyTorch model.s gradients"):
        run_campaign(trained[0].classifier(), trained[1].classifier(), seeds, strategy="deepxplore", progress=False)
    with pytest.raises(UserError, match="white-box PyTorch"):
        run_deepxplore([trained[0], trained[1].classifier()], seeds, progress=False)
    with pytest.raises(UserError, match="at least two models"):
        run_deepxplore([trained[0]], seeds, progress=False)
    with pytest.raises(UserError, match="outside the 8x8"):
        run_deepxplore(list(trained[:2]), seeds, DeepXplore(constraint="occlusion", occlusion_at=(8, 0)),
                       progress=False)
    with pytest.raises(UserError, match="constraint"):
        DeepXplore(constraint="fog")
    for steps in ((-1.0,), (float("nan"),), (0.0,)):
        with pytest.raises(UserError, match="each step of DeepXplore's finer_steps must be a positive number"):
            DeepXplore(finer_steps=steps)


def test_cli_runs_one_campaign_over_three_models_and_logs_the_coverage_reached(registered_cnn, tmp_path, capsys):
    import mlflow

    from mlflow_di.compression.prune import prune_l1, prune_structured
    from mlflow_di.models.loading import load_torch_model

    source = load_torch_model(registered_cnn)
    copies = []
    for name, module in (("pruned", prune_l1(source.module, 0.5).module),
                         ("channels", prune_structured(source.module, 0.3).module)):
        path = tmp_path / f"{name}.pt"
        torch.save({"module": module, "mlflow_di": {"preprocessing": source.preprocessing.to_dict()}}, path)
        copies.append(str(path))
    folder, summary_file = tmp_path / "campaign", tmp_path / "summary.json"
    args = ["fuzz", "--original", registered_cnn, "--compressed", copies[0], "--compressed", copies[1],
            "--seed-data", "digits[1300:1320]", "--strategy", "deepxplore", "--dx-constraint", "occlusion",
            "--dx-occlusion-size", "5,5", "--dx-iterations", "10", "--batch", "8", "--out-dir", str(folder)]
    assert main([*args, "--json-out", str(summary_file)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "neuron coverage reached" in printed
    summary = json.loads(summary_file.read_text())
    assert set(summary["neuron_coverage"]) == {"original", "compressed_1", "compressed_2", "all"}
    assert summary["strategy"] == "deepxplore" and summary["fuzzed"] >= 1
    result = load_campaign(folder)
    assert result.neuron_coverage == summary["neuron_coverage"]
    assert result.config.strategy_options["constraint"] == "occlusion"
    climbs = len(DeepXplore().climbs(0, 3))  # each of 3 targets, at each of 2 steps: 10 steps each
    assert all(len(r.model_labels) == 3 and r.queries <= 10 * climbs for r in result.records)
    run = mlflow.search_runs(search_all_experiments=True, output_format="list",
                             filter_string="tags.`mlflow_di.command` = 'fuzz'")[0]
    assert 0 < run.data.metrics["neuron_coverage.original"] <= 1
    assert "neuron_coverage.compressed_2" in run.data.metrics and "success_rate" in run.data.metrics
    assert run.data.params["dx_constraint"] == "occlusion" and run.data.params["dx_iterations"] == "10"
    assert "mlflow_di.compressed_uri" not in run.data.tags  # one campaign over three models: not one export's
    # resuming a finished campaign reruns nothing and gives the same records
    assert main([*args, "--resume"]) == 0
    assert comparable_records(load_campaign(folder)) == comparable_records(result)


def test_cli_refuses_a_model_that_is_not_pytorch_in_one_line(tracking_uri, tmp_path, capsys):
    from mlflow_di.models import zoo

    path = tmp_path / "cnn.pt"
    torch.save({"module": zoo.build("digits-cnn"),
                "mlflow_di": {"preprocessing": zoo.architecture("digits-cnn").preprocessing.to_dict()}}, path)
    onnx = tmp_path / "cnn-int8.onnx"
    onnx.write_bytes(b"not read: refused by kind")
    assert main(["fuzz", "--original", str(path), "--compressed", str(onnx), "--seed-data", "digits[0:4]",
                 "--strategy", "deepxplore"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the gradients of PyTorch models" in err[0] and "onnx" in err[0]


def test_a_fake_quantized_copy_agrees_with_the_int8_export_and_can_be_fuzzed(trained, seeds, tmp_path):
    from mlflow_di.compression.fake_quant import fake_quantize
    from mlflow_di.compression.methods import compress
    from mlflow_di.models.classifier import OnnxClassifier
    from mlflow_di.models.torch_model import TorchModel

    original = trained[0]
    calibration = load_images("digits[600:700]").images
    export = compress(original.module, original.preprocessing, "int8-static", tmp_path, calib_inputs=calibration)
    fake = TorchModel(fake_quantize(original.module, original.to_tensor(calibration)), original.preprocessing,
                      name="cnn-fake-int8")
    test = load_images("digits[1300:1797]").images
    onnx_labels = OnnxClassifier(export.path, original.preprocessing).predict(test)
    agreement = float((fake.classifier().predict(test) == onnx_labels).mean())
    assert agreement >= 0.9  # measured 0.950 on these 497 digits (the float model's agreement is the same)
    assert not torch.equal(fake.module.conv1[0][1].weight, original.module.conv1[0].weight)
    result = run_deepxplore([original, fake], seeds, DeepXplore(constraint="occlusion", occlusion_size=(5, 5)),
                            progress=False)
    assert result.summary.fuzzed >= 1 and set(result.neuron_coverage) == {"original", "compressed", "all"}
