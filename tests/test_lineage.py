"""Lineage in MLflow: the data a command read as run inputs (datasets with contexts and digests, a
source that loads the spec again), results on the model version's LoggedModel, IDC growth as a step
metric and triggers as an image series."""
import configparser
import hashlib
import json
import pathlib

import mlflow
import numpy as np
import pytest

from mlflow_di.cli import main
from mlflow_di.data import fingerprint, load_images
from mlflow_di.mlflow_edge import datasets, registry

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _runs(client, command):
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, f"tags.`mlflow_di.command` = '{command}'")


def _inputs(run) -> dict:
    """{(context, name): dataset entity} of a run's inputs."""
    found = {}
    for item in run.inputs.dataset_inputs:
        context = {tag.key: tag.value for tag in item.tags}.get("mlflow.data.context")
        found[(context, item.dataset.name)] = item.dataset
    return found


def _by_hand(spec: str, first: int | None = None) -> str:
    """SHA-256 of the pixels then the labels, all in memory, cut to MLflow's 8 characters."""
    data = load_images(spec)
    images, labels = np.asarray(data.images), data.labels
    if first is not None:
        images, labels = images[:first], labels[:first]
    return hashlib.sha256(np.ascontiguousarray(images).tobytes() + labels.tobytes()).hexdigest()[:8]


def test_setup_cfg_declares_the_dataset_source_entry_point():
    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).parents[1] / "setup.cfg")
    entry = config["options.entry_points"]["mlflow.dataset_source"].strip()
    assert entry == "mlflow_di = mlflow_di.mlflow_edge.spec_source:SpecSource"
    module, _, name = entry.split("=")[1].strip().partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is datasets.SpecSource


def test_a_spec_source_resolves_round_trips_and_loads(tracking_uri):
    from mlflow.data.dataset_source_registry import get_dataset_source_from_json, resolve_dataset_source

    datasets.ensure_registered()
    datasets.ensure_registered()  # once is enough: a second call adds nothing
    assert sum(s is datasets.SpecSource for s in mlflow.data.dataset_source_registry.get_registered_sources()) <= 1
    source = resolve_dataset_source("mlflow-di:digits[0:20]")
    assert isinstance(source, datasets.SpecSource) and source.spec == "digits[0:20]"
    assert resolve_dataset_source({"spec": "digits", "first": 5}).load().labels.tolist() == \
        load_images("digits[0:5]").labels.tolist()
    again = get_dataset_source_from_json(source.to_json(), "mlflow_di")
    assert again.to_dict() == {"spec": "digits[0:20]"} and len(again.load()) == 20


def test_the_digest_reads_lazy_sets_in_batches_and_equals_the_in_memory_one(tmp_path):
    digits = load_images("digits[0:70]")
    np.savez(tmp_path / "d.npz", x=np.asarray(digits.images)[..., 0], y=digits.labels)
    lazy = load_images(f"npz:{tmp_path / 'd.npz'}")
    assert type(lazy.images).__name__ == "LazyImages"
    assert fingerprint(lazy, batch_size=16) == fingerprint(digits, batch_size=256)
    dataset = datasets.spec_dataset(lazy)
    assert dataset.digest == _by_hand("digits[0:70]") and dataset.name == lazy.name
    assert dataset.profile["num_images"] == 70 and dataset.profile["image_shape"] == [8, 8, 1]
    assert sum(dataset.profile["label_counts"].values()) == 70
    entity = dataset._to_mlflow_entity()
    assert json.loads(entity.profile)["sha256"].startswith(entity.digest)
    assert json.loads(entity.schema)["images"]["shape"] == [-1, 8, 8, 1]


def test_logged_model_id_of_versions_and_of_other_uris(registered_cnn, mlflow_client):
    model_id = registry.logged_model_id(registered_cnn)
    assert model_id and model_id.startswith("m-")
    assert mlflow_client.get_logged_model(model_id).model_id == model_id
    assert registry.logged_model_id("models:/cnn/99") is None  # no such version: quietly none
    assert registry.logged_model_id("some/model.onnx") is None

    class OldStyle:  # a version registered from a run artifact (MLflow 2): no LoggedModel
        model_id, source = None, "runs:/abc/model"
    assert registry.version_model_id(OldStyle) is None
    OldStyle.source = "models:/m-0123abcd"
    assert registry.version_model_id(OldStyle) == "m-0123abcd"


