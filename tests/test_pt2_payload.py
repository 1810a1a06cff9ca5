"""A pt2 archive runs no code when mlflow-di opens it. ``torch.export.load`` unpickles some members
unrestricted (a member that fails the weights-only load is retried without it; weights marked
``use_pickle`` and opaque constants are unpickled as they are), so an archive logged the way users log
models, with one member swapped for a pickle whose ``__reduce__`` runs a payload and then returns valid
data, ran that payload in describe, coverage, the pipeline and the service. Each is now refused in one
line (an ERROR verdict where a pipeline judges), and only a model the policy trusts is read unrestricted."""
from __future__ import annotations

import collections
import io
import json
import pathlib
import pickle
import threading
import zipfile

import numpy as np
import pytest
import torch

from mlflow_di.cli import main
from mlflow_di.models import zoo
from mlflow_di.models.weights_only import CodeInArchive, weights_only_loading


class Payload:
    """Unpickles by evaluating ``expression`` after touching ``marker``: the code a hostile member runs."""

    def __init__(self, marker: pathlib.Path, expression: str):
        self.marker, self.expression = marker, expression

    def __reduce__(self):
        return eval, (f"__import__('pathlib').Path({str(self.marker)!r}).touch() or {self.expression}",)


def _torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _sample_inputs(marker):
    """The archive's sample inputs, which torch retries unrestricted when the weights-only load fails."""
    payload = _torch_saved(Payload(marker, "((__import__('torch').zeros(2, 1, 8, 8),), {})"))
    return lambda name, data: payload if name.endswith("data/sample_inputs/model.pt") else data


def _pickled_weight(marker):
    """The first weight marked ``use_pickle``: torch unpickles it unrestricted at once."""
    def change(name, data):
        if name.endswith("model_weights_config.json"):
            config = json.loads(data)
            first = next(iter(config["config"].values()))
            first["use_pickle"] = True
            _pickled_weight.path = first["path_name"]
            return json.dumps(config).encode()
        if name.endswith(f"data/weights/{getattr(_pickled_weight, 'path', '?')}"):
            return _torch_saved(Payload(marker, "__import__('torch').nn.Parameter(__import__('torch').zeros(1))"))
        return data
    return change


def _opaque_constant(marker):
    """An opaque constant: torch reads it with plain ``pickle.loads``."""
    from torch.export.pt2_archive.constants import OPAQUE_OBJ_FILENAME_PREFIX

    def change(name, data):
        if name.endswith("model_constants_config.json"):
            return json.dumps({"config": {"hidden": {"path_name": f"{OPAQUE_OBJ_FILENAME_PREFIX}0", "is_param": False,
                                                     "use_pickle": True, "tensor_meta": None}}}).encode()
        return data
    change.extra = (f"data/constants/{OPAQUE_OBJ_FILENAME_PREFIX}0", pickle.dumps(Payload(marker, "0")))
    return change


HOSTILE = {"sample-inputs": _sample_inputs, "pickled-weight": _pickled_weight, "opaque-constant": _opaque_constant}


def _rewrite(archive: pathlib.Path, change) -> None:
    """Rewrite the zip ``archive`` in place, each member through ``change(name, data)`` (weights config first)."""
    with zipfile.ZipFile(archive) as source:
        members = sorted(source.infolist(), key=lambda info: not info.filename.endswith("_config.json"))
        contents = [(info, change(info.filename, source.read(info.filename))) for info in members]
    root = contents[0][0].filename.split("/", 1)[0]
    with zipfile.ZipFile(archive, "w") as target:
        for info, data in contents:
            target.writestr(info, data)
        if hasattr(change, "extra"):
            target.writestr(f"{root}/{change.extra[0]}", change.extra[1])


@pytest.fixture(scope="module")
def logged_pt2(tmp_path_factory):
    """A model folder as ``mlflow.pytorch.log_model`` writes it with MLflow's defaults (pt2, an input example),
    made once (exporting is the slow part)."""
    import mlflow

    folder = tmp_path_factory.mktemp("pt2") / "model"
    example = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    mlflow.pytorch.save_model(zoo.build("digits-cnn", seed=0), str(folder), input_example=example)
    return folder


@pytest.fixture()
def hostile_version(logged_pt2, mlflow_client, tmp_path, request):
    """``models:/cnn/1``: that model with one archive member swapped for a payload (which one: the test's
    parameter), registered from its folder; returns (uri, marker)."""
    import shutil

    marker = tmp_path / "payload-ran"
    folder = tmp_path / "hostile-model"
    shutil.copytree(logged_pt2, folder)
    _rewrite(next(folder.rglob("model.pt2")), HOSTILE[request.param](marker))
    mlflow_client.create_registered_model("cnn")
    mlflow_client.create_model_version("cnn", str(folder))
    return "models:/cnn/1", marker


