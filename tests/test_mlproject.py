"""Every MLproject entry point runs through `mlflow run . -e NAME --env-manager local`, as the
README shows, and records its results in the run that `mlflow run` created."""
import json
import os
import pathlib
import subprocess
import sys

import mlflow
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def mlflow_run(entry: str, store: pathlib.Path, **params) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mlflow", "run", str(REPO), "-e", entry, "--env-manager", "local"]
    for key, value in params.items():
        command += ["-P", f"{key}={value}"]
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{store / 'mlflow.db'}",
               PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(command, capture_output=True, text=True, cwd=store, env=env, timeout=900)


def finished_commands(store: pathlib.Path) -> list[str]:
    client = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return sorted(run.data.tags.get("mlflow_di.command", "?") for run in runs if run.info.status == "FINISHED")


def test_each_entry_point_runs_with_mlflow_run(tmp_path):
    steps = [
        ("demo", dict(epochs=10, fuzz_seeds=5)),
        ("coverage", dict(model_uri="models:/digits-cnn/1", top_m=4, idc_resamples=5)),  # the interval is not read
        ("inspect", dict(model_uri="models:/digits-cnn/1", data="digits[0:600]", measures="pearson,probe")),
        ("compress", dict(model_uri="models:/digits-cnn/1", method="int8-dynamic")),
        ("fuzz", dict(original="models:/digits-cnn/1", compressed="models:/digits-cnn-int8-dynamic/1",
                      num_seeds=10, timeout=5, out_dir=tmp_path / "campaign")),
        ("fuzz_realistic", dict(original="models:/digits-cnn/1", compressed="models:/digits-cnn-int8-dynamic/1",
                                num_seeds=5, max_queries=100, out_dir=tmp_path / "walk")),
        ("robustness", dict(model_uri="models:/digits-cnn/1", compressed="models:/digits-cnn-int8-dynamic/1",
                            data="digits[1300:1400]", corruptions="jpeg,occlusion", severities="1,5")),
        # the boundary walk above finds realistic deviations on most seeds, and the gate reads the newest
        ("gate", dict(model_uri="models:/digits-cnn/1", min_idc=0, max_accuracy_drop=1, min_mean_queries=0,
                      max_realistic_success_rate=1, realism_budget="linf=32")),  # fuzz_realistic's budget
        # last: it registers another int8-static version, which the gate above would want fuzzed
        ("compress_bounded", dict(model_uri="models:/digits-cnn/1", max_disagreement_rate=0.02)),
    ]
    for entry, params in steps:
        result = mlflow_run(entry, tmp_path, **params)
        assert result.returncode == 0, f"{entry}: {result.stderr[-2000:]}"
        if entry == "demo":
            check_the_demo(tmp_path, result)
    # the demo's own five runs, then one run per entry point (demo's runs included once each)
    assert finished_commands(tmp_path).count("coverage") == 2
    assert finished_commands(tmp_path).count("gate") == 2
    assert finished_commands(tmp_path).count("inspect") == 1
    assert finished_commands(tmp_path).count("robustness") == 1
    walk = json.loads((tmp_path / "walk" / "campaign.json").read_text())
    assert walk["strategy"] == "boundary" and walk["strategy_options"]["constraint"]["max_linf"] == 32
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    bounded = [run for run in client.search_runs([e.experiment_id for e in client.search_experiments()],
                                                 "params.max_disagreement_rate = '0.02' and "
                                                 "tags.`mlflow_di.command` = 'compress'")
               if run.info.status == "FINISHED"]
    assert len(bounded) == 1 and bounded[0].data.metrics["bounded.exports"] >= 1
    assert bounded[0].data.metrics["bounded.held_out_images"] == 247  # digits[1550:]
    assert client.get_model_version_by_alias("digits-cnn", "champion").version == 1


