"""One writer per registry version. Two gates started together on one version used to interleave their
writes (in 1 of 3 rounds: verdict FAIL with the PASS gate's run, thresholds and heading, and the alias
removed); two pipelines on one version both ran and both exported. Now a gate waits for the version's lock
and a second pipeline refuses, naming the first; the lock is a registered model, so it holds across
machines, and a lock whose holder died is taken over."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from mlflow_di.cli import main
from mlflow_di.errors import UserError
from mlflow_di.mlflow_edge import version_lock as locks
from mlflow_server import record_run, register_version

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _gate(tracking_uri: str, min_idc: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlflow_di.cli", "--tracking-uri", tracking_uri, "gate", "--model-uri",
                             "models:/judged/1", "--min-idc", min_idc, "--promote-alias", "champion"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _assert_one_gates_record(client) -> None:
    """The version's verdict, gate run, thresholds, description and alias all come from one gate."""
    found = client.get_model_version("judged", "1")
    verdict, run_id = found.tags["mlflow_di.verdict"], found.tags["mlflow_di.gate_run_id"]
    gate_run = client.get_run(run_id)  # the run the version names wrote the verdict the version carries
    assert gate_run.data.tags["mlflow_di.verdict"] == verdict
    threshold = json.loads(found.tags["mlflow_di.gate_thresholds"])["min_idc"]
    assert threshold == {"PASS": 0.1, "FAIL": 0.99}[verdict] == float(gate_run.data.params["min_idc"])
    assert found.description.startswith(f"## mlflow-di gate: {verdict} for `models:/judged/1`")
    assert f"Gate run: [`{run_id[:8]}`]" in found.description or f"`{run_id}`" in found.description
    aliases = client.get_registered_model("judged").aliases
    assert ("champion" in aliases) is (verdict == "PASS")


@pytest.fixture()
def judged(mlflow_client):
    experiment = mlflow_client.create_experiment("locked")
    version = register_version(mlflow_client, "judged")
    record_run(mlflow_client, experiment, "coverage", version, metrics={"idc": 0.5})
    return mlflow_client


