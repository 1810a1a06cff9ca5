"""Every example of the README and the docs pages is checked against the code, so a renamed option,
a removed entry point or a stale policy key fails here rather than in a reader's terminal:

- each ``mlflow-di`` command line parses against the real CLI (the subcommand exists; click converts
  every option: names, choices, types, ranges; output paths are probed writable in a scratch folder);
- each ``mlflow run`` names an entry point of the MLproject with parameters it declares, and the
  command the MLproject makes of them parses as above;
- each ``make`` target exists; Python blocks compile; YAML blocks parse, and policies load as
  policies (the pipeline's own validation).

Parsing is what can be checked everywhere: many examples need a GPU, a Ray cluster, a server or
data no test machine has. The README's own commands also *run*, top to bottom, in
test_readme_walk.py."""
from __future__ import annotations

import os
import re

import click
import pytest
import yaml

from doc_blocks import REPO, Block, all_blocks, argv
from conftest import _shared_path
from mlflow_di.cli import cli
from mlflow_di.policy import parse_policy

BLOCKS = all_blocks()
SHARED = _shared_path()
#: values for the shell variables the examples use (run ids and secrets are placeholders there)
ENV = {"MLFLOW_DI_SHARED": "../shared", "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}
#: words that stand for a run id in the prose of an example
RUN_ID_PLACEHOLDERS = ("COVERAGE_RUN_ID", "RUN_ID")


def _commands(kind: str) -> list[tuple[str, list[str]]]:
    found = []
    for block in BLOCKS:
        if block.language not in ("bash", "sh", "console"):  # "text": a synopsis, not an example
            continue
        env = dict(ENV)
        for command in block.commands():
            words = argv(command, env)
            if words[:1] == ["export"]:
                name, _, value = words[1].partition("=")
                env[name] = value
            elif words[: len(kind.split())] == kind.split():
                found.append((block.where, words))
    return found


def parse_mlflow_di(words: list[str]) -> click.Context:
    """Let click convert the global options, then every option of the subcommand (nothing runs).
    Examples that name ``../shared`` files are skipped, with the reason, where those are absent."""
    if any("../shared" in word for word in words) and not SHARED.is_dir():
        pytest.skip(f"the example reads ../shared, and the reference data are not at {SHARED}")
    names = set(cli.list_commands(None))
    at = next((i for i, word in enumerate(words) if word in names), None)
    assert at is not None, f"no mlflow-di command in {words}; commands: {sorted(names)}"
    parent = cli.make_context("mlflow-di", words[:at + 1])
    command = cli.get_command(parent, words[at])
    return command.make_context(words[at], words[at + 1:], parent=parent)


@pytest.fixture()
def scratch(tmp_path, monkeypatch):
    """A working folder in which ``examples/`` resolves (the pages run from the clone's root) and
    output paths of the examples are probed; the environment the global options set is restored."""
    work = tmp_path / "clone"
    work.mkdir()
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED)
    (work / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(work)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_DI_TRACKING_TIMEOUT", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.setenv(name, os.environ.get(name, "")) if name in os.environ else monkeypatch.delenv(name, raising=False)
    for name in RUN_ID_PLACEHOLDERS + ("MLFLOW_DI_WEBHOOK_SECRET",):
        monkeypatch.setenv(name, "placeholder")
    return work


MLFLOW_DI = _commands("mlflow-di")
MLFLOW_RUN = _commands("mlflow run")
MAKE = _commands("make")


def test_the_pages_have_examples_of_every_kind():
    """The extraction finds what the pages hold (an empty list would make every test below vacuous)."""
    assert len(MLFLOW_DI) >= 30 and len(MLFLOW_RUN) >= 8 and len(MAKE) >= 2
    shown = {words[next(i for i, w in enumerate(words) if w in set(cli.list_commands(None)))] for _, words in MLFLOW_DI}
    assert {"describe", "coverage", "compress", "fuzz", "gate", "pipeline", "serve", "generate", "inspect",
            "repair", "robustness", "import-keras"} <= shown


@pytest.mark.parametrize("where, words", MLFLOW_DI, ids=[w for w, _ in MLFLOW_DI])
def test_every_mlflow_di_example_parses(where, words, scratch):
    try:
        parse_mlflow_di(words[1:])
    except click.UsageError as error:
        pytest.fail(f"{where}: `{' '.join(words)}`: {error.format_message()}")


def _mlproject() -> dict:
    return yaml.safe_load((REPO / "MLproject").read_text())["entry_points"]


def _entry_point_and_parameters(words: list[str]) -> tuple[str, dict[str, str]]:
    entry, parameters, rest = "main", {}, iter(words[2:])
    for word in rest:
        if word == "-e":
            entry = next(rest)
        elif word == "-P":
            key, _, value = next(rest).partition("=")
            parameters[key] = value
        elif word in ("-b", "--backend-config", "--env-manager", "--experiment-name"):
            next(rest)
    return entry, parameters


@pytest.mark.parametrize("where, words", MLFLOW_RUN, ids=[w for w, _ in MLFLOW_RUN])
def test_every_mlflow_run_example_names_declared_parameters_and_its_command_parses(where, words, scratch):
    import shlex

    entry, given = _entry_point_and_parameters(words)
    points = _mlproject()
    assert entry in points, f"{where}: no entry point {entry!r} in MLproject ({sorted(points)})"
    declared = points[entry].get("parameters", {})
    assert set(given) <= set(declared), f"{where}: {sorted(set(given) - set(declared))} not declared by {entry}"
    values = {name: spec.get("default") for name, spec in declared.items()} | given
    missing = [name for name, value in values.items() if value is None]
    assert not missing, f"{where}: {entry} needs {missing}"
    command = points[entry]["command"].format(**{k: shlex.quote(str(v)) for k, v in values.items()})
    try:
        parse_mlflow_di(shlex.split(command)[1:])
    except click.UsageError as error:
        pytest.fail(f"{where}: `mlflow run -e {entry}` makes `{command}`: {error.format_message()}")


def test_every_make_example_is_a_target():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    for where, words in MAKE:
        assert set(words[1:]) <= targets, f"{where}: `{' '.join(words)}` names no Makefile target"


def _blocks(*languages: str) -> list[Block]:
    return [block for block in BLOCKS if block.language in languages]


@pytest.mark.parametrize("block", _blocks("python"), ids=lambda b: b.where)
def test_every_python_example_compiles(block):
    compile(block.text, block.where, "exec")


@pytest.mark.parametrize("block", _blocks("yaml"), ids=lambda b: b.where)
def test_every_yaml_example_is_a_valid_policy_or_part_of_one(block, scratch):
    """A YAML block is a pipeline policy or a section of one: it loads as a policy (a section alone
    is given a ``gate`` step, the least a policy holds)."""
    document = yaml.safe_load(block.text)
    assert isinstance(document, dict), f"{block.where}: not a mapping"
    if not ({"compress", "coverage", "fuzz", "robustness", "gate"} & set(document)):
        document["gate"] = {"thresholds": {"min_idc": 0.5}}
    parse_policy(yaml.safe_dump(document), source=block.where)


def test_every_picture_a_page_shows_exists():
    """mkdocs --strict checks links between pages, not pictures: a screenshot renamed or never
    made would leave a broken image on the site."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).is_file(), f"{page.relative_to(REPO)} shows {target}, which is missing"