@pytest.mark.parametrize("hostile_version", sorted(HOSTILE), indirect=True)
def test_describe_and_coverage_refuse_a_pt2_whose_members_would_run_code(hostile_version, capsys):
    uri, marker = hostile_version
    for argv in (["describe", uri], ["coverage", "--model-uri", uri, "--train-data", "digits[0:40]",
                                     "--test-data", "digits[40:60]", "--criteria", "nc"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert err[0].startswith(f"mlflow-di: error: '{uri}' is a pt2 archive that holds more than weights (a pickle "
                                 "that imports ") and "MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true" in err[0]
        assert not marker.exists(), f"{argv[0]} ran the payload"


POLICY = """
{trust}
coverage: {{train_data: "digits[0:60]", test_data: ["digits[60:90]"], criteria: [idc]}}
gate: {{thresholds: {{min_idc: 0}}}}
"""


@pytest.mark.parametrize("hostile_version", ["sample-inputs"], indirect=True)
def test_a_pipeline_gives_an_error_verdict_unless_its_policy_trusts_the_model(hostile_version, mlflow_client, tmp_path,
                                                                           capsys, monkeypatch):
    uri, marker = hostile_version
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # a person's switch: a policy decides alone
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(trust=""))
    assert main(["pipeline", "--policy", str(policy), "--model-uri", uri, "--state-dir", str(tmp_path / "s1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a pt2 archive that holds more than weights" in err[0], err
    assert "add 'cnn' to trust.pickled_models if you trust its authors" in err[0]
    assert not marker.exists()
    version = mlflow_client.get_model_version("cnn", "1")
    assert version.tags["mlflow_di.verdict"] == "ERROR" and "holds more than weights" in version.description

    policy.write_text(POLICY.format(trust="trust: {pickled_models: [cnn]}"))
    assert main(["pipeline", "--policy", str(policy), "--model-uri", uri, "--state-dir", str(tmp_path / "s2")]) == 0
    assert marker.exists()  # trusted: read as torch reads it (the sample inputs are data, the model is the same)


@pytest.mark.parametrize("hostile_version", ["pickled-weight"], indirect=True)
def test_the_service_runs_the_pipeline_that_refuses_it(hostile_version, tracking_uri, tmp_path):
    """The service's own command line and environment for a job: the payload never runs, the job ends in error."""
    from mlflow_di.commands.serve import Service
    from mlflow_di.service.queue import JobQueue
    from mlflow_di.service.worker import Runner

    uri, marker = hostile_version
    service = Service(tmp_path / "service", "unused", (), 1, 1, 0.0, None, 0.0, False)
    service.state.mkdir()
    service.policy = tmp_path / "policy.yaml"
    service.policy.write_text(POLICY.format(trust=""))
    service.tracking_uri = tracking_uri
    queue = JobQueue(service.state / "jobs.sqlite")
    try:
        queue.enqueue("cnn", "1")
        runner = Runner(queue, service._argv, service._log_path, 1, 0.0, threading.Event(), lambda job, text: None,
                        env={**service._child_env(), "MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "true"})
        job = runner.run(queue.claim())
    finally:
        queue.close()
    assert job.state == "error" and "holds more than weights" in job.message, job.message
    assert not marker.exists()


def test_a_plain_archive_loads_and_other_threads_are_not_restricted(tmp_path):
    """What log_model writes reads the same inside the guard; the guard binds only its own thread."""
    module = zoo.build("digits-cnn", seed=0).eval()
    program = torch.export.export(module, (torch.zeros(2, 1, 8, 8),))
    torch.export.save(program, tmp_path / "m.pt2")
    with weights_only_loading():
        loaded = torch.export.load(tmp_path / "m.pt2")
    probe = torch.rand(2, 1, 8, 8)
    np.testing.assert_array_equal(loaded.module()(probe).detach().numpy(), module(probe).detach().numpy())

    pickled = pickle.dumps(collections.OrderedDict(a=1))  # a global lookup, as any unrestricted pickle makes
    other: list = []
    with pytest.raises(CodeInArchive, match="imports collections.OrderedDict"):  # remembered though caught inside
        with weights_only_loading():
            with pytest.raises(CodeInArchive, match="imports collections.OrderedDict"):
                pickle.loads(pickled)
            thread = threading.Thread(target=lambda: other.append(pickle.loads(pickled)))
            thread.start()
            thread.join()
    assert other == [{"a": 1}] and pickle.loads(pickled) == {"a": 1}