def test_two_gates_whose_writes_would_interleave_write_one_record(judged, monkeypatch):
    """Each write of the version's tags pauses, so that two gates without the lock interleave every time."""
    import threading

    from mlflow_di import cli
    from mlflow_di.mlflow_edge import registry

    write = registry.write_version_tags

    def slow_write(*args, **kwargs):
        write(*args, **kwargs)
        time.sleep(0.3)

    monkeypatch.setattr(registry, "write_version_tags", slow_write)
    for _ in range(3):
        codes = {}
        threads = [threading.Thread(target=lambda word=word, idc=idc: codes.setdefault(word, cli._run(
            ["gate", "--model-uri", "models:/judged/1", "--min-idc", idc, "--promote-alias", "champion"])))
            for word, idc in (("PASS", "0.1"), ("FAIL", "0.99"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert codes == {"PASS": 0, "FAIL": 1}
        _assert_one_gates_record(judged)


@pytest.mark.slow
def test_two_gate_processes_with_opposite_thresholds_never_tear_the_record(judged, tracking_uri):
    for _ in range(3):
        gates = {"PASS": _gate(tracking_uri, "0.1"), "FAIL": _gate(tracking_uri, "0.99")}
        codes = {word: gate.wait(300) for word, gate in gates.items()}
        assert codes == {"PASS": 0, "FAIL": 1}, {word: gate.stderr.read()[-2000:] for word, gate in gates.items()}
        _assert_one_gates_record(judged)
    assert not [m.name for m in judged.search_registered_models() if m.name.startswith(locks.PREFIX)]  # none left


def _held_elsewhere(client, name: str, version, heartbeat: float | None = None) -> None:
    """The lock of ``models:/name/version`` as a pipeline in another process on another host holds it."""
    client.create_registered_model(locks.lock_name(name, version), tags={
        "mlflow_di.lock.holder": "elsewhere:4242:1", "mlflow_di.lock.command": "mlflow-di pipeline",
        "mlflow_di.lock.host": "elsewhere", "mlflow_di.lock.pid": "4242", "mlflow_di.lock.since": "2026-11-28T10:00:00",
        "mlflow_di.lock.heartbeat": str(time.time() if heartbeat is None else heartbeat)})


def test_a_second_holder_waits_then_refuses_naming_the_first_and_a_dead_holder_is_taken_over(mlflow_client,
                                                                                            monkeypatch):
    client = mlflow_client
    register_version(client, "busy")
    with locks.version_lock("busy", 1, "pipeline"):
        with locks.version_lock("busy", 1, "gate"):  # re-entrant: a pipeline's own gate
            assert client.get_registered_model(locks.lock_name("busy", 1)).tags["mlflow_di.lock.command"] == \
                "mlflow-di pipeline"
    assert locks.lock_name("busy", 1) not in {m.name for m in client.search_registered_models()}  # released

    _held_elsewhere(client, "busy", 1)
    monkeypatch.setattr(locks, "POLL_S", 0.05)
    started = time.monotonic()
    with pytest.raises(locks.VersionBusy) as busy:
        with locks.version_lock("busy", 1, "gate", wait_s=0.3):
            pass
    assert time.monotonic() - started >= 0.3 and busy.value.exit_code == 75
    assert ("models:/busy/1 is being judged by `mlflow-di pipeline` (process 4242 on elsewhere, since "
            "2026-11-28T10:00:00)") in str(busy.value)
    client.delete_registered_model(locks.lock_name("busy", 1))

    _held_elsewhere(client, "busy", 1, heartbeat=time.time() - 600)  # its holder died ten minutes ago
    with locks.version_lock("busy", 1, "gate"):
        assert client.get_registered_model(locks.lock_name("busy", 1)).tags["mlflow_di.lock.holder"] != \
            "elsewhere:4242:1"


NOW = 1_800_000_000.0


def _record(heartbeat=NOW, since="2027-01-15T08:00:00+0000", host="elsewhere", pid="4242") -> dict:
    return {"mlflow_di.lock.heartbeat": str(heartbeat), "mlflow_di.lock.since": since, "mlflow_di.lock.host": host,
            "mlflow_di.lock.pid": pid}


@pytest.mark.parametrize("tags, host, alive, reason", [
    (_record(), "here", None, None),  # heard of just now, elsewhere: it holds
    (_record(heartbeat=NOW - locks.STALE_S + 1), "here", None, None),
    (_record(heartbeat=NOW - locks.STALE_S - 1), "here", None, "not been heard of for 301 s"),
    (_record(heartbeat=NOW + locks.CLOCK_SKEW_S - 1), "here", None, None),  # a clock a little ahead
    (_record(heartbeat=NOW + 3600), "here", None, "heartbeat is 3600 s in the future"),
    (_record(since="2099-01-01T00:00:00+0000"), "here", None, "started"),
    ({**_record(), "mlflow_di.lock.heartbeat": "soon"}, "here", None, "no heartbeat"),
    ({**_record(), "mlflow_di.lock.heartbeat": "nan"}, "here", None, "no heartbeat"),
    (_record(host="here"), "here", lambda pid: False, "process 4242 on this host, is gone"),
    (_record(host="here"), "here", lambda pid: True, None),
    (_record(host="elsewhere"), "here", lambda pid: False, None),  # another host's pids say nothing here
])
def test_a_lock_record_holds_only_while_its_holder_is_heard_of_and_plausible(tags, host, alive, reason):
    found = locks.stale_reason(tags, NOW, host, alive)
    assert (found is None) if reason is None else (reason in found), found


def test_a_users_model_under_the_locks_name_neither_blocks_a_gate_nor_is_deleted(mlflow_client):
    client = mlflow_client
    register_version(client, "squatted")
    squatter = locks.lock_name("squatted", 1)
    register_version(client, squatter)  # a user's own model, with a version, under the lock's name
    with locks.version_lock("squatted", 1, "gate", wait_s=0):
        held = [m.name for m in client.search_registered_models() if m.name.startswith(squatter)]
        assert sorted(held) == [squatter, f"{squatter}~2"]
    assert client.get_model_version(squatter, "1") is not None  # untouched
    assert f"{squatter}~2" not in {m.name for m in client.search_registered_models()}  # released


def test_a_forged_lock_with_a_heartbeat_in_the_future_does_not_block(mlflow_client, capsys):
    register_version(mlflow_client, "forged")
    _held_elsewhere(mlflow_client, "forged", 1, heartbeat=time.time() + 365 * 86400)
    started = time.monotonic()
    with locks.version_lock("forged", 1, "gate", wait_s=60):
        assert mlflow_client.get_registered_model(locks.lock_name("forged", 1)).tags[locks.HOLDER] != \
            "elsewhere:4242:1"
    assert time.monotonic() - started < 30  # taken over at once, not after the 60 s wait
    err = capsys.readouterr().err
    assert "took over the lock" in err and "heartbeat is" in err and "in the future" in err, err


def test_a_dead_holder_on_this_host_is_taken_over_at_once_and_its_runs_are_marked_killed(mlflow_client):
    import socket

    client = mlflow_client
    register_version(client, "orphaned")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    key = locks.lock_name("orphaned", 1)
    experiment = client.create_experiment("pipelines")
    holder = f"{socket.gethostname()}:{dead.pid}:1"
    pipeline = client.create_run(experiment, tags={"mlflow_di.command": "pipeline", "mlflow_di.lock": f"{key} {holder}"})
    step = client.create_run(experiment, tags={"mlflow.parentRunId": pipeline.info.run_id})
    unrelated = client.create_run(experiment, tags={"mlflow_di.command": "pipeline"})
    client.create_registered_model(key, tags={
        locks.HOLDER: holder, "mlflow_di.lock.command": "mlflow-di pipeline", "mlflow_di.lock.host": socket.gethostname(),
        "mlflow_di.lock.pid": str(dead.pid), "mlflow_di.lock.run_id": pipeline.info.run_id,
        "mlflow_di.lock.since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mlflow_di.lock.heartbeat": str(time.time())})
    started = time.monotonic()
    with locks.version_lock("orphaned", 1, "gate", wait_s=60):
        pass
    assert time.monotonic() - started < 30
    for run in (pipeline, step):
        ended = client.get_run(run.info.run_id)
        assert ended.info.status == "KILLED"
        assert f"process {dead.pid} on {socket.gethostname()}" in ended.data.tags["mlflow_di.killed_reason"]
    assert client.get_run(unrelated.info.run_id).info.status == "RUNNING"  # not the dead holder's


def test_a_forged_record_cannot_end_a_run_that_does_not_carry_its_lock(mlflow_client):
    client = mlflow_client
    register_version(client, "victim")
    experiment = client.create_experiment("others")
    someone = client.create_run(experiment, tags={"mlflow_di.command": "fuzz"})
    client.create_registered_model(locks.lock_name("victim", 1), tags={
        locks.HOLDER: "elsewhere:1:1", "mlflow_di.lock.host": "elsewhere", "mlflow_di.lock.pid": "1",
        "mlflow_di.lock.run_id": someone.info.run_id, "mlflow_di.lock.heartbeat": str(time.time() - 3600)})
    with locks.version_lock("victim", 1, "gate"):
        pass
    assert client.get_run(someone.info.run_id).info.status == "RUNNING"


def test_a_pipeline_names_its_run_on_its_lock_and_its_gate_does_not_replace_it(registered_cnn, mlflow_client, tmp_path,
                                                                             monkeypatch):
    seen = []
    record = locks.record_holder_run

    def spy(run_id):
        record(run_id)
        key = next(iter(locks._held.get()))
        seen.append((run_id, mlflow_client.get_registered_model(key).tags["mlflow_di.lock.run_id"],
                     mlflow_client.get_run(run_id).data.tags.get("mlflow_di.lock", "")))

    monkeypatch.setattr(locks, "record_holder_run", spy)
    policy = tmp_path / "p.yaml"
    policy.write_text("coverage: {train_data: 'digits[0:60]', test_data: ['digits[60:90]'], criteria: [idc]}\n"
                      "gate: {thresholds: {min_idc: 0}}\n")
    assert main(["pipeline", "--policy", str(policy), "--model-uri", registered_cnn, "--state-dir",
                 str(tmp_path / "state")]) == 0
    (pipeline_run, on_lock, run_tag), (gate_run, on_lock_later, gate_tag) = seen
    assert on_lock == on_lock_later == pipeline_run != gate_run
    assert run_tag.startswith(locks.lock_name("cnn", 1)) and gate_tag == ""


def test_a_pipeline_on_a_version_another_pipeline_works_on_refuses_without_writing(registered_cnn, mlflow_client,
                                                                                  tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_text("coverage: {train_data: 'digits[0:60]', test_data: ['digits[60:90]'], criteria: [idc]}\n"
                      "gate: {thresholds: {min_idc: 0}}\n")
    _held_elsewhere(mlflow_client, "cnn", 1)
    code = main(["pipeline", "--policy", str(policy), "--model-uri", registered_cnn, "--state-dir",
                 str(tmp_path / "state")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 75 and len(err) == 1 and "is being judged by `mlflow-di pipeline`" in err[0], err
    version = mlflow_client.get_model_version("cnn", "1")
    assert "mlflow_di.verdict" not in version.tags and not (tmp_path / "state" / "state.json").exists()


def test_a_name_that_holds_the_descriptions_end_marker_does_not_keep_old_verdicts(mlflow_client):
    from mlflow_di.mlflow_edge import registry

    version = register_version(mlflow_client, "marked")
    name_like = f"models:/x{registry.DESCRIPTION_END}/1"
    for round_ in range(3):
        registry.write_verdict_description(version, f"## mlflow-di gate: PASS for `{name_like}` round {round_}")
    description = mlflow_client.get_model_version("marked", "1").description
    assert description.count("## mlflow-di gate") == 1 and "round 2" in description


def test_the_busy_exit_code_is_one_the_service_retries():
    from mlflow_di.service.queue import outcome

    assert outcome(75) == "retry" and issubclass(locks.VersionBusy, UserError)