def test_coverage_logs_its_data_idc_on_the_model_and_the_growth_as_steps(registered_cnn, mlflow_client):
    assert main(["coverage", "--model-uri", registered_cnn, "--train-data", "digits[0:300]",
                 "--test-data", "digits[600:700]", "--test-data", "digits[700:750]", "--criteria", "idc",
                 "--top-m", "3"]) == 0
    run = _runs(mlflow_client, "coverage")[0]
    inputs = _inputs(run)
    assert set(inputs) == {("training", "digits[0:300]"), ("test", "digits[600:700]"), ("test", "digits[700:750]")}
    for (_, spec), entity in inputs.items():
        assert entity.digest == _by_hand(spec) and entity.source_type == "mlflow_di"
        assert len(mlflow.data.get_source(entity).load()) == len(load_images(spec))
    model = mlflow_client.get_logged_model(registry.logged_model_id(registered_cnn))
    on_model = {m.key: m for m in model.metrics}
    assert on_model["idc"].value == pytest.approx(run.data.metrics["idc"])
    assert on_model["idc"].run_id == run.info.run_id and on_model["idc"].dataset_name == "digits[700:750]"
    history = mlflow_client.get_metric_history(run.info.run_id, "idc_growth")
    assert len(history) > 10 and history[-1].step == 150
    assert [p.step for p in history] == sorted(p.step for p in history)
    assert history[-1].value == pytest.approx(run.data.metrics["idc"])


def test_a_model_file_is_measured_without_a_logged_model(tmp_path, tracking_uri, mlflow_client):
    import torch

    from mlflow_di.models import zoo

    path = tmp_path / "cnn.pt"
    torch.save({"module": zoo.build("digits-cnn", seed=0),
                "mlflow_di": {"preprocessing": zoo.architecture("digits-cnn").preprocessing.to_dict()}}, path)
    assert main(["coverage", "--model-uri", str(path), "--train-data", "digits[0:100]", "--test-data",
                 "digits[600:650]", "--criteria", "idc", "--top-m", "2", "--all-inputs"]) == 0
    run = _runs(mlflow_client, "coverage")[0]
    assert run.info.status == "FINISHED" and "idc" in run.data.metrics
    assert {context for context, _ in _inputs(run)} == {"training", "test"}


def test_compress_and_fuzz_record_their_data_and_put_results_on_the_exports(registered_cnn, mlflow_client, tmp_path):
    assert main(["compress", "--model-uri", registered_cnn, "--method", "int8-static,prune-l1", "--amount", "0.5",
                 "--calib-data", "digits[0:40]", "--eval-data", "digits[1300:1400]", "--diagnosis-images", "0"]) == 0
    by_method = {r.data.tags["mlflow_di.method"]: r for r in _runs(mlflow_client, "compress")}
    static = _inputs(by_method["int8-static"])
    assert set(static) == {("calibration", "digits[0:40]"), ("evaluation", "digits[1300:1400]")}
    assert static[("evaluation", "digits[1300:1400]")].digest == _by_hand("digits[1300:1400]")
    assert set(_inputs(by_method["prune-l1"])) == {("evaluation", "digits[1300:1400]")}  # no calibration read
    for method, run in by_method.items():
        export = registry.logged_model_id(f"models:/cnn-{method}/1")
        metrics = {m.key: m.value for m in mlflow_client.get_logged_model(export).metrics}
        assert metrics["accuracy_drop"] == pytest.approx(run.data.metrics["accuracy_drop"])

    export = "models:/cnn-prune-l1/1"
    assert main(["fuzz", "--original", registered_cnn, "--compressed", export, "--seed-data", "digits[1300:]",
                 "--num-seeds", "30", "--max-queries", "200", "--out-dir", str(tmp_path / "campaign")]) == 0
    run = _runs(mlflow_client, "fuzz")[0]
    (context, name), entity = next(iter(_inputs(run).items()))
    assert (context, name) == ("seeds", "digits[1300:] (first 30)")
    assert entity.digest == _by_hand("digits[1300:]", first=30)
    assert len(mlflow.data.get_source(entity).load()) == 30
    model = mlflow_client.get_logged_model(registry.logged_model_id(export))
    on_model = {m.key: m for m in model.metrics}
    assert on_model["success_rate"].value == pytest.approx(run.data.metrics["success_rate"])
    assert on_model["success_rate"].dataset_digest == entity.digest
    triggers = int(run.data.metrics["triggers"])
    assert triggers, "the half-pruned export deviates somewhere within 200 queries"
    paths = [a.path for a in mlflow_client.list_artifacts(run.info.run_id, "images")]  # the series, besides the grid
    assert len([p for p in paths if p.endswith(".png") and "triggers" in p]) == min(triggers, 16)


