"""mlflow-di pipeline: the policy file (strict, one-line errors naming the key), the steps as child
runs of one run, and resuming after a crash at the step it reached."""
import json
import pathlib

import pytest
import yaml

from mlflow_di.cli import main
from mlflow_di.errors import UserError
from mlflow_di.policy import Policy, load_policy, parse_policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "policies"
GATE = "gate: {thresholds: {min_idc: 0.5}}\n"


@pytest.mark.parametrize("text, fragment", [
    (GATE + "fuzz:\n  seed_data: digits\n  max_queries: ten\ncompress: {methods: [fp32]}\n",
     "policy.yaml: fuzz.max_queries must be an integer, got 'ten'"),
    (GATE + "fuzz: {seed_data: digits, num_seeds: 0}\ncompress: {methods: [fp32]}\n",
     "fuzz.num_seeds: 0 is not in the range x>=1"),
    (GATE + "compress: {methods: [fp32], colour: red}\n", "unknown key compress.colour"),
    (GATE + "deploy: {}\n", "unknown section deploy"),
    ("compress: {methods: [fp32]}\n", "the gate section is required"),
    ("gate: {thresholds: {min_idc: 1.5}}\n", "gate.thresholds.min_idc is a fraction between 0 and 1"),
    ("gate: {thresholds: {min_idk: 0.5}}\n", "unknown threshold gate.thresholds.min_idk"),
    ("gate: {thresholds: {min_idc: high}}\n", "gate.thresholds.min_idc must be a number, got 'high'"),
    ("gate: {thresholds: {}}\n", "gate.thresholds must be a mapping of at least one threshold"),
    (GATE + "coverage: {train_data: digits}\n", "coverage.test_data is required"),
    (GATE + "coverage: {train_data: digits, test_data: [digits], per_class: 1}\n", "coverage.per_class must be true or false"),
    (GATE + "compress: {methods: [fp32], amount: 1.5}\n", "compress.amount: 1.5 is not in the range 0.0<=x<1.0"),
    (GATE + "robustness: {data: digits, severities: [high]}\n", "robustness.severities must be a list of integers"),
    (GATE + "fuzz: {seed_data: digits}\n", "fuzz needs a compress section"),
    (GATE + "compress: {methods: [int8-static], calib_data: digits, max_accuracy_drop: 0.01}\n",
     "compress.holdout_data is required with a bound"),
    (GATE + "compress: {methods: [int8-static], calib_data: digits, max_accuracy_drop: .nan, holdout_data: d}\n",
     "compress.max_accuracy_drop must be a number, got nan"),
    (GATE + "compress: {methods: [int8-static], calib_data: digits, max_accuracy_drop: 2, holdout_data: d}\n",
     "compress.max_accuracy_drop: 2.0 is not in the range 0.0<=x<=1.0"),
    (GATE + "compress: {methods: [fp32]}\nfuzz: {seed_data: digits, min_ssim: 1.5}\n",
     "fuzz.min_ssim: 1.5 is not in the range -1.0<x<1.0"),
    (GATE + "compress: {methods: [fp32]}\nfuzz: {seed_data: digits, max_linf: -3}\n",
     "fuzz.max_linf: -3 is not in the range 1<=x<=255"),
    ("- gate\n", "a policy is a mapping of sections"),
    (GATE + "preprocessing: {cnn: {colour: red}}\n", "unknown key preprocessing.cnn.colour"),
    (GATE + "preprocessing: {cnn: {std: [0]}}\n", "preprocessing.cnn: preprocessing std must not contain 0"),
    (GATE + "preprocessing: [cnn]\n", "preprocessing must map registered model names"),
    ("gate: [1\n", "not valid YAML"),
])
def test_a_bad_policy_is_one_line_naming_the_key(text, fragment):
    """Shapes are the policy's to check, a value's range and names its command option's: both before any step."""
    import click

    from mlflow_di.commands.pipeline import _step_arguments, command

    with pytest.raises(UserError) as error:
        with click.Context(command) as ctx:
            _step_arguments(ctx, parse_policy(text, "policy.yaml"), "models:/m/1")
    message = str(error.value)
    assert fragment in message and "\n" not in message and message.startswith("policy.yaml: ")


