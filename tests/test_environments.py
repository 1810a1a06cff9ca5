"""The project's environment files as MLflow reads them (nothing is installed or downloaded):
MLproject names conda.yaml; `mlflow run . --env-manager virtualenv` derives a virtualenv from it,
which must equal python_env.yaml; an MLproject naming python_env.yaml, or none, gets that file;
the docker_env variant for `mlflow run -b kubernetes` loads with its job template."""
import json
import pathlib
import shutil

import pytest
import yaml
from mlflow.projects import _parse_kubernetes_config, env_type
from mlflow.projects._project_spec import load_project
from mlflow.utils.environment import _PythonEnv

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_mlproject_names_conda_yaml_and_virtualenv_derives_python_env_yaml_from_it():
    project = load_project(str(REPO))
    assert project.env_type == env_type.CONDA
    assert pathlib.Path(project.env_config_path) == REPO / "conda.yaml"
    derived = _PythonEnv.from_conda_yaml(project.env_config_path)  # what --env-manager virtualenv/uv builds
    declared = _PythonEnv.from_yaml(str(REPO / "python_env.yaml"))
    assert declared.python == derived.python
    assert declared.dependencies == derived.dependencies
    assert set(derived.build_dependencies) <= set(declared.build_dependencies) == {"pip", "setuptools", "wheel"}
    torch = [d for d in declared.dependencies if d.startswith("torch==")]
    assert torch and all("==" in d for d in declared.dependencies if d.startswith("torch"))


@pytest.mark.parametrize("env_line", ["python_env: python_env.yaml\n", ""])
def test_an_mlproject_with_python_env_or_none_gets_python_env_yaml(tmp_path, env_line):
    text = (REPO / "MLproject").read_text().replace("conda_env: conda.yaml\n", env_line)
    assert text != (REPO / "MLproject").read_text()
    (tmp_path / "MLproject").write_text(text)
    shutil.copy(REPO / "python_env.yaml", tmp_path)
    shutil.copy(REPO / "conda.yaml", tmp_path)  # with no env line, python_env.yaml still comes first
    project = load_project(str(tmp_path))
    assert project.env_type == env_type.PYTHON
    assert pathlib.Path(project.env_config_path) == tmp_path / "python_env.yaml"
    assert set(project._entry_points) == set(load_project(str(REPO))._entry_points)


def test_the_kubernetes_variant_loads_with_a_docker_image_and_its_job_template(tmp_path, monkeypatch):
    example = REPO / "examples" / "kubernetes"
    shutil.copy(example / "MLproject", tmp_path)
    project = load_project(str(tmp_path))
    assert project.env_type == env_type.DOCKER and project.docker_env["image"]
    gate = project.get_entry_point("gate")
    command = gate.compute_command({"model_uri": "models:/digits-cnn/2"}, str(tmp_path))
    assert command.startswith("mlflow-di gate --model-uri models:/digits-cnn/2 --min-idc 0.5")
    monkeypatch.chdir(REPO)  # the config names the template relative to the repository root
    config = _parse_kubernetes_config(json.loads((example / "kubernetes_config.json").read_text()))
    container = config["kube-job-template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("{replaced with") and config["repository-uri"]
    assert yaml.safe_load((example / "kubernetes_job_template.yaml").read_text()) == config["kube-job-template"]