def test_inputs_series_and_images_are_kept_locally_once_the_store_failed(tracking_uri, monkeypatch, capsys):
    from mlflow.exceptions import MlflowException

    from mlflow_di.mlflow_edge import runs

    from mlflow_di.errors import UserError

    dataset = datasets.spec_dataset(load_images("digits[0:10]"))
    with pytest.raises(UserError, match="could not log to the tracking store"):
        with runs.tracked_run("store goes away") as log:
            log.input(dataset, "test")
            log.metric_series("idc_growth", {1: 0.1, 2: 0.2})
            monkeypatch.setattr(mlflow, "log_text", lambda *a, **k: (_ for _ in ()).throw(
                MlflowException("API request failed: connection refused")))
            log.text("x", "report.html")
            log.input(dataset, "training")
            log.metric_series("idc_growth", {3: 0.3})
            log.image_series(np.zeros((2, 8, 8, 1), np.uint8), "triggers")  # one channel: PIL takes (H, W)
            log.image(np.zeros((1, 1, 1), np.uint8), "grid.png")
            log.metrics({"idc": 0.3}, model_id="m-nowhere", dataset=dataset)
    run = mlflow.get_run(log.run_id)
    assert set(_inputs(run)) == {("test", "digits[0:10]")}
    assert [p.step for p in mlflow.MlflowClient().get_metric_history(log.run_id, "idc_growth")] == [1, 2]
    kept = pathlib.Path("mlflow-di-unlogged") / log.run_id
    assert "training: digits[0:10]" in json.loads((kept / "inputs.json").read_text())
    assert json.loads((kept / "metric_series" / "idc_growth.json").read_text()) == {"3": 0.3}
    assert sorted(p.name for p in (kept / "images" / "triggers").iterdir()) == ["0.png", "1.png"]
    assert json.loads((kept / "metrics.json").read_text()) == {"idc": 0.3}
    assert (kept / "grid.png").exists() and run.info.status == "FAILED"


def test_data_read_in_two_roles_is_one_input_naming_both(tracking_uri):
    from mlflow_di.mlflow_edge import runs

    same, other = datasets.spec_dataset(load_images("digits[0:10]")), datasets.spec_dataset(load_images("digits[5:9]"))
    with runs.tracked_run("two roles") as log:
        log.inputs([(same, "calibration"), (same, "evaluation"), (other, "test"), (same, "evaluation")])
    inputs = _inputs(mlflow.get_run(log.run_id))
    assert set(inputs) == {("calibration,evaluation", "digits[0:10]"), ("test", "digits[5:9]")}


def test_the_gate_reads_coverage_from_the_models_own_page_first(registered_cnn, mlflow_client):
    from mlflow_di.mlflow_edge import gate_evidence

    assert main(["coverage", "--model-uri", registered_cnn, "--train-data", "digits[0:300]",
                 "--test-data", "digits[600:700]", "--criteria", "idc", "--top-m", "3"]) == 0
    measured = _runs(mlflow_client, "coverage")[0]
    # a newer coverage run of the same version that never reached the model's page (e.g. logged by hand)
    experiment = measured.info.experiment_id
    stray = mlflow_client.create_run(experiment, tags={"mlflow_di.command": "coverage", "mlflow_di.model_name": "cnn",
                                                       "mlflow_di.model_version": "1"})
    mlflow_client.log_metric(stray.info.run_id, "idc", 0.01)
    mlflow_client.set_terminated(stray.info.run_id, "FINISHED")
    idc = next(m for m in gate_evidence.measurements(registered_cnn, client=mlflow_client) if m.metric == "idc")
    assert idc.run_id == measured.info.run_id and idc.value == pytest.approx(measured.data.metrics["idc"])
    # without a LoggedModel to read, the newest recorded run counts, as before
    runs = gate_evidence.recorded_runs("coverage", {"mlflow_di.model_name": "cnn", "mlflow_di.model_version": "1"}, "idc",
                                  mlflow_client, model_id=None)
    assert runs[0].info.run_id == stray.info.run_id