def test_a_policy_sets_a_criterions_own_setting_through_the_commands_option():
    import click

    from mlflow_di.commands.pipeline import _step_arguments, command

    text = GATE + "coverage: {train_data: digits, test_data: [digits], criterion_settings: {kmnc_sections: %s}}\n"
    with click.Context(command) as ctx:
        coverage = _step_arguments(ctx, parse_policy(text % 7, "p.yaml"), "models:/m/1")["coverage"]
        assert coverage["criterion_settings"] == (("kmnc_sections", 7),)
        with pytest.raises(UserError, match="p.yaml: coverage.criterion_settings: .*kmnc_sections must be at least 1"):
            _step_arguments(ctx, parse_policy(text % 0, "p.yaml"), "models:/m/1")
    with pytest.raises(UserError, match="coverage.criterion_settings must be a mapping of setting names"):
        parse_policy(text % "[1, 2]", "p.yaml")


def test_a_valid_policy_round_trips_and_its_steps_get_their_commands_defaults():
    import click

    from mlflow_di.commands.pipeline import _step_arguments, command

    policy = parse_policy(GATE + "compress: {methods: [int8-dynamic, int8-dynamic]}\nfuzz: {seed_data: 'digits[0:9]'}\n"
                          "realism: {seed_data: 'digits[0:9]'}\n")
    assert policy.steps == ("compress", "fuzz", "realism", "gate")
    assert policy.compress.methods == ("int8-dynamic",) and policy.fuzz.num_seeds is None  # the option's default
    with click.Context(command) as ctx:
        arguments = _step_arguments(ctx, policy, "models:/m/1")
    assert arguments["fuzz"]["num_seeds"] == 500 and arguments["realism"]["num_seeds"] == 100
    assert "max_queries" not in arguments["fuzz"]  # left to the fuzz command, which fills its own default
    again = parse_policy(yaml.safe_dump(policy.to_dict()))
    assert again.to_dict() == policy.to_dict() and isinstance(again, Policy)
    assert policy.sha256 and policy.sha256 != again.sha256  # of the bytes


@pytest.mark.parametrize("name", ["demo.yaml", "lenet5.yaml"])
def test_the_shipped_policies_validate(name):
    import click

    from mlflow_di.commands.pipeline import _step_arguments, command

    policy = load_policy(EXAMPLES / name)
    assert policy.gate.thresholds and policy.compress and policy.fuzz
    with click.Context(command) as ctx:  # also the names only the commands know (methods, strategy, ...)
        arguments = _step_arguments(ctx, policy, "models:/m/1")
    assert set(arguments) == set(policy.steps)
    if policy.compress.bounded:  # the bounded export's keys are compress's own options
        assert arguments["compress"]["max_disagreement_rate"] == policy.compress.max_disagreement_rate
        assert arguments["compress"]["holdout_data"] == policy.compress.holdout_data


def test_a_policy_fuzzes_inside_a_realism_budget_with_the_fuzz_commands_own_options():
    import click

    from mlflow_di.commands.pipeline import _step_arguments, command

    policy = parse_policy(GATE + "compress: {methods: [int8-dynamic]}\n"
                          "fuzz: {seed_data: digits, strategy: boundary, max_linf: 32, min_ssim: 0.9}\n")
    with click.Context(command) as ctx:
        fuzz = _step_arguments(ctx, policy, "models:/m/1")["fuzz"]
    assert (fuzz["strategy"], fuzz["max_linf"], fuzz["min_ssim"]) == ("boundary", 32, 0.9)
    with pytest.raises(UserError, match="fuzz.max_linf: 300 is not in the range 1<=x<=255"), \
            click.Context(command) as ctx:  # --max-linf's own range
        _step_arguments(ctx, parse_policy(GATE + "compress: {methods: [int8-dynamic]}\n"
                                          "fuzz: {seed_data: digits, max_linf: 300}\n"), "models:/m/1")


