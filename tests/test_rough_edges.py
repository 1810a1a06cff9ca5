"""The rough edges a new user hit: runs left RUNNING, signals, dead servers, lost results, noise."""
import os
import json
import pathlib
import signal
import subprocess
import sys
import time

import mlflow
import pytest

from mlflow_di.cli import main

CLI = [sys.executable, "-m", "mlflow_di.cli"]
#: a campaign long enough to be stopped while it runs (it is signalled as soon as its first records are on disk),
#: and short enough that resuming the rest is cheap: 100 seeds (13 batches of 8), 400 queries each at most
FUZZ = ["fuzz", "--original", "ORIG", "--compressed", "COMP", "--seed-data", "digits[0:100]", "--num-seeds", "100",
        "--timeout", "60", "--batch", "8", "--max-queries", "400"]


def _runs(uri: str):
    client = mlflow.MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids) if ids else []


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    """A digits CNN and a copy with perturbed weights (so fuzzing takes a while), as .pt files."""
    import torch

    from mlflow_di.models import zoo

    folder = tmp_path_factory.mktemp("pair")
    preprocessing = zoo.architecture("digits-cnn").preprocessing.to_dict()
    paths = []
    for name, noise in (("orig", 0.0), ("comp", 0.02)):
        module = zoo.build("digits-cnn", seed=0).eval()
        with torch.no_grad():
            for p in module.parameters():
                p.add_(noise * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        path = folder / f"{name}.pt"
        torch.save({"module": module, "mlflow_di": {"preprocessing": preprocessing}}, path)
        paths.append(str(path))
    return paths


def _fuzz_args(model_pair, out_dir, *extra):
    args = [a.replace("ORIG", model_pair[0]).replace("COMP", model_pair[1]) for a in FUZZ]
    return [*args, "--out-dir", str(out_dir), *extra]


def _start_fuzz(model_pair, tmp_path, *extra):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    process = subprocess.Popen([*CLI, *_fuzz_args(model_pair, tmp_path / "campaign", *extra)], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:  # wait until the run exists and the first seeds are on disk
        if (tmp_path / "campaign" / "records.jsonl").exists():
            break
        time.sleep(0.2)
    return process


def test_sigterm_ends_the_run_killed_with_exit_143_and_the_campaign_resumes(model_pair, tmp_path):
    process = _start_fuzz(model_pair, tmp_path)
    process.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-2000:]
    assert time.monotonic() - stopped < 10, "a stop request must end the command within 10 s"
    assert "Traceback" not in stderr
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    [run] = _runs(uri)
    assert run.info.status == "KILLED"
    assert "fuzz/campaign" in {a.path for a in mlflow.MlflowClient(uri).list_artifacts(run.info.run_id, "fuzz")}
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    resumed = subprocess.run([*CLI, *_fuzz_args(model_pair, tmp_path / "campaign", "--resume")],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(r.info.status for r in _runs(uri)) == ["FINISHED", "KILLED"]


def test_resume_after_kill_9_closes_the_orphaned_run(model_pair, tmp_path):
    process = _start_fuzz(model_pair, tmp_path)
    process.kill()  # SIGKILL: no handler runs, the run stays RUNNING
    process.communicate(timeout=60)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert [r.info.status for r in _runs(uri)] == ["RUNNING"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    resumed = subprocess.run([*CLI, *_fuzz_args(model_pair, tmp_path / "campaign", "--resume")],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "left RUNNING by a killed process" in resumed.stdout
    runs = {r.info.status: r for r in _runs(uri)}
    assert sorted(runs) == ["FINISHED", "KILLED"]
    assert runs["KILLED"].data.tags["mlflow_di.closed_by"].startswith("a later --resume")


def test_a_command_failing_inside_mlflow_run_never_leaves_that_run_running(tracking_uri, monkeypatch, capsys):
    """`mlflow run -e import_keras` without its weights file: the run mlflow run created ends FAILED."""
    run = mlflow.MlflowClient().create_run(mlflow.MlflowClient().create_experiment("project"))
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    code = main(["import-keras", "--arch", "lenet5", "--weights", "missing.h5", "--register-as", "x"])
    assert code == 2 and "missing.h5" in capsys.readouterr().err
    assert mlflow.MlflowClient().get_run(run.info.run_id).info.status == "FAILED"


def test_unreachable_tracking_server_fails_fast_in_one_line(tmp_path):
    started = time.perf_counter()
    result = subprocess.run([*CLI, "--tracking-uri", "http://127.0.0.1:9", "gate", "--model-uri", "models:/m/1",
                             "--min-idc", "0.5"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("mlflow-di: error: the tracking server http://127.0.0.1:9 does not answer")
    assert "curl http://127.0.0.1:9/health" in line
    assert seconds < 15


def test_results_are_kept_locally_when_the_server_goes_away_mid_run(tracking_uri, monkeypatch, capsys):
    from mlflow.exceptions import MlflowException

    from mlflow_di.mlflow_edge import runs

    from mlflow_di.errors import UserError

    with pytest.raises(UserError) as failed:  # never FINISHED with results missing from the store
        with runs.tracked_run("server goes away") as log:
            log.metrics({"before": 1.0})
            monkeypatch.setattr(mlflow, "log_dict", lambda *a, **k: (_ for _ in ()).throw(
                MlflowException("API request failed: connection refused")))
            log.json({"idc": 0.5}, "coverage/summary.json")
            log.metrics({"after": 2.0})  # once the store failed, everything goes to the local folder
    kept = pathlib.Path("mlflow-di-unlogged") / log.run_id
    assert (kept / "coverage" / "summary.json").read_text().count("0.5") == 1
    assert "after" in (kept / "metrics.json").read_text()
    line = str(failed.value)
    assert f"mlflow artifacts log-artifacts --local-dir {kept} --run-id {log.run_id}" in line
    assert "(API request failed: connection refused)" in line and f"run {log.run_id} ended FAILED" in line
    assert mlflow.get_run(log.run_id).data.metrics == {"before": 1.0}
    assert mlflow.get_run(log.run_id).info.status == "FAILED"


def test_usage_errors_are_one_line(capsys):
    assert main(["coverage", "--model-uri"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["no-such-command"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mlflow-di: error: No such command 'no-such-command'")


def test_runs_land_in_a_classic_ml_experiment_named_for_what_they_compared(tracking_uri, model_pair, capsys):
    assert main(_fuzz_args(model_pair, "campaign", "--num-seeds", "3")) == 0
    experiment = mlflow.MlflowClient().get_experiment_by_name("mlflow-di")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    [run] = _runs(tracking_uri)
    assert run.info.run_name == "fuzz orig.pt vs comp.pt"
    out = capsys.readouterr().out
    assert "fuzzing 3 seeds" in out


def test_printed_links_use_the_ui_address_given_not_a_hard_coded_port(tracking_uri, model_pair, monkeypatch, capsys):
    """A local store has no UI address: the closing line says where `mlflow ui` listens by default and
    how to name another; with $MLFLOW_DI_UI_URL every link is under that address."""
    assert main(_fuzz_args(model_pair, "one", "--num-seeds", "2")) == 0
    out = capsys.readouterr().out
    assert "http://127.0.0.1:5000/#/experiments/" in out and "set MLFLOW_DI_UI_URL" in out
    monkeypatch.setenv("MLFLOW_DI_UI_URL", "https://mlflow.example.org:8443/")
    assert main(_fuzz_args(model_pair, "two", "--num-seeds", "2")) == 0
    out = capsys.readouterr().out
    [run] = [r for r in _runs(tracking_uri) if r.data.params.get("out_dir", "").endswith("two")]
    assert f"https://mlflow.example.org:8443/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}" in out
    assert "127.0.0.1:5000" not in out


def test_litert_says_nothing_on_stderr(shared_dir, tmp_path):
    pytest.importorskip("ai_edge_litert")
    result = subprocess.run([*CLI, "describe", str(shared_dir / "models" / "dflare" / "lenet5-quan.lite")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and "backend:        tflite" in result.stdout


def test_a_run_the_store_could_not_end_is_ended_by_the_next_command(tracking_uri, monkeypatch, capsys):
    from mlflow.exceptions import MlflowException

    from mlflow_di.errors import UserError
    from mlflow_di.mlflow_edge import runs

    def store_gone(*args, **kwargs):  # the server is away: nothing reaches it
        raise MlflowException("API request failed: connection refused")

    with pytest.raises(UserError, match="could not be ended either .*`mlflow-di close-runs`"), \
            monkeypatch.context() as away:
        with runs.tracked_run("server dies") as log:
            away.setattr(mlflow, "log_metrics", lambda *a, **k: (_ for _ in ()).throw(
                MlflowException("API request failed: connection refused")))
            away.setattr(mlflow, "end_run", store_gone)
            log.metrics({"idc": 0.5})
    mlflow.end_run()  # clears this process's run stack; then the store is put back as the dead server left it
    mlflow.MlflowClient().update_run(log.run_id, status="RUNNING")
    note = pathlib.Path("mlflow-di-unlogged") / log.run_id / "end.json"
    assert json.loads(note.read_text())["status"] == "FAILED"
    capsys.readouterr()
    assert main(["close-runs"]) == 0  # the command the error line names (any later command does it too)
    assert mlflow.get_run(log.run_id).info.status == "FAILED" and not note.exists()
    assert f"ended run {log.run_id}" in capsys.readouterr().out
