"""A data source is one declaration (mlflow_di.data.DataSource): every declared source passes the same
contract, and a toy source registered here is read by every command that takes data, by the policy and by
MLflow's dataset records, with no edit anywhere else."""
import json

import mlflow
import numpy as np
import pytest

from mlflow_di.cli import main
from mlflow_di.data import SOURCES, DataSource, class_names, is_training_split, load_images, register_source, spec_help
from mlflow_di.data import unregister_source
from mlflow_di.errors import UserError

TOY = "mirrored-digits"


def _mirrored_digits(_argument: str):
    """scikit-learn's digits mirrored left to right, as floats in 0..1 (the declaration's loader may return
    floats: load_images scales them to uint8)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images[:, :, ::-1] / 16.0, bunch.target


@pytest.fixture()
def toy_source():
    register_source(DataSource(TOY, "the digits mirrored left to right", _mirrored_digits, argument=None))
    yield TOY
    unregister_source(TOY)


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_declared_source_keeps_the_contract(name, tmp_path):
    source = SOURCES[name]
    assert source.summary and source.form in spec_help() and isinstance(source.training_split, bool)
    if source.argument is None:
        data = load_images(f"{name}[0:5]")
        assert data.images.dtype == np.uint8 and data.images.ndim == 4 and len(data) == len(data.labels) == 5
        with pytest.raises(UserError, match="takes no path"):
            load_images(f"{name}:{tmp_path}")
    else:
        for spec, said in ((f"{name}:", "needs a path"), (f"{name}:{tmp_path / 'absent'}", "does not exist")):
            with pytest.raises(UserError, match=said) as refused:
                load_images(spec)
            assert "\n" not in str(refused.value)
    assert is_training_split(f"{source.form}[0:5]") == source.training_split
    assert class_names(f"{source.form}[0:5]") is None  # no such folder: no names to give


def test_a_registered_source_is_in_the_help_and_loads_as_uint8(toy_source):
    assert toy_source in spec_help() and spec_help().startswith("digits, ")
    data = load_images(f"{toy_source}[10:20]")
    digits = load_images("digits[10:20]")
    assert data.images.dtype == np.uint8 and data.images.shape == digits.images.shape
    assert np.abs(data.images.astype(int) - digits.images[:, :, ::-1].astype(int)).max() <= 1  # 16ths rounded to 255ths
    np.testing.assert_array_equal(data.labels, digits.labels)
    with pytest.raises(UserError, match="takes no path"):
        load_images(f"{toy_source}:x")
    unregister_source("digits")  # built-ins stay
    assert "digits" in SOURCES


def test_an_unknown_source_lists_the_registered_ones(toy_source):
    with pytest.raises(UserError) as refused:
        load_images("imagenet:/x")
    assert TOY in str(refused.value) and "cifar10:DIR" in str(refused.value)


def test_a_registered_source_works_in_every_command_that_reads_data(toy_source, registered_cnn, tmp_path, capsys):
    def run(*args):
        code = main(list(args))
        assert code == 0, (args[0], capsys.readouterr().err)

    train, test = f"{TOY}[0:300]", f"{TOY}[1300:1400]"
    out = tmp_path / "coverage.json"
    run("coverage", "--model-uri", registered_cnn, "--train-data", train, "--test-data", test, "--idc-resamples", "5",
        "--criteria", "idc,nc", "--json-out", str(out))
    assert json.loads(out.read_text())["data"] == test
    run("inspect", "--model-uri", registered_cnn, "--data", f"{TOY}[0:200]", "--coverage", "latest")
    run("generate", "--model-uri", registered_cnn, "--coverage", "latest", "--data", f"{TOY}[1300:1310]", "--budget", "20")
    run("compress", "--model-uri", registered_cnn, "--method", "int8-static", "--calib-data", f"{TOY}[0:100]",
        "--eval-data", test, "--no-benefit")
    export = "models:/cnn-int8-static/1"
    fuzzed = tmp_path / "fuzz.json"
    run("fuzz", "--original", registered_cnn, "--compressed", export, "--seed-data", test, "--num-seeds", "5",
        "--max-queries", "20", "--out-dir", str(tmp_path / "campaign"), "--json-out", str(fuzzed))
    assert json.loads(fuzzed.read_text())["seeds"] == 5
    run("robustness", "--model-uri", registered_cnn, "--compressed", export, "--data", f"{TOY}[1300:1320]",
        "--corruptions", "brightness", "--severities", "1")
    run("repair", "--compressed", export, "--campaign", "all", "--eval-data", f"{TOY}[900:1000]")
    client = mlflow.MlflowClient()
    coverage_run = client.search_runs([client.get_experiment_by_name("mlflow-di").experiment_id],
                                      "tags.mlflow_di.command = 'coverage'")[0]
    sources = [json.loads(dataset.dataset.source) for dataset in coverage_run.inputs.dataset_inputs]
    assert {"spec": train} in sources and {"spec": test} in sources  # MLflow's records name the toy's specs
