"""A model format is one entry: a toy format (a two-layer perceptron stored as an .npz of its weights, which
runs no code when opened) registered with its suffix opens in describe, coverage and fuzz with no edit in
the commands, which ask the format what it can do."""
import json

import numpy as np
import pytest

from mlflow_di.cli import main
from mlflow_di.errors import UserError
from mlflow_di.models.formats import ModelFormat, register_format, unregister_format


def _open_perceptron(source):
    """The module an .mlp file holds: Flatten -> Linear -> ReLU -> Linear, its weights read with allow_pickle off."""
    import torch
    from torch import nn

    from mlflow_di.models import zoo
    from mlflow_di.models.metadata import ModelMetadata

    with np.load(source.path, allow_pickle=False) as weights:
        hidden, classes = weights["w1"].shape[0], weights["w2"].shape[0]
        module = nn.Sequential(nn.Flatten(), nn.Linear(weights["w1"].shape[1], hidden), nn.ReLU(),
                               nn.Linear(hidden, classes))
        with torch.no_grad():
            for layer, key in ((module[1], "1"), (module[3], "2")):
                layer.weight.copy_(torch.from_numpy(weights[f"w{key}"]))
                layer.bias.copy_(torch.from_numpy(weights[f"b{key}"]))
    return module.eval(), ModelMetadata(zoo.architecture("digits-cnn").preprocessing)


@pytest.fixture()
def perceptron_format():
    register_format(ModelFormat("perceptron-npz", "two-layer perceptron (.mlp: an npz of its weights)",
                                "np.savez(path, w1=..., b1=..., w2=..., b2=...)", white_box=True, runs_code=False,
                                open_module=_open_perceptron, suffixes=(".mlp",)))
    yield
    unregister_format("perceptron-npz")


def _perceptron_file(folder, name: str, jitter: float = 0.0):
    """A perceptron's .mlp file: the same weights every time, plus ``jitter`` (a stand-in for a compressed copy)."""
    rng, noise = np.random.default_rng(0), np.random.default_rng(1)
    weights = {"w1": rng.normal(0, 0.2, (16, 64)), "b1": np.zeros(16), "w2": rng.normal(0, 0.5, (10, 16)),
               "b2": np.zeros(10)}
    path = folder / f"{name}.mlp"
    with path.open("wb") as out:
        np.savez(out, **{key: (value + noise.normal(0, jitter, value.shape)).astype(np.float32)
                         for key, value in weights.items()})
    return str(path)


def test_a_registered_format_opens_in_every_command(perceptron_format, tracking_uri, tmp_path, capsys):
    original, other = _perceptron_file(tmp_path, "original"), _perceptron_file(tmp_path, "copy", jitter=0.05)
    assert main(["describe", original]) == 0
    assert "two-layer perceptron" in capsys.readouterr().out
    out = tmp_path / "coverage.json"
    assert main(["coverage", "--model-uri", original, "--train-data", "digits[0:200]", "--test-data", "digits[200:260]",
                 "--criteria", "nc,kmnc", "--json-out", str(out)]) == 0, capsys.readouterr().err
    assert 0 < json.loads(out.read_text())["nc"] <= 1
    fuzzed = tmp_path / "fuzz.json"
    assert main(["fuzz", "--original", original, "--compressed", other, "--seed-data", "digits[300:340]",
                 "--num-seeds", "6", "--max-queries", "20", "--out-dir", str(tmp_path / "campaign"),
                 "--json-out", str(fuzzed)]) == 0, capsys.readouterr().err
    assert json.loads(fuzzed.read_text())["seeds"] == 6


def test_a_format_claims_its_suffixes_alone(perceptron_format, tmp_path):
    with pytest.raises(UserError, match=r"\.onnx files are onnx models already"):
        register_format(ModelFormat("other-onnx", "another ONNX", "", white_box=False, runs_code=False,
                                    open_black_box=lambda source, device: None, suffixes=(".onnx",)))
    unregister_format("perceptron-npz")
    path = tmp_path / "m.mlp"
    path.write_bytes(b"")
    from mlflow_di.models.reference import ModelRef

    with pytest.raises(UserError, match="cannot tell what kind of model"):
        ModelRef.parse(str(path))
    unregister_format("onnx")  # a built-in format stays
    assert ModelRef.parse(_onnx_file(tmp_path)).format == "onnx"


def _onnx_file(folder) -> str:
    path = folder / "m.onnx"
    path.write_bytes(b"")
    return str(path)
