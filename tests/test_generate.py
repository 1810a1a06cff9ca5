"""IDC-guided generation: the engine on small models (one hand-made), and ``mlflow-di generate`` end to end."""
import json

import mlflow
import numpy as np
import pytest
import torch
from torch import nn

from mlflow_di.cli import main
from mlflow_di.coverage.generation import generate
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.data import ImageSet, load_images
from mlflow_di.models import zoo
from mlflow_di.models.torch_model import TorchModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cnn():
    """digits-cnn trained briefly, and its IDC (4 important neurons) fitted on digits[0:600]."""
    from mlflow_di.models.training import train_zoo_model

    train = load_images("digits[0:600]")
    model = train_zoo_model("digits-cnn", train, epochs=5, name="cnn")
    idc = ImportanceDrivenCoverage(top_m=4, progress=False).fit(model, train)
    return model, idc, load_images("digits[1300:1360]")


@pytest.fixture(scope="module")
def brightness_model():
    """A hand-made case: one hidden neuron (the mean pixel), a head that always says class 0, and IDC with
    two hand-set clusters, black and brightened; black seeds cover only the first."""
    spec = zoo.architecture("digits-cnn")
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 1), nn.Linear(1, 2))
    with torch.no_grad():
        module[1].weight.fill_(1 / 64)
        module[1].bias.zero_()
        module[2].weight.zero_()
        module[2].bias.copy_(torch.tensor([3.0, -2.0]))
    model = TorchModel(module, spec.preprocessing, name="brightness")
    rng = np.random.default_rng(0)
    analysis = ImageSet(rng.integers(0, 256, (40, 8, 8, 1), dtype=np.uint8), np.zeros(40, dtype=np.int64), "noise")
    idc = ImportanceDrivenCoverage(layers="1", top_m=1, clusters=(2,), progress=False).fit(model, analysis)
    bright = idc.activations(np.full((1, 8, 8, 1), 25, dtype=np.uint8))["1"][0, 0]
    idc.fitted_layers_["1"].centroids = [np.array([0.0, float(bright)])]
    seeds = ImageSet(np.zeros((5, 8, 8, 1), dtype=np.uint8), np.zeros(5, dtype=np.int64), "black")
    return model, idc, seeds


def test_combinations_agree_with_score(cnn):
    model, idc, seeds = cnn
    assert np.array_equal(idc.combinations(seeds.images), idc.score(seeds).combination)


def test_every_kept_input_covered_a_new_combination_when_kept(cnn):
    model, idc, seeds = cnn
    result = generate(idc, model, seeds, 400, batch_size=32, seed=1)
    assert result.kept > 0
    covered = set(idc.combinations(seeds.images).tolist())
    assert len(covered) == result.seeds_covered
    for image, combination in zip(result.images, result.combinations.tolist()):
        again = int(idc.combinations(image[None])[0])
        assert again == combination and again not in covered
        covered.add(again)
    both = idc.score(result.images, accumulate=idc.score(seeds))
    assert both.idc == pytest.approx(result.idc_guided) and result.idc_guided > result.idc_seeds
    assert result.idc_random >= result.idc_seeds


def test_kept_inputs_keep_their_seeds_label_under_the_oracle(cnn):
    model, idc, seeds = cnn
    result = generate(idc, model, seeds, 300, seed=2)
    assert np.array_equal(model.classifier().predict(result.images), result.labels)
    assert np.array_equal(result.labels, seeds.labels[result.seed_index])
    assert result.images.dtype == np.uint8 and result.images.shape[1:] == seeds.images.shape[1:]
    assert all(len(chain.split("+")) <= 3 for chain in result.operators)  # max_depth


def test_deterministic_with_the_seed_and_the_budget_is_respected(cnn):
    model, idc, seeds = cnn
    first = generate(idc, model, seeds, 37, batch_size=16, seed=5)
    again = generate(idc, model, seeds, 37, batch_size=16, seed=5)
    assert np.array_equal(first.images, again.images) and first.operators == again.operators
    assert np.array_equal(first.guided_growth, again.guided_growth)
    assert np.array_equal(first.random_growth, again.random_growth)
    assert len(first.guided_growth) <= 37 and len(first.random_growth) <= 37
    if first.idc_guided < 1:
        assert len(first.guided_growth) == 37
    assert np.all(np.diff(first.guided_growth) >= 0) and first.kept == first.guided_growth[-1] - first.seeds_covered


def test_the_constructed_case_grows_strictly_and_stops_at_full_coverage(brightness_model):
    model, idc, seeds = brightness_model
    result = generate(idc, model, seeds, 500, batch_size=8, seed=0)
    assert result.idc_seeds == 0.5 and result.idc_guided == 1.0 and result.kept == 1
    assert len(result.guided_growth) < 500  # stopped once every combination was covered
    assert result.images[0].mean() > 0 and idc.combinations(result.images)[0] == 1


def test_bad_budget_and_layer(cnn):
    from mlflow_di.errors import UserError

    model, idc, seeds = cnn
    with pytest.raises(UserError, match="budget"):
        generate(idc, model, seeds, 0)
    with pytest.raises(UserError, match="no layer 'nope'"):
        generate(idc, model, seeds, 10, layer="nope")


@pytest.mark.slow
def test_generate_command_end_to_end(registered_cnn, mlflow_client, tmp_path, capsys):
    assert main(["coverage", "--model-uri", registered_cnn, "--train-data", "digits[0:600]",
                 "--test-data", "digits[600:700]", "--criteria", "idc", "--top-m", "4"]) == 0
    experiments = [e.experiment_id for e in mlflow_client.search_experiments()]
    coverage_run = mlflow_client.search_runs(experiments, "tags.`mlflow_di.command` = 'coverage'")[0].info.run_id
    out, summary_file = tmp_path / "generated.npz", tmp_path / "summary.json"
    assert main(["generate", "--model-uri", registered_cnn, "--coverage", "latest", "--data", "digits[1300:1400]",
                 "--num-seeds", "40", "--budget", "300", "--batch", "50", "--out", str(out),
                 "--json-out", str(summary_file)]) == 0
    printed = capsys.readouterr().out
    assert "guided" in printed and f"--coverage latest: coverage run {coverage_run}" in printed
    run = mlflow_client.search_runs(experiments, "tags.`mlflow_di.command` = 'generate'")[0]
    assert run.info.status == "FINISHED" and run.data.params["coverage"] == coverage_run
    metrics = run.data.metrics
    assert metrics["idc_guided"] >= metrics["idc_seeds"] and metrics["queries_guided"] <= 300
    summary = json.loads(summary_file.read_text())
    assert summary["kept"] == metrics["kept"] and summary["seeds"] == 40
    generated = load_images(f"npz:{out}")
    assert len(generated) == summary["kept"] > 0
    inputs = {i.tags[0].value: i.dataset for i in mlflow_client.get_run(run.info.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"seeds", "generated"}
    assert inputs["seeds"].name == "digits[1300:1400] (first 40)"
    assert len(mlflow.data.get_source(inputs["generated"]).load()) == summary["kept"]
    artifacts = {a.path for a in mlflow_client.list_artifacts(run.info.run_id, "generation")}
    assert {"generation/generated.npz", "generation/idc_growth.png", "generation/report.html",
            "generation/preview.png", "generation/summary.json"} <= artifacts
    report = mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/generation/report.html")
    assert "IDC growth" in report and "random" in report