def check_the_demo(store: pathlib.Path, result: subprocess.CompletedProcess) -> None:
    """What the one-command demo leaves (``make demo`` is walked by test_readme_walk.py): quiet off a
    terminal, the CNN and its exports registered with lineage, the verdict on the version, the alias
    only on PASS, and one FINISHED run per step."""
    # quiet off a terminal: no MLflow registration chatter, no carriage-return progress redraws
    assert "Successfully registered" not in result.stderr and "\r" not in result.stderr, result.stderr[-2000:]
    assert "registered models:/digits-cnn/1" in result.stdout
    client = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    version = client.get_model_version("digits-cnn", "1")
    assert client.get_run(version.run_id).data.metrics["test_accuracy"] > 0.8
    for method in ("int8-static", "prune-l1"):  # exports registered with lineage back to the source
        export = client.get_model_version(f"digits-cnn-{method}", "1")
        assert export.tags["mlflow_di.source_uri"] == "models:/digits-cnn/1"
        assert export.tags["mlflow_di.method"] == method
    verdict = version.tags["mlflow_di.verdict"]
    assert verdict in ("PASS", "FAIL", "INCONCLUSIVE") and float(version.tags["mlflow_di.idc"]) > 0
    assert "missing" not in version.tags.values() and version.description.startswith(f"## mlflow-di gate: {verdict}")
    assert ("champion" in client.get_registered_model("digits-cnn").aliases) == (verdict == "PASS")
    assert set(finished_commands(store)) == {"demo", "compress", "coverage", "fuzz", "gate"}


def test_import_keras_entry_point(tmp_path, shared_dir):
    weights = shared_dir / "models" / "deepimportance" / "LeNet1.h5"
    result = mlflow_run("import_keras", tmp_path, arch="lenet1", weights=weights, register_as="lenet1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert finished_commands(tmp_path) == ["import-keras"]


def test_the_gate_entry_point_defaults_are_the_demo_policy():
    """`mlflow run . -e gate` right after `make demo` judges the version as the demo's pipeline did."""
    import yaml

    from mlflow_di.policy import load_policy

    entry = yaml.safe_load((REPO / "MLproject").read_text())["entry_points"]["gate"]["parameters"]
    defaults = {name: spec["default"] for name, spec in entry.items() if "default" in spec}
    policy = load_policy(REPO / "examples" / "policies" / "demo.yaml")
    thresholds = {name: value for name, value in policy.to_dict()["gate"]["thresholds"].items() if value is not None}
    assert {name: float(value) for name, value in defaults.items()
            if name not in ("promote_alias", "semantics", "realism_budget", "inconclusive", "runtime")} == \
        {name: float(value) for name, value in thresholds.items()}
    assert defaults["realism_budget"] == policy.gate.realism_budget
    assert defaults["promote_alias"] == policy.gate.promote_alias
    assert defaults["semantics"] == (policy.gate.semantics or "host")  # the policy's, else the command's default
    assert defaults["runtime"] == (policy.gate.runtime or "")  # empty: each figure's own runtime, as the command


def test_every_entry_point_parameter_is_its_commands_option_with_that_options_default():
    """An MLproject parameter passes one option of its command (``--recipe {recipe}``), and where the command has a
    default of its own the parameter's default is that default (compared after the option's own conversion), so
    `mlflow run` and the command line cannot drift. Where the option has none (data, thresholds) the entry point
    gives an example; the realism entry point's seeds are the realism step's own (fuzz.contract.REALISM_SEEDS)."""
    import importlib
    import re

    import click
    import yaml

    from mlflow_di.cli import COMMANDS
    from mlflow_di.fuzz.contract import REALISM_SEEDS

    own = {("fuzz_realistic", "--num-seeds"): REALISM_SEEDS}  # the realism step's, not the fuzz command's 500
    checked = 0
    for name, entry in yaml.safe_load((REPO / "MLproject").read_text())["entry_points"].items():
        words = entry["command"].split()
        command = importlib.import_module(f"mlflow_di.commands.{COMMANDS[words[1]]}").command
        options = {flag: param for param in command.params for flag in (*param.opts, *param.secondary_opts)}
        for flag, value in zip(words, words[1:]):
            placeholder = re.fullmatch(r"\{(\w+)\}", value)
            if not flag.startswith("--") or not placeholder:
                continue
            assert flag in options, f"{name}: {flag} is not an option of mlflow-di {words[1]}"
            param, spec = options[flag], entry["parameters"][placeholder.group(1)]
            if "default" not in spec or param.required or param.default in (None, click.core.UNSET):
                continue
            with click.Context(command) as ctx:
                given = param.type_cast_value(ctx, spec["default"])
                wanted = own.get((name, flag), param.type_cast_value(ctx, param.default))
            assert given == wanted, f"{name}: {flag} defaults to {spec['default']!r} here, {param.default!r} there"
            checked += 1
    assert checked > 40
