"""One name per layer. A user's ONNX CNN, exported by torch's TorchScript exporter (which folds the batch norm into
the convolution and leaves the folded weight an anonymous ``onnx::Conv_N``), had three names for one layer: compress
said ``onnx::Conv_20``, describe ``/stem/stem.0/Conv``, coverage ``stem.0``. Every command now names a layer as the
white-box view does (the ONNX node is shown beside it where it matters)."""
from __future__ import annotations

import re

import torch

from mlflow_di.cli import main


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.body = torch.nn.Conv2d(8, 16, 3)
        self.logits = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        return self.logits(torch.relu(self.body(self.stem(x))).flatten(1))


WEIGHTED = {"stem.0", "body", "logits"}


def test_an_onnx_logged_cnn_has_one_name_per_layer_in_describe_compress_and_coverage(tracking_uri, tmp_path, capsys):
    import mlflow
    import onnx

    torch.manual_seed(0)
    path = tmp_path / "net.onnx"
    torch.onnx.export(Net().eval(), torch.randn(2, 1, 8, 8), str(path), input_names=["input"],
                      dynamic_axes={"input": {0: "batch"}}, dynamo=False)
    assert any(init.name.startswith("onnx::Conv_") for init in onnx.load(str(path)).graph.initializer)
    with mlflow.start_run():
        mlflow.onnx.log_model(onnx.load(str(path)), name="model", registered_model_name="net")
    uri = "models:/net/1"
    capsys.readouterr()

    assert main(["describe", uri]) == 0
    rows = capsys.readouterr().out.split("onnx node\n", 1)[1].splitlines()
    described = {row.split()[0] for row in rows if row.split()[1] in ("Conv", "Gemm")}
    assert described == WEIGHTED
    assert any(row.split()[0] == "stem.0" and row.split()[-1] == "/stem/stem.0/Conv" for row in rows)

    assert main(["coverage", "--model-uri", uri, "--train-data", "digits[0:200]", "--test-data", "digits[200:300]",
                 "--criteria", "idc", "--layer", "stem.0"]) == 0
    assert re.search(r"IDC stem\.0 ", capsys.readouterr().out)

    assert main(["compress", "--model-uri", uri, "--method", "int8-static", "--calib-data", "digits[0:100]",
                 "--eval-data", "digits[1300:1500]", "--keep-float", "stem.0", "--no-benefit"]) == 0
    out = capsys.readouterr().out
    quantized = re.search(r"quantized layers: (.*)", out).group(1)
    assert {part.split(" (")[0] for part in quantized.split("; ")} == WEIGHTED - {"stem.0"}
    assert "left in float: stem.0" in out and "onnx::" not in out
    lowest = re.search(r"lowest activation SQNR on eval \(\d+ images\): (.*)", out).group(1)
    assert {part.rsplit(" ", 2)[0] for part in lowest.split(", ")} <= WEIGHTED
