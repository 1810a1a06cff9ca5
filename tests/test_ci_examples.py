"""examples/ci: the GitHub Actions workflow and the GitLab CI job parse as YAML, and every
``mlflow-di`` command line in them parses against the real CLI (options and values converted by
click, shell variables replaced by placeholders first)."""
import pathlib
import re
import shlex

import pytest
import yaml

from mlflow_di.cli import cli

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "ci"
PLACEHOLDERS = {"MODEL": "digits-cnn", "VERSION": "7", "EXPORT": "models:/digits-cnn-int8-static/3"}


def github_scripts(workflow: dict) -> list[str]:
    return [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]


def gitlab_scripts(config: dict) -> list[str]:
    return [line for job in config.values() if isinstance(job, dict) and "script" in job for line in job["script"]]


def mlflow_di_lines(scripts: list[str]) -> list[list[str]]:
    """Each ``mlflow-di ...`` command of the scripts as argv (without ``mlflow-di``), variables substituted."""
    found = []
    for script in scripts:
        for line in script.splitlines():
            line = line.strip()
            if line.startswith("mlflow-di "):
                line = re.sub(r"\$\{?(\w+)\}?", lambda m: PLACEHOLDERS[m.group(1)], line)
                found.append(shlex.split(line)[1:])
    return found


def parse(argv: list[str]):
    """Resolve the subcommand and let click convert every option of it (nothing runs)."""
    name, *args = argv
    command = cli.get_command(None, name)
    assert command is not None, f"no mlflow-di command {name!r}"
    return command.make_context(f"mlflow-di {name}", args)


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output paths such as reports/gate.xml are checked writable here


@pytest.mark.parametrize("name, scripts", [("github-actions.yml", github_scripts), ("gitlab-ci.yml", gitlab_scripts)])
def test_every_mlflow_di_command_in_the_ci_examples_parses(name, scripts, in_tmp):
    config = yaml.safe_load((EXAMPLES / name).read_text())
    commands = mlflow_di_lines(scripts(config))
    assert [argv[0] for argv in commands] == ["compress", "coverage", "fuzz", "gate"]
    for argv in commands:
        context = parse(argv)
        assert not context.args, f"{argv[0]}: left over {context.args}"
    gate = parse(commands[-1]).params
    assert gate["baseline"] == "models:/digits-cnn@champion" and gate["baseline_optional"]
    assert gate["junit_xml"].endswith("reports/gate.xml") and gate["summary_md"].endswith("reports/gate.md")


def test_the_parser_rejects_what_the_cli_rejects(in_tmp):
    import click

    with pytest.raises(click.UsageError):
        parse(["gate", "--model-uri", "models:/m/1", "--max-idc-drop", "2"])
    with pytest.raises(click.NoSuchOption):
        parse(["gate", "--model-uri", "models:/m/1", "--junit", "x.xml"])


def test_github_workflow_publishes_the_summary_and_the_report_even_on_failure():
    steps = yaml.safe_load((EXAMPLES / "github-actions.yml").read_text())["jobs"]["gate"]["steps"]
    summary = next(s for s in steps if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert summary["if"] == "always()" and upload["if"] == "always()" and upload["with"]["path"] == "reports/"
    env = yaml.safe_load((EXAMPLES / "github-actions.yml").read_text())["jobs"]["gate"]["env"]
    assert env["MLFLOW_TRACKING_URI"] == "${{ secrets.MLFLOW_TRACKING_URI }}"


def test_gitlab_job_reports_junit_even_on_failure():
    job = yaml.safe_load((EXAMPLES / "gitlab-ci.yml").read_text())["model-quality-gate"]
    assert job["artifacts"]["when"] == "always" and job["artifacts"]["reports"]["junit"] == "reports/gate.xml"