def test_the_demo_policy_is_what_the_demo_runs():
    from mlflow_di.commands import demo

    policy = load_policy(EXAMPLES / "demo.yaml")
    assert policy.compress.methods == demo.DEMO_METHODS and policy.compress.calib_data == demo.CALIB_SPEC
    assert policy.coverage.train_data == demo.TRAIN_SPEC and policy.coverage.test_data == (demo.TEST_SPEC,)
    assert policy.fuzz.seed_data == demo.TEST_SPEC and policy.fuzz.num_seeds == 100 and policy.fuzz.max_queries == 2000
    assert policy.gate.thresholds == demo.GATE and policy.gate.promote_alias == "champion"
    assert policy.gate.realism_budget == demo.REALISM_BUDGET
    assert policy.realism.strategy is None  # the declared realism strategy, the one the demo runs
    assert (policy.realism.num_seeds, policy.realism.max_queries) == (demo.REALISM_SEEDS, demo.REALISM_QUERIES)


def test_registry_names_are_checked_before_any_run(tmp_path, tracking_uri, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(GATE + "compress: {methods: [int4-magic]}\n")
    assert main(["pipeline", "--policy", str(path), "--model-uri", "models:/absent/1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlflow-di: error: p.yaml: compress.methods: unknown compression method 'int4-magic'")
    assert len(err.splitlines()) == 1
    path.write_text(GATE + "compress: {methods: [int8-dynamic]}\nfuzz: {seed_data: digits, strategy: deepxplore}\n")
    assert main(["pipeline", "--policy", str(path), "--model-uri", "models:/absent/1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlflow-di: error: p.yaml: fuzz.strategy deepxplore needs PyTorch models on both sides")
    assert "\n" not in err and "choose one of dflare" in err
    # what a method needs, from its declaration (the policy reader names no method)
    for section, fragment in (("{methods: [int8-static]}", "compress.calib_data is required for int8-static"),
                              ("{methods: [prune-l1], max_disagreement_rate: 0.01, holdout_data: digits}",
                               "compress.max_accuracy_drop, max_disagreement_rate and max_realistic_success_rate "
                               "bound the int8-static export; add int8-static to compress.methods")):
        path.write_text(GATE + f"compress: {section}\n")
        assert main(["pipeline", "--policy", str(path), "--model-uri", "models:/absent/1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"mlflow-di: error: p.yaml: {fragment}"


TINY = """
trust: {pickled_models: [cnn]}
compress: {methods: [int8-dynamic], eval_data: "digits[600:700]"}
coverage: {train_data: "digits[0:200]", test_data: ["digits[600:700]"], criteria: [idc]}
fuzz: {seed_data: "digits[600:700]", num_seeds: 3, max_queries: 20, timeout: 10}
gate: {thresholds: {min_idc: 0}, promote_alias: champion}
"""


def _runs_by_command(client) -> dict[str, list]:
    experiment = client.get_experiment_by_name("mlflow-di")
    found = {}
    for run in client.search_runs([experiment.experiment_id]):
        found.setdefault(run.data.tags.get("mlflow_di.command"), []).append(run)
    return found


def test_pipeline_runs_children_of_one_run_and_resumes_after_a_crash(registered_cnn, mlflow_client, tmp_path,
                                                                     monkeypatch, capsys):
    from mlflow_di.commands import fuzz

    policy = tmp_path / "tiny.yaml"
    policy.write_text(TINY)
    argv = ["pipeline", "--policy", str(policy), "--model-uri", registered_cnn, "--state-dir", str(tmp_path / "state")]
    real = fuzz.command.callback

    def crash(**kwargs):
        raise KeyboardInterrupt  # the process dies in the fuzz step

    monkeypatch.setattr(fuzz.command, "callback", crash)
    assert main(argv) == 130
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert set(state["done"]) == {"compress", "coverage"} and state["done"]["compress"]["exports"]
    monkeypatch.setattr(fuzz.command, "callback", real)

    code = main(argv)
    out = capsys.readouterr().out
    assert "resuming from" in out and "compress: finished earlier, skipped" in out
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert code == state["done"]["gate"]["exit_code"] and code in (0, 1)
    found = _runs_by_command(mlflow_client)
    assert {command: len(found[command]) for command in ("pipeline", "compress", "coverage", "fuzz", "gate")} == \
        {"pipeline": 1, "compress": 1, "coverage": 1, "fuzz": 1, "gate": 1}  # nothing ran twice, one parent
    parent = found["pipeline"][0]
    assert parent.info.status == "FINISHED" and parent.data.params["model_uri"] == registered_cnn
    gate_run = found["gate"][0]  # the parent carries the gate's verdict, metrics and report
    assert parent.data.tags["mlflow_di.verdict"] == gate_run.data.tags["mlflow_di.verdict"] in ("PASS", "FAIL")
    assert parent.data.tags["mlflow_di.gate_run_id"] == gate_run.info.run_id
    assert parent.data.metrics["passed"] == gate_run.data.metrics["passed"]
    assert "gate/report.html" in [a.path for a in mlflow_client.list_artifacts(parent.info.run_id, "gate")]
    version = mlflow_client.get_model_version(*registered_cnn.removeprefix("models:/").split("/"))
    assert found["coverage"][0].info.run_id in version.tags["mlflow_di.gate_evidence"].split(",")  # pinned to its steps
    for command in ("compress", "coverage", "fuzz", "gate"):
        assert found[command][0].data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert found[command][0].info.status == "FINISHED"

    assert main(argv) == code  # every step finished: nothing runs again
    assert "every step already finished" in capsys.readouterr().out
    assert len(_runs_by_command(mlflow_client)["gate"]) == 1

    policy.write_text(TINY.replace("min_idc: 0", "min_idc: 0.0"))  # another policy: starts over
    monkeypatch.setattr(fuzz.command, "callback", crash)
    assert main(argv) == 130
    assert "(the policy changed); starting over" in capsys.readouterr().out
    assert len(_runs_by_command(mlflow_client)["compress"]) == 2


def test_a_policy_loads_only_the_pickles_it_trusts(registered_cnn, mlflow_client, tmp_path, capsys):
    from mlflow_di.mlflow_edge import models as edge_models, runs as tracking
    from mlflow_di.models.loading import load_torch_model

    with tracking.tracked_run("pickle it"):  # the same CNN as a second, pickled version
        edge_models.log_torch_model(load_torch_model(registered_cnn), registered_model_name="cnn",
                                    serialization_format="pickle")
    pickled = "models:/cnn/2"
    capsys.readouterr()  # MLflow's own warning about pickles, when its logger has not said it yet
    policy = tmp_path / "untrusting.yaml"
    policy.write_text(TINY.replace("trust: {pickled_models: [cnn]}", "trust: {pickled_models: [other]}"))
    argv = ["pipeline", "--policy", str(policy), "--model-uri", pickled, "--state-dir", str(tmp_path / "state")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mlflow-di: error: 'models:/cnn/2' is a pickled PyTorch model and loading it runs its code; the "
                   "policy untrusting.yaml does not trust it: add 'cnn' to trust.pickled_models if you trust its "
                   "authors (pt2, ONNX and TFLite models need no trust: log it with mlflow.pytorch.log_model's "
                   "default pt2 format)"]
    assert all(run.info.status != "RUNNING" for runs in _runs_by_command(mlflow_client).values() for run in runs)
    version = mlflow_client.get_model_version("cnn", "2")  # could not be analysed: ERROR with the cause, not FAIL
    assert version.tags["mlflow_di.verdict"] == "ERROR"
    assert version.description.startswith("## mlflow-di gate: ERROR for `models:/cnn/2`")
    assert "does not trust it" in version.description
    # the same model named on the command line is a person's choice: it loads
    assert main(["describe", pickled]) == 0
    # and the pt2 version needs no trust: the same policy gets past loading it
    assert main(["pipeline", "--policy", str(policy), "--model-uri", registered_cnn, "--state-dir",
                 str(tmp_path / "state-pt2")]) in (0, 1)


def test_a_command_alone_still_starts_a_top_level_run(registered_cnn, mlflow_client):
    assert main(["gate", "--model-uri", registered_cnn, "--max-accuracy-drop", "1"]) == 2  # ERROR: nothing measured
    gate_run = _runs_by_command(mlflow_client)["gate"][0]
    assert "mlflow.parentRunId" not in gate_run.data.tags


def test_every_policy_field_is_an_option_of_its_steps_command():
    """A policy section holds the options of its step's command, converted and checked by that option's own type
    (pipeline._converted): the command's options are the one table the command line and the policy share, so a
    field cannot drift from the option it stands for. Gate thresholds are the gate's threshold options."""
    import dataclasses

    from mlflow_di import policy
    from mlflow_di.commands import compress, coverage, fuzz, gate, robustness

    sections = {"compress": (policy.CompressPolicy, compress.command), "coverage": (policy.CoveragePolicy, coverage.command),
                "fuzz": (policy.FuzzPolicy, fuzz.command), "realism": (policy.RealismPolicy, fuzz.command),
                "robustness": (policy.RobustnessPolicy, robustness.command), "gate": (policy.GatePolicy, gate.command)}
    for step, (section, command) in sections.items():
        options = {param.name for param in command.params}
        fields = {field.name for field in dataclasses.fields(section)} - {"thresholds", "method_options"}
        assert fields - options == set(), step
    from mlflow_di.compression.declarations import method_options
    from mlflow_di.gate import threshold_records

    assert set(method_options()) <= {param.name for param in compress.command.params}  # each a key of its own

    assert set(threshold_records()) <= {param.name for param in gate.command.params}


#: Values a numeric key is probed with: each must be accepted by the pipeline exactly when its option accepts it.
PROBES = (-2, -1, -0.5, 0, 0.3, 0.5, 0.999, 1, 1.5, 2, 255, 256, 4294967295, 4294967296)
#: The least a policy needs around a probed key, so that only the probe can be refused.
BASE_POLICY = {"compress": {"methods": ["int8-static"], "calib_data": "digits", "holdout_data": "digits"},
               "coverage": {"train_data": "digits", "test_data": ["digits"]}, "fuzz": {"seed_data": "digits"},
               "realism": {"seed_data": "digits"}, "robustness": {"data": "digits"},
               "gate": {"thresholds": {"min_idc": 0.5}}}


def _step_sections():
    from mlflow_di import policy
    from mlflow_di.commands import compress, coverage, fuzz, gate, robustness

    return {"compress": (policy.CompressPolicy, compress.command), "coverage": (policy.CoveragePolicy, coverage.command),
            "fuzz": (policy.FuzzPolicy, fuzz.command), "realism": (policy.RealismPolicy, fuzz.command),
            "robustness": (policy.RobustnessPolicy, robustness.command), "gate": (policy.GatePolicy, gate.command)}


def test_every_policy_key_has_its_command_options_default_and_range():
    """A step's key stands for its command's option and has no default or range of its own: left out, the step gets
    the option's default; given, the value is accepted exactly when the option accepts it (probed on boundary values
    through the pipeline's own check, which runs before any step)."""
    import copy
    import dataclasses

    import click

    from mlflow_di.commands.pipeline import _step_arguments, command
    from mlflow_di.policy import from_mapping

    checked = 0
    for step, (section, step_command) in _step_sections().items():
        options = {param.name: param for param in step_command.params}
        for field in dataclasses.fields(section):
            option = options.get(field.name)
            if option is None:
                continue
            assert field.default in (None, dataclasses.MISSING), f"{step}.{field.name} states a default of its own"
            assert field.metadata["kind"] in ("text", "texts", "names", "integers", "boolean", "integer", "number",
                                              "settings")
            if field.metadata["kind"] not in ("integer", "number"):
                continue
            for probe in PROBES:
                document = copy.deepcopy(BASE_POLICY)
                document[step][field.name] = probe
                try:
                    with click.Context(command) as ctx:
                        _step_arguments(ctx, from_mapping(document, "p.yaml"), "models:/m/1")
                    in_policy = True
                except UserError as refused:
                    assert f"{step}.{field.name}" in str(refused), str(refused)
                    in_policy = False
                try:
                    option.type.convert(probe, option, None)
                    in_option = not (field.metadata["kind"] == "integer" and isinstance(probe, float))
                except click.BadParameter:
                    in_option = False
                assert in_policy == in_option, f"{step}.{field.name}={probe}: policy {in_policy}, option {in_option}"
                checked += 1
    assert checked > 200
    with click.Context(command) as ctx:  # left out: the step's own command fills the option's default
        bare = _step_arguments(ctx, from_mapping(copy.deepcopy(BASE_POLICY), "p.yaml"), "models:/m/1")
    assert bare["compress"] == {"methods": ("int8-static",), "calib_data": "digits", "holdout_data": "digits"}


def test_an_inconclusive_fuzz_check_gets_more_seeds_in_rounds_until_the_rounds_are_spent(registered_cnn, mlflow_client,
                                                                                          tmp_path, capsys):
    """A success rate on 3 seeds cannot decide 0.5 whatever it is (the narrowest interval, 0 or 3 of 3, holds it):
    round 2 extends the same campaign to 6 seeds (intervals at 97.5%: two planned looks), the gate looks again, and
    with the rounds spent the verdict stays INCONCLUSIVE (exit 3), saying why; the seed data caps the growth."""
    policy = tmp_path / "rounds.yaml"
    policy.write_text("""
compress: {methods: [int8-dynamic], eval_data: "digits[600:700]"}
fuzz: {seed_data: "digits[600:700]", num_seeds: 3, max_queries: 20, timeout: 10}
evidence: {rounds: 2, growth: 2}
gate: {thresholds: {max_success_rate: 0.5}, promote_alias: champion}
""")
    argv = ["pipeline", "--policy", str(policy), "--model-uri", registered_cnn, "--state-dir", str(tmp_path / "state")]
    assert main(argv) == 3
    out = capsys.readouterr().out
    assert "round 2/2: fuzz grows to 6 seeds (was 3) for its inconclusive checks" in out
    assert "INCONCLUSIVE after round 2: 2 rounds of evidence spent (evidence.rounds)" in out
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["round"] == 2 and state["num_seeds"] == {"fuzz": 6} and state["done"]["gate"]["exit_code"] == 3
    found = _runs_by_command(mlflow_client)
    assert len(found["fuzz"]) == 2 and len(found["gate"]) == 2 and len(found["pipeline"]) == 1
    newest = max(found["fuzz"], key=lambda run: run.info.start_time)
    assert newest.data.metrics["fuzzed"] + newest.data.metrics["already_deviating"] == 6
    assert newest.data.metrics["interval_confidence"] == 0.975 and newest.data.metrics["success_rate_n"] <= 6
    campaign = pathlib.Path(state["done"]["fuzz"]["campaign"])
    assert json.loads((campaign / "campaign.json").read_text())["seed_count"] == 6  # extended, not started over
    assert len((campaign / "records.jsonl").read_text().splitlines()) == 6
    version = mlflow_client.get_model_version(*registered_cnn.removeprefix("models:/").split("/"))
    assert version.tags["mlflow_di.verdict"] == "INCONCLUSIVE" and "98" not in version.tags["mlflow_di.success_rate_interval"]
    assert "97.5% CI" in version.tags["mlflow_di.success_rate_interval"]

    capped = tmp_path / "capped.yaml"  # five seed images: round 2 takes all 5, round 3 has none left to add
    capped.write_text(policy.read_text().replace("digits[600:700]\", num_seeds: 3", "digits[600:605]\", num_seeds: 3")
                      .replace("rounds: 2", "rounds: 3"))
    assert main(["pipeline", "--policy", str(capped), "--model-uri", registered_cnn, "--state-dir",
                 str(tmp_path / "capped")]) == 3
    out = capsys.readouterr().out
    assert "round 2/3: fuzz grows to 5 seeds (was 3)" in out
    assert ("INCONCLUSIVE after round 2: no step can gather more evidence for fuzz (all 5 images of digits[600:605] "
            "already fuzzed)") in out


def test_a_bad_evidence_section_is_one_line():
    with pytest.raises(UserError, match="evidence.growth must be at least 2"):
        parse_policy(GATE + "evidence: {rounds: 3, growth: 1}\n", "p.yaml")
    with pytest.raises(UserError, match="unknown key evidence.looks"):
        parse_policy(GATE + "evidence: {looks: 3}\n", "p.yaml")
    assert parse_policy(GATE + "evidence: {rounds: 4}\n").evidence.confidence == pytest.approx(0.9875)
