"""Version against version: two registry versions of one model (models:/cnn/1 and models:/cnn/2,
not an original and its export) fuzzed black-box with every strategy, and ``gate --baseline
previous`` comparing a version with its predecessor."""
import json
import shutil

import mlflow
import pytest

from mlflow_di.cli import main
from mlflow_di.fuzz import STRATEGIES
from tests.conftest import active_store

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V1, V2 = "models:/cnn/1", "models:/cnn/2"


def _train_and_register(seed: int, epochs: int) -> None:
    """digits-cnn trained briefly (as conftest's ``registered_cnn``) and registered as a new version of 'cnn'."""
    import torch

    from mlflow_di.data import load_images
    from mlflow_di.mlflow_edge import models as edge_models, runs as tracking
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel
    from mlflow_di.models.training import train_classifier

    spec = zoo.architecture("digits-cnn")
    model = TorchModel(zoo.build("digits-cnn", seed=seed), spec.preprocessing, name="cnn",
                       metadata={"arch": "digits-cnn"})
    train = load_images("digits[0:600]")
    train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels), epochs=epochs,
                     progress=False)
    with tracking.tracked_run("train"):
        edge_models.log_torch_model(model, registered_model_name="cnn")


@pytest.fixture(scope="module")
def two_versions_store(tmp_path_factory, empty_store_file, one_torch_thread):
    """A store file with models:/cnn/1 (seed 0, 5 epochs) and models:/cnn/2 (seed 1, 3 epochs), trained
    once for the module; each test gets a copy (the model artifacts are referenced by absolute path)."""
    folder = tmp_path_factory.mktemp("cnn-versions")
    shutil.copy(empty_store_file, folder / "mlflow.db")
    with active_store(folder):
        _train_and_register(seed=0, epochs=5)
        _train_and_register(seed=1, epochs=3)
    return folder / "mlflow.db"


@pytest.fixture()
def cnn_versions(tracking_uri, tmp_path, two_versions_store):
    """The fresh store of ``tracking_uri`` holding models:/cnn/1 and models:/cnn/2."""
    shutil.copy(two_versions_store, tmp_path / "mlflow.db")
    return V1, V2


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_fuzzes_one_version_against_another(cnn_versions, tmp_path, capsys, strategy):
    out_dir = tmp_path / "campaign"
    code = main(["fuzz", "--original", V1, "--compressed", V2, "--strategy", strategy, "--seed-data",
                 "digits[1300:1310]", "--max-queries", "30", "--batch", "10", "--out-dir", str(out_dir)])
    assert code == 0, capsys.readouterr().err
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string="tags.`mlflow_di.command` = 'fuzz'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    tags = runs[0].data.tags
    assert (tags["mlflow_di.model_name"], tags["mlflow_di.model_version"]) == ("cnn", "1")
    assert (tags["mlflow_di.compressed_name"], tags["mlflow_di.compressed_version"]) == ("cnn", "2")
    assert tags["mlflow_di.compressed_uri"] == V2
    assert "success_rate" in runs[0].data.metrics
    assert list(out_dir.glob("records*")), sorted(p.name for p in out_dir.iterdir())


def test_gate_compares_a_version_with_its_predecessor(cnn_versions, tmp_path, capsys):
    for uri in (V1, V2):
        assert main(["coverage", "--model-uri", uri, "--train-data", "digits[0:200]",
                     "--test-data", "digits[1300:1350]"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    verdict_file = tmp_path / "verdict.json"
    code = main(["gate", "--model-uri", V2, "--baseline", "previous", "--max-idc-drop", "1.0",
                 "--json-out", str(verdict_file)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    verdict = json.loads(verdict_file.read_text())
    assert verdict["baseline_uri"] == V1
    assert "compared with the baseline models:/cnn/1" in out
    assert mlflow.MlflowClient().get_model_version("cnn", "2").tags["mlflow_di.gate_baseline"] == V1
    # the first version has no predecessor: an error like an alias not set yet ...
    args = ["gate", "--model-uri", V1, "--baseline", "previous", "--max-idc-drop", "0.1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--baseline-optional" in err and "no previous version" in err
    # ... or, with --baseline-optional, 'no baseline'
    assert main([*args, "--baseline-optional"]) == 0
    assert "no baseline: models:/cnn/1 has no previous version" in capsys.readouterr().out
    assert mlflow.MlflowClient().get_model_version("cnn", "1").tags["mlflow_di.gate_baseline"] == "none"


def test_the_previous_version_skips_deleted_numbers_and_other_models(mlflow_client):
    from mlflow_di.mlflow_edge.registry import previous_version

    experiment = mlflow_client.create_experiment("numbers")
    for name in ("m", "m2"):
        mlflow_client.create_registered_model(name)
        for _ in range(4):
            run_id = mlflow_client.create_run(experiment).info.run_id
            mlflow_client.create_model_version(name, source=f"runs:/{run_id}/model", run_id=run_id)
    mlflow_client.delete_model_version("m", "3")

    def previous(number):
        found = previous_version(mlflow_client.get_model_version("m", number), mlflow_client)
        return found and (found.name, str(found.version))

    assert [previous(n) for n in ("1", "2", "4")] == [None, ("m", "1"), ("m", "2")]
