"""The gate and the evaluator plugin against real ``mlflow server`` processes on 127.0.0.1:
a plain one (shared with test_browser.py) and one with MLflow's basic-auth app and permissions."""
import uuid

import numpy as np
import pandas as pd
import pytest

import mlflow_di  # noqa: F401  (torchvision guard)

from mlflow_server import (  # noqa: F401  (fixtures)
    PASSING, mlflow_server, record_history, run_gate, start_server, use_server)

pytestmark = pytest.mark.slow  # each server takes ~15-25 s to start

def unique(prefix: str) -> str:
    """Registered model names differ per test: the plain server is shared by the whole session."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_gate_pass_promotes_and_fail_leaves_the_alias(mlflow_server, use_server, capsys):
    client = use_server(mlflow_server)
    name = unique("lenet")
    history = record_history(client, client.create_experiment(unique("recorded")), name)
    client.set_registered_model_alias(name, "champion", "2")

    code, out, err = run_gate(capsys, "--model-uri", history.uri, "--max-success-rate", "0.5", "--promote-alias", "champion")
    assert code == 1, out + err
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"
    assert client.get_model_version(name, "1").tags["mlflow_di.verdict"] == "FAIL"

    code, out, err = run_gate(capsys, "--model-uri", history.uri, *PASSING, "--promote-alias", "champion")
    assert code == 0, out + err
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    tags = client.get_model_version(name, "1").tags
    assert (tags["mlflow_di.verdict"], tags["mlflow_di.idc"], tags["mlflow_di.success_rate"]) == ("PASS", "0.62", "0.8")
    gate_run = client.get_run(tags["mlflow_di.gate_run_id"])
    assert gate_run.data.tags["mlflow_di.command"] == "gate" and gate_run.data.metrics["passed"] == 1.0
    verdict = client.download_artifacts(gate_run.info.run_id, "gate/verdict.json")  # through the artifact proxy
    assert '"passed": true' in open(verdict).read()


def test_evaluator_logs_idc_once_on_a_server(mlflow_server, use_server, monkeypatch):
    import mlflow
    import torch

    from mlflow_di.mlflow_edge import models as edge_models
    from mlflow_di.data import load_images
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel
    from mlflow_di.models.training import train_classifier

    use_server(mlflow_server)
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    train, test = load_images("digits[0:600]"), load_images("digits[1000:1300]")
    model = TorchModel(zoo.build("digits-cnn", seed=1), zoo.architecture("digits-cnn").preprocessing, name="digits-cnn")
    train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels), epochs=10,
                     seed=1, progress=False)
    mlflow.set_experiment(unique("evaluate"))
    name = unique("digits")
    with mlflow.start_run():
        edge_models.log_torch_model(model, registered_model_name=name)
    rows = pd.DataFrame(test.images.reshape(len(test), -1).astype(np.int64))
    rows.columns = [f"p{i}" for i in range(64)]
    rows["label"] = test.labels
    with mlflow.start_run() as run:
        result = mlflow.models.evaluate(
            f"models:/{name}/1", rows, targets="label", model_type="classifier", evaluators=["mlflow_di"],
            evaluator_config={"mlflow_di": {"input_shape": (8, 8, 1), "top_m": 4, "clusters": (2, 3)}})
    from mlflow import MlflowClient

    client = MlflowClient()
    history = client.get_metric_history(run.info.run_id, "mlflow_di/idc")
    assert [m.value for m in history] == [pytest.approx(result.metrics["mlflow_di/idc"])]
    assert 0 < result.metrics["mlflow_di/idc"] <= 1
    assert "mlflow_di/coverage_model.json" in [f.path for f in client.list_artifacts(run.info.run_id, "mlflow_di")]


# ------------------------------------------------------------------------------ basic auth
@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("mlflow-auth-server"), basic_auth=True)
    yield server
    server.stop()


def test_gate_needs_edit_permission_on_the_registered_model(auth_server, use_server, capsys):
    from mlflow.server.auth.client import AuthServiceClient

    admin = use_server(auth_server, *auth_server.admin)
    users = AuthServiceClient(auth_server.url)
    passwords = {user: uuid.uuid4().hex for user in ("reader", "editor")}
    for user, password in passwords.items():
        users.create_user(user, password)
    history = record_history(admin, admin.create_experiment("recorded"), "guarded")
    gate_experiment = admin.create_experiment("mlflow-di")  # where the gate logs its own run
    for user in passwords:
        users.grant_user_permission(user, "experiment", gate_experiment, "EDIT")
    users.grant_user_permission("reader", "registered_model", "guarded", "READ")
    users.grant_user_permission("editor", "registered_model", "guarded", "EDIT")

    use_server(auth_server, "reader", passwords["reader"])
    capsys.readouterr()  # drop MLflow's set-up logging
    code, out, err = run_gate(capsys, "--model-uri", history.uri, *PASSING, "--promote-alias", "champion")
    assert code == 2, out + err
    assert err.strip() == ("mlflow-di: error: user reader may not write tags on models:/guarded/1 "
                           "(needs EDIT permission on the registered model)")
    assert "mlflow_di.verdict" not in admin.get_model_version("guarded", "1").tags
    assert admin.get_registered_model("guarded").aliases == {}

    editor = use_server(auth_server, "editor", passwords["editor"])
    code, out, err = run_gate(capsys, "--model-uri", history.uri, *PASSING, "--promote-alias", "champion")
    assert code == 0, out + err
    assert editor.get_model_version("guarded", "1").tags["mlflow_di.verdict"] == "PASS"
    assert str(editor.get_model_version_by_alias("guarded", "champion").version) == "1"

    # a failing verdict must take champion off the version; removing an alias asks MANAGE, which the editor lacks:
    # the version then says ERROR and why (tag and description), never FAIL beside the alias of a PASS
    code, out, err = run_gate(capsys, "--model-uri", history.uri, "--max-success-rate", "0.5", "--promote-alias",
                              "champion")
    assert code == 2 and err.strip() == ("mlflow-di: error: user editor may not remove the alias 'champion' from "
                                         "models:/guarded/1 (needs MANAGE permission on the registered model)"), out + err
    seen = admin.get_model_version("guarded", "1")
    assert seen.tags["mlflow_di.verdict"] == "ERROR" and "MANAGE" in seen.tags["mlflow_di.verdict_reason"]
    assert seen.description.startswith("## mlflow-di gate: ERROR")
    assert str(admin.get_model_version_by_alias("guarded", "champion").version) == "1"
