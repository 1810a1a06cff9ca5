"""The pipeline on Ray: a policy's ``ray`` section (or ``pipeline --workers``) spreads the fuzz and coverage
steps over Ray workers, and the verdict and the campaign's records are those of the same pipeline without Ray."""
import json
import pathlib
import sys

import pytest
import yaml

from mlflow_di.cli import main
from mlflow_di.errors import UserError
from mlflow_di.policy import parse_policy
from tests.test_pipeline import TINY

GATE = "gate: {thresholds: {min_idc: 0}}\n"


def test_the_ray_section_is_checked_and_round_trips():
    policy = parse_policy(GATE + "ray: {workers: 2, address: auto, cpus_per_worker: 0.5, trace_dir: /shared/t}\n",
                          "p.yaml")
    assert policy.ray.arguments("fuzz") == {"workers": 2, "ray_address": "auto", "cpus_per_worker": 0.5}
    assert policy.ray.arguments("coverage") == {**policy.ray.arguments("fuzz"), "trace_dir": "/shared/t"}
    assert parse_policy(yaml.safe_dump(policy.to_dict()), "p.yaml").ray == policy.ray
    assert parse_policy(GATE, "p.yaml").ray.arguments("coverage") == {}  # no workers: all in the pipeline's process
    for text, fragment in (("ray: {workers: 2, address: 'not an address'}", "p.yaml: ray.address: bad Ray address"),
                           ("ray: {workers: -1}", "p.yaml: ray.workers must be 0 (no Ray) or more, got -1"),
                           ("ray: {nodes: 3}", "p.yaml: unknown key ray.nodes")):
        with pytest.raises(UserError) as caught:
            parse_policy(GATE + text + "\n", "p.yaml")
        assert str(caught.value).startswith(fragment), str(caught.value)


@pytest.fixture()
def ray(ray_cluster):
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_cluster


@pytest.mark.slow
def test_a_pipeline_on_ray_workers_gives_the_verdict_and_records_of_one_without(ray, registered_cnn, tmp_path,
                                                                                 capsys):
    from mlflow_di.fuzz import load_campaign
    from mlflow_di.fuzz.results import comparable_records

    policy = tmp_path / "tiny.yaml"
    assert "criteria: [idc]}" in TINY  # five resamples behind IDC's interval: what is compared is where steps run
    policy.write_text(TINY.replace("criteria: [idc]}", "criteria: [idc], idc_resamples: 5}")
                      + "ray: {workers: 2, cpus_per_worker: 0.5}\n")
    local = ["pipeline", "--policy", str(policy), "--model-uri", registered_cnn, "--state-dir", str(tmp_path / "local"),
             "--workers", "0"]  # the command line's --workers wins over the policy's
    spread = ["pipeline", "--policy", str(policy), "--model-uri", registered_cnn, "--state-dir", str(tmp_path / "ray")]
    codes = [main(local), main(spread)]
    out = capsys.readouterr().out
    assert codes[0] == codes[1] and codes[0] in (0, 1)
    assert "on 2 Ray workers" in out  # the coverage and fuzz steps said where they ran
    states = [json.loads((tmp_path / name / "state.json").read_text()) for name in ("local", "ray")]
    assert states[0]["done"]["gate"]["outcome"] == states[1]["done"]["gate"]["outcome"]
    campaigns = [load_campaign(state["done"]["fuzz"]["campaign"]) for state in states]
    assert comparable_records(campaigns[0]) == comparable_records(campaigns[1]) and campaigns[1].complete

    # the MLproject's pipeline entry point, -P workers=2 (its own local Ray cluster, in mlflow run's process)
    import mlflow

    from tests.test_mlproject import mlflow_run

    store = pathlib.Path(mlflow.get_tracking_uri().removeprefix("sqlite:///")).parent
    plain = tmp_path / "plain.yaml"
    plain.write_text(policy.read_text().split("ray:")[0])  # no ray section: the parameter alone spreads the steps
    done = mlflow_run("pipeline", store, policy=plain, model_uri=registered_cnn, workers=2,
                      state_dir=tmp_path / "mlflow-run")
    assert done.returncode == codes[0], done.stderr[-3000:]
    assert "on 2 Ray workers" in done.stdout
    state = json.loads((tmp_path / "mlflow-run" / "state.json").read_text())
    assert state["done"]["gate"]["outcome"] == states[0]["done"]["gate"]["outcome"]
    assert comparable_records(load_campaign(state["done"]["fuzz"]["campaign"])) == comparable_records(campaigns[0])
