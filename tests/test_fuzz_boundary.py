"""The boundary strategy (white-box original, black-box compressed model, inside a realism budget):
its differentiable SSIM against the measured one, every trigger inside its budget and confirmed by
both models, queries and the original's passes counted apart, resume, and the command line end to
end with its one-line refusals."""
import json

import numpy as np
import pytest
import torch

from mlflow_di.cli import main
from mlflow_di.data import ImageSet, load_images
from mlflow_di.errors import UserError
from mlflow_di.fuzz import load_campaign
from mlflow_di.fuzz.boundary import BoundaryWalk, differentiable_ssim, run_boundary
from mlflow_di.fuzz.realism import Constraint, budget_ssim, ssim

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair(trained_cnns):
    """digits-cnn trained briefly, and its 50% pruned copy as the 'compressed' black box."""
    original, pruned, _ = trained_cnns
    return original, pruned.classifier()


def test_the_differentiable_ssim_is_the_ssim_the_budget_bounds():
    """The lower of the paper's and the whole-image SSIM, whichever is lower: the paper's for noise in
    the middle of the image, the whole image's for a painted frame."""
    rng = np.random.default_rng(0)
    seed = rng.integers(0, 256, (16, 14, 3)).astype(np.uint8)
    images = [np.clip(seed.astype(int) + rng.integers(-40, 41, seed.shape), 0, 255).astype(np.uint8) for _ in range(3)]
    inner = seed.copy()
    inner[6:10, 5:9] = rng.integers(0, 256, (4, 4, 3))
    framed = seed.copy()
    framed[[0, -1]] = framed[:, [0, -1]] = 255
    images += [inner, framed, seed]
    values = differentiable_ssim(torch.from_numpy(np.stack(images).astype(np.float64)),
                                 torch.from_numpy(seed.astype(np.float64))[None]).numpy()
    np.testing.assert_allclose(values, [budget_ssim(image, seed) for image in images], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(values, [min(ssim(image, seed), ssim(image, seed, whole=True)) for image in images],
                               rtol=1e-9, atol=1e-12)
    assert ssim(inner, seed) < ssim(inner, seed, whole=True) and ssim(framed, seed, whole=True) < ssim(framed, seed)
    assert values[-1] == pytest.approx(1.0)


def test_every_trigger_is_inside_its_budget_and_confirmed_and_costs_are_counted_apart(pair, tmp_path):
    original, compressed = pair
    seeds = load_images("digits[1300:1330]")
    result = run_boundary(original, compressed, seeds, BoundaryWalk(constraint=Constraint(max_linf=48)),
                          max_queries=300, out_dir=tmp_path / "campaign", progress=False)
    fuzzed = [r for r in result.records if not r.already_deviating]
    assert result.summary.triggers >= 3, [r.stop for r in fuzzed]
    for record, trigger, seed in zip([r for r in result.records if r.success], result.triggers, result.trigger_seeds):
        assert np.abs(trigger.astype(int) - seed).max() <= 48  # checked, not assumed
        labels = (original.classifier().predict(trigger[None])[0], compressed.predict(trigger[None])[0])
        assert labels[0] != labels[1] and tuple(record.trigger_labels) == labels
        assert record.trigger_distances["linf"] <= 48
    assert all(r.queries <= 300 and r.original_passes > 0 for r in fuzzed)
    walked = [r for r in result.records if r.success and r.operators == ["walk"]]
    assert walked and all(r.queries <= 2 * 9 * 60 for r in walked)  # two queries per crossing at most
    again = load_campaign(tmp_path / "campaign")
    assert [r.to_json() for r in again.records] == [r.to_json() for r in result.records]


def test_resume_keeps_finished_seeds_and_matches_one_run(pair, tmp_path):
    original, compressed = pair
    seeds = load_images("digits[1300:1316]")
    strategy = BoundaryWalk(constraint=Constraint(max_linf=40), fallback=False)
    whole = run_boundary(original, compressed, seeds, strategy, max_queries=100, progress=False)
    first = seeds.subset(slice(0, 16), seeds.name)
    folder = tmp_path / "campaign"
    run_boundary(original, compressed, first, strategy, max_queries=100, out_dir=folder, progress=False)
    resumed = run_boundary(original, compressed, first, strategy, max_queries=100, out_dir=folder, resume=True,
                           progress=False)
    strip = lambda r: (r.index, r.success, r.queries, r.trigger_labels)  # noqa: E731 (seconds differ)
    assert [strip(r) for r in resumed.records] == [strip(r) for r in whole.records]


def test_the_fallbacks_of_many_seeds_together_query_what_each_queries_alone(pair, monkeypatch):
    """The DFlare fallbacks of the seeds the walks leave run together, one batched call of each model per step;
    each search sees only its own rows, so every seed's record is the one it gets with its fallback alone
    (FALLBACK_BATCH 1, the walk as it was), seconds aside."""
    from mlflow_di.fuzz import boundary

    original, compressed = pair
    seeds = load_images("digits[1300:1324]")
    strategy = BoundaryWalk(constraint=Constraint(max_linf=6), restarts=0)  # tight: most seeds reach the fallback
    together = run_boundary(original, compressed, seeds, strategy, max_queries=80, progress=False)
    monkeypatch.setattr(boundary, "FALLBACK_BATCH", 1)
    alone = run_boundary(original, compressed, seeds, strategy, max_queries=80, progress=False)
    strip = lambda r: (r.index, r.stop, r.queries, r.original_passes, r.operators, r.operator_counts,  # noqa: E731
                       r.trigger_labels, r.trigger_distances)
    assert [strip(r) for r in together.records] == [strip(r) for r in alone.records]
    fallen = [r for r in together.records if "dflare" in r.operator_counts]
    assert len(fallen) >= 8 and any(r.success for r in fallen), [r.operator_counts for r in together.records]
    assert all(r.seconds > 0 for r in fallen)  # each charged its own work and its share of the calls


def test_seeds_walked_together_take_the_paths_they_take_alone_in_fewer_passes(pair, monkeypatch):
    """Up to WALK_BATCH seeds walk together, every step's questions in one batched pass of the original: each seed's
    record (stop, queries, the original's passes counted per seed, operators, trigger) is the one it gets walked
    alone (WALK_BATCH 1), in a fraction of the model calls."""
    from mlflow_di.fuzz import boundary

    original, compressed = pair
    seeds = load_images("digits[1300:1332]")
    strategy = BoundaryWalk(constraint=Constraint(max_linf=16), fallback=False)  # crossings and stalls
    calls = []
    logits = boundary._Walker._logits
    monkeypatch.setattr(boundary._Walker, "_logits", lambda self, pixels: calls.append(len(pixels)) or
                        logits(self, pixels))
    together = run_boundary(original, compressed, seeds, strategy, max_queries=200, progress=False)
    together_calls, calls[:] = len(calls), []
    monkeypatch.setattr(boundary, "WALK_BATCH", 1)
    alone = run_boundary(original, compressed, seeds, strategy, max_queries=200, progress=False)
    strip = lambda r: (r.index, r.stop, r.queries, r.original_passes, r.operators, r.operator_counts,  # noqa: E731
                       r.trigger_labels, r.trigger_distances)
    assert [strip(r) for r in together.records] == [strip(r) for r in alone.records]
    fuzzed = [r for r in together.records if not r.already_deviating]
    assert together.summary.triggers >= 4 and any(not r.success for r in fuzzed), [r.stop for r in fuzzed]
    assert together_calls * 4 < len(calls), (together_calls, len(calls))
    assert all(r.seconds > 0 for r in together.records if not r.already_deviating)


def test_the_walk_width_keeps_a_batched_pass_within_its_pixels():
    from mlflow_di.fuzz.boundary import WALK_BATCH, WALK_PIXELS, walk_width

    assert walk_width((8, 8, 1), 9) == WALK_BATCH
    assert walk_width((224, 224, 3), 9) * 224 * 224 * 3 * 9 <= WALK_PIXELS and walk_width((224, 224, 3), 9) >= 1
    assert walk_width((1024, 1024, 3), 9) == 1  # one seed's targets are one pass, as they always were


def test_a_seed_too_small_for_ssim_and_a_bad_step_are_one_line(pair):
    original, compressed = pair
    with pytest.raises(UserError, match="--min-ssim needs images of at least 11x11"):
        run_boundary(original, compressed, load_images("digits[0:4]"),
                     BoundaryWalk(constraint=Constraint(min_ssim=0.9)), progress=False)
    with pytest.raises(UserError, match="step sizes must be positive"):
        BoundaryWalk(step_sizes=(0.0,))
    with pytest.raises(UserError, match="L-inf step sizes must be positive"):
        BoundaryWalk(linf_step_sizes=(2.0, -1.0))
    with pytest.raises(UserError, match="no negative count"):
        BoundaryWalk(restarts=-1)


def test_restarts_and_linf_step_sizes_walk_more_and_stay_inside_the_budget(pair):
    """The oracle's settings (benchmarks/bench_boundary.py): walks with several L-inf step sizes, then
    from random points inside the budget; on seeds the plain walk leaves, they can only add triggers,
    every one inside the budget. A walk without them records neither (saved campaigns resume)."""
    original, compressed = pair
    seeds = load_images("digits[1300:1340]")
    tight = Constraint(max_linf=12)
    plain = run_boundary(original, compressed, seeds, BoundaryWalk(constraint=tight, fallback=False, restarts=0),
                         max_queries=200, progress=False)
    # its first walk is the plain one (1.5 = max(1, 12 / 8) levels), so it can only add triggers
    strong = BoundaryWalk(constraint=tight, fallback=False, restarts=3, linf_step_sizes=(1.5, 3.0))
    more = run_boundary(original, compressed, seeds, strong, max_queries=200, progress=False)
    assert {r.index for r in more.records if r.success} >= {r.index for r in plain.records if r.success}
    assert all(tight.allows(t, s) for t, s in zip(more.triggers, more.trigger_seeds))
    assert sum(r.original_passes for r in more.records) > sum(r.original_passes for r in plain.records)
    before = BoundaryWalk(restarts=0).options()  # what campaigns saved before restarts existed recorded
    assert "restarts" not in before and "linf_step_sizes" not in BoundaryWalk().options()
    assert BoundaryWalk().options()["restarts"] == 1
    assert strong.options()["restarts"] == 3 and strong.options()["linf_step_sizes"] == [1.5, 3.0]


def test_an_ssim_budget_holds_on_larger_images(pair):
    """16x16 copies of the digits (each pixel doubled) through a model that pools them back: every
    image the walk proposes is inside SSIM >= 0.8, so every trigger is."""
    from mlflow_di.models.torch_model import TorchModel

    original, _ = pair

    class Halve(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.pool, self.inner = torch.nn.AvgPool2d(2), inner

        def forward(self, x):
            return self.inner(self.pool(x))

    import dataclasses

    from mlflow_di.compression.prune import prune_l1

    preprocessing = dataclasses.replace(original.preprocessing, input_shape=(16, 16, 1))
    big = TorchModel(Halve(original.module), preprocessing, name="cnn16")
    other = TorchModel(Halve(prune_l1(original.module, 0.5).module), preprocessing, name="cnn16-pruned")
    digits = load_images("digits[1300:1312]")
    images = np.repeat(np.repeat(np.asarray(digits.images), 2, axis=1), 2, axis=2)
    seeds = ImageSet(images, np.asarray(digits.labels), "digits16")
    result = run_boundary(big, other.classifier(), seeds, BoundaryWalk(constraint=Constraint(min_ssim=0.8), steps=20),
                          max_queries=200, progress=False)
    assert result.summary.triggers >= 1
    assert all(ssim(trigger, seed) >= 0.8 for trigger, seed in zip(result.triggers, result.trigger_seeds))


def test_cli_boundary_logs_queries_passes_and_realism_and_refuses_what_it_cannot_do(registered_cnn, tmp_path, capsys):
    import mlflow

    from mlflow_di.compression.prune import prune_l1
    from mlflow_di.models.loading import load_torch_model

    source = load_torch_model(registered_cnn)
    pruned = tmp_path / "pruned.pt"
    torch.save({"module": prune_l1(source.module, 0.5).module,
                "mlflow_di": {"preprocessing": source.preprocessing.to_dict()}}, pruned)
    summary_file = tmp_path / "summary.json"
    args = ["fuzz", "--original", registered_cnn, "--compressed", str(pruned), "--seed-data", "digits[1300:1316]",
            "--strategy", "boundary", "--max-linf", "48", "--max-queries", "200"]
    assert main([*args, "--json-out", str(summary_file), "--out-dir", str(tmp_path / "c")]) == 0, \
        capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "forward/backward passes per seed" in printed and "realism:" in printed
    summary = json.loads(summary_file.read_text())
    assert summary["strategy"] == "boundary" and summary["mean_original_passes"] > 0
    assert summary["realism_max_linf"] == 48 and "realism_min_ssim" in summary
    assert summary["realistic_triggers"] == summary["triggers"]  # searched inside the budget it is judged by
    run = mlflow.search_runs(search_all_experiments=True, output_format="list",
                             filter_string="tags.`mlflow_di.command` = 'fuzz'")[0]
    assert run.data.metrics["mean_original_passes"] > 0 and "mlflow_di.fuzz_constraint" in run.data.tags
    black_box = [*args]
    black_box[2], black_box[4] = str(shared_tflite(tmp_path)), registered_cnn  # a TFLite original
    code = main([*black_box, "--out-dir", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert code == 2 and "needs the gradients of PyTorch models" in err and "as --original" in err
    for extra, expected in ((["--workers", "2"], "boundary runs in this process"),
                            (["--overlap"], "boundary runs its models in its own loop")):
        code = main([*args, *extra, "--out-dir", str(tmp_path / "refused")])
        err = capsys.readouterr().err
        assert code == 2 and expected in err and "Traceback" not in err


def test_cli_boundary_walks_toward_each_of_several_exports_in_its_own_campaign(registered_cnn, tmp_path, capsys):
    from mlflow_di.compression.prune import prune_l1
    from mlflow_di.models.loading import load_torch_model

    source = load_torch_model(registered_cnn)
    exports = []
    for amount in (0.5, 0.3):
        path = tmp_path / f"pruned-{amount}.pt"
        torch.save({"module": prune_l1(source.module, amount).module,
                    "mlflow_di": {"preprocessing": source.preprocessing.to_dict()}}, path)
        exports += ["--compressed", str(path)]
    folder = tmp_path / "both"
    code = main(["fuzz", "--original", registered_cnn, *exports, "--seed-data", "digits[1300:1310]",
                 "--strategy", "boundary", "--max-linf", "48", "--max-queries", "100", "--out-dir", str(folder)])
    assert code == 0, capsys.readouterr().err
    campaigns = sorted(path.parent for path in folder.rglob("campaign.json"))
    assert len(campaigns) == 2
    for campaign in campaigns:
        result = load_campaign(campaign)
        assert result.config.strategy == "boundary" and len(result.records) == 10
        assert all(Constraint(max_linf=48).allows(t, s) for t, s in zip(result.triggers, result.trigger_seeds))


def shared_tflite(tmp_path):
    """A TFLite model: the DFlare reference's, or (without ../shared) a file with a .tflite name whose
    kind is refused before it is read."""
    from conftest import _shared_path

    path = _shared_path() / "models" / "dflare" / "lenet5-quan.lite"
    if path.is_file():
        return path
    stand_in = tmp_path / "model.tflite"
    stand_in.write_bytes(b"not read")
    return stand_in


def test_a_target_pressed_against_the_budget_stops_walking():
    """A target whose margin makes no new low for `patience` steps is dropped; one still falling is not."""
    from mlflow_di.fuzz.boundary import _Stall

    stall = _Stall(2, patience=3)
    for step in range(4):  # the first margin is each target's first low; then 3 steps without a new one
        assert stall.walking() == [0, 1]
        stall.observe([0, 1], np.array([5.0 - step, 2.0]))  # target 0 keeps falling, target 1 stalls
    assert stall.walking() == [0]
    assert _Stall(2, patience=None).walking() == [0, 1]
    with pytest.raises(UserError, match="patience"):
        BoundaryWalk(patience=0)
    assert BoundaryWalk().options()["patience"] == 10 and "patience" not in BoundaryWalk(patience=None).options()


def test_the_ssim_pixel_cost_is_the_second_order_drop_and_sees_the_border():
    """w_p * d**2 is the drop of the summed local SSIMs for a change of d levels at pixel p (checked
    by finite differences away from the border, where every window that weighs p fits), and a pixel
    on the border costs what it would cost inside: the metric itself barely sees it."""
    from mlflow_di.fuzz.realism import SSIM_RADIUS, _filter, local_ssim, ssim_pixel_cost

    rng = np.random.default_rng(1)
    seed = np.zeros((32, 30, 2))
    seed[9:22, 10:16] = 200.0
    seed[10:14, 12:28] = rng.integers(0, 256, (4, 16, 2))
    cost = ssim_pixel_cost(seed.astype(np.uint8))
    assert cost.shape == seed.shape and (cost > 0).all()
    inside = [(p, q, ch) for p in range(2 * SSIM_RADIUS, 32 - 2 * SSIM_RADIUS)
              for q in range(2 * SSIM_RADIUS, 30 - 2 * SSIM_RADIUS) for ch in (0, 1)]
    for p, q, ch in [inside[i] for i in rng.choice(len(inside), 25, replace=False)]:
        changed = seed.copy()
        changed[p, q, ch] += 0.5 if seed[p, q, ch] < 128 else -0.5
        drop = (1 - local_ssim(changed, seed, _filter)).sum()
        assert cost[p, q, ch] * 0.25 == pytest.approx(drop, rel=1e-2)
    flat = seed[..., :1] * 0  # all black: every pixel alike, the corner as dear as the centre
    flat_cost = ssim_pixel_cost(flat.astype(np.uint8))
    assert flat_cost[0, 0, 0] == pytest.approx(flat_cost[16, 15, 0], rel=1e-9)
    assert cost[15, 13, 0] < cost[28, 3, 0] / 10  # inside the textured stroke: a change is masked


def test_the_weighted_walk_crosses_where_the_plain_gradient_pressed_against_ssim(shared_dir, mnist_spec):
    """MNIST test 9702, 9705 and 9715 on the DFlare LeNet-5 pair under SSIM >= 0.9: the plain gradient
    walk (ssim_weighting=0) ends every target against the bound without the original's label
    changing, so it never queries the compressed model; weighted by SSIM's pixel costs, it crosses,
    and the trigger's change lies inside the image, not in the frame SSIM barely sees."""
    from mlflow_di.models.loading import load_classifier, load_torch_model

    models = shared_dir / "models" / "dflare"
    original = load_torch_model(f"keras:lenet5-same:{models / 'lenet5.h5'}")
    compressed = load_classifier(str(models / "lenet5-quan.lite"))
    seeds = load_images(f"{mnist_spec}[9702:9716]")
    seeds = ImageSet(seeds.images[[0, 3, 13]], seeds.labels[[0, 3, 13]], "three seeds")
    budget = Constraint(min_ssim=0.9)

    def walk(weighting):
        return run_boundary(original, compressed, seeds, BoundaryWalk(constraint=budget, ssim_weighting=weighting,
                            fallback=False, restarts=0), max_queries=50, progress=False)

    plain, weighted = walk(0.0), walk(0.5)
    assert [r.queries for r in plain.records] == [0, 0, 0] and plain.summary.triggers == 0
    assert weighted.summary.triggers == 3 and all(r.operators == ["walk"] for r in weighted.records)
    frame = np.ones((28, 28), bool)
    frame[5:23, 5:23] = False
    for trigger, seed in zip(weighted.triggers, weighted.trigger_seeds):
        assert budget.allows(trigger, seed)
        change = (trigger.astype(float) - seed)[..., 0] ** 2
        assert change[frame].sum() < 0.3 * change.sum()
    with pytest.raises(UserError, match="ssim_weighting"):
        BoundaryWalk(ssim_weighting=-1)
    assert "ssim_weighting" not in BoundaryWalk(ssim_weighting=0).options()
