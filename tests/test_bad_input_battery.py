"""A battery of bad command lines, each the user's fault.

Every case must end the same way: exit code 2, exactly one non-empty line on stderr that starts
with ``mlflow-di: error: `` (no traceback), and no MLflow run left RUNNING in the tracking store.
The cases run in process (``mlflow_di.cli.main``) against the fresh sqlite store of the
``tracking_uri`` fixture; none trains a model. The files they point at (a tiny untrained
digits-cnn, corrupt data sets, garbage model files) are built once per module.

Run with ``--junitxml=FILE`` to get each case's error line as the ``error_line`` property.
"""
from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

from mlflow_di.cli import main

PREFIX = "mlflow-di: error: "

#: A coverage command that would be valid (and quick to reject) but for the part a case changes.
COVERAGE = ["coverage", "--model-uri", "{pt}", "--train-data", "digits[0:20]", "--test-data", "digits[20:40]"]
#: A fuzz command of the tiny model against itself on four digits.
FUZZ = ["fuzz", "--original", "{pt}", "--compressed", "{pt}", "--seed-data", "digits[0:4]", "--num-seeds", "2"]
#: A robustness command of the tiny model against itself on four digits, one corruption, one severity.
ROBUSTNESS = ["robustness", "--model-uri", "{pt}", "--compressed", "{pt}", "--data", "digits[0:4]"]
#: An inspect command of the tiny model on twenty digits.
INSPECT = ["inspect", "--model-uri", "{pt}", "--data", "digits[0:20]"]
#: A generate command of the tiny model on twenty digits, from a coverage run that does not exist.
GENERATE = ["generate", "--model-uri", "{pt}", "--coverage", "0123456789abcdef0123456789abcdef", "--data", "digits[0:20]"]


def coverage(*extra, train="digits[0:20]", model="{pt}"):
    return ["coverage", "--model-uri", model, "--train-data", train, "--test-data", "digits[20:40]", *extra]


def idx_bytes(array: np.ndarray) -> bytes:
    """An unsigned-byte IDX file of ``array`` (MNIST's format)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _mlflow_native_models(path) -> None:
    """Models as MLflow users save them that mlflow-di cannot analyse as they are."""
    import mlflow
    import onnx
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema
    from onnx import TensorProto, helper

    from mlflow_di.models import zoo

    graph = helper.make_graph([helper.make_node("Erf", ["x"], ["y"], name="erf")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, 8, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path("erf_onnx", "models/erf.onnx")))
    normalised = (np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32) - 0.5) / 0.25
    mlflow.pytorch.save_model(zoo.build("digits-cnn", seed=0), str(path("normalised_pt2", "models/normalised-pt2")),
                              input_example=normalised)
    columns = ModelSignature(inputs=Schema([ColSpec("double", "pixel")]))
    mlflow.pytorch.save_model(zoo.build("digits-cnn", seed=0), str(path("shapeless", "models/no-shape")),
                              serialization_format="pickle", signature=columns)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """Paths (as strings) the cases name with ``{key}``."""
    import torch

    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    root = tmp_path_factory.mktemp("bad-inputs")
    paths = {}

    def path(key: str, relative: str):
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        paths[key] = str(target)
        return target

    # models
    model = TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing, name="digits-cnn")
    torch.save({"module": model.module, "mlflow_di": {"preprocessing": model.preprocessing.to_dict()}},
               path("pt", "models/digits-cnn.pt"))
    torch.save(model.module.state_dict(), path("state_pt", "models/state-dict.pt"))
    torch.save([1, 2, 3], path("list_pt", "models/a-list.pt"))
    path("text_pt", "models/notes.pt").write_text("this is not a pickle\n")
    path("text_pkl", "models/notes.pkl").write_text("this is not a pickle either\n")
    path("empty_pt", "models/empty.pt").write_bytes(b"")
    path("txt_model", "models/model.txt").write_text("what kind of model is this?\n")
    path("garbage_onnx", "models/garbage.onnx").write_bytes(b"\x00not an onnx protobuf\xff" * 8)
    path("garbage_tflite", "models/garbage.tflite").write_bytes(b"not a flatbuffer" * 8)
    path("garbage_h5", "models/garbage.h5").write_text("not HDF5\n")
    _mlflow_native_models(path)

    # MNIST-style folders
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28), dtype=np.uint8)  # incompressible
    labels = np.arange(5, dtype=np.uint8)
    path("empty_dir", "data/empty/.keep").write_text("")
    paths["empty_dir"] = str(root / "data/empty")
    gz_dir = root / "data/mnist-gz"
    gz_dir.mkdir(parents=True)
    (gz_dir / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images))[:1000])  # cut short
    (gz_dir / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(labels)))
    paths["mnist_gz"] = str(gz_dir)
    short_dir = root / "data/mnist-short"
    short_dir.mkdir(parents=True)
    (short_dir / "t10k-images-idx3-ubyte").write_bytes(idx_bytes(images)[:500])  # header says 5x28x28
    (short_dir / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(labels))
    paths["mnist_short"] = str(short_dir)
    text_dir = root / "data/mnist-text"
    text_dir.mkdir(parents=True)
    (text_dir / "t10k-images-idx3-ubyte").write_text("<html>404 not found</html>")
    (text_dir / "t10k-labels-idx1-ubyte").write_text("<html>404 not found</html>")
    paths["mnist_text"] = str(text_dir)

    # npz files
    np.savez(path("npz_noxy", "data/no-xy.npz"), images=images, labels=labels)
    np.savez(path("npz_28", "data/mnist-sized.npz"), x=images, y=labels)
    np.savez(path("npz_nan", "data/nan.npz"), x=np.full((5, 8, 8), np.nan), y=labels)
    np.savez(path("npz_count", "data/count.npz"), x=np.zeros((5, 8, 8), np.uint8), y=labels[:3])
    np.savez(path("npz_label_12", "data/label-12.npz"), x=np.zeros((2, 8, 8), np.uint8), y=np.array([0, 12]))
    path("npz_garbage", "data/garbage.npz").write_text("not a zip archive\n")

    # image folders
    path("folder_flat", "data/flat/image.png").write_bytes(b"")
    paths["folder_flat"] = str(root / "data/flat")
    from PIL import Image

    Image.fromarray(np.zeros((8, 8), np.uint8)).save(path("_good", "data/corrupt-folder/0/good.png"))
    path("_bad", "data/corrupt-folder/1/bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    paths["folder_corrupt"] = str(root / "data/corrupt-folder")
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(path("_a", "data/sizes-folder/0/a.png"))
    Image.fromarray(np.zeros((9, 9), np.uint8)).save(path("_b", "data/sizes-folder/1/b.png"))
    paths["folder_sizes"] = str(root / "data/sizes-folder")

    # CIFAR-10 batches
    path("cifar_garbage", "data/cifar-garbage/test_batch").write_bytes(b"\x80\x04garbage, not a pickle")
    paths["cifar_garbage"] = str(root / "data/cifar-garbage")
    whole = pickle.dumps({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]})
    path("cifar_cut", "data/cifar-cut/test_batch").write_bytes(whole[: len(whole) // 2])
    paths["cifar_cut"] = str(root / "data/cifar-cut")
    path("cifar_code", "data/cifar-code/test_batch").write_bytes(  # unpickling it would call print
        b"\x80\x04\x95\x1e\x00\x00\x00\x00\x00\x00\x00\x8c\x08builtins\x94\x8c\x05print\x94\x93\x94\x8c\x03ran\x94\x85\x94R\x94.")
    paths["cifar_code"] = str(root / "data/cifar-code")
    np.savez(path("npz_complex", "data/complex.npz"), x=np.zeros((5, 8, 8), np.complex64), y=labels)
    path("cifar_list", "data/cifar-list/test_batch").write_bytes(pickle.dumps([1, 2, 3]))
    paths["cifar_list"] = str(root / "data/cifar-list")

    # outputs
    path("afile", "out/somefile.txt").write_text("a regular file\n")
    # pipeline policies
    path("policy_unknown_key", "policies/unknown-key.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.5}}\nfuzz: {seed_data: digits, budget: 10}\ncompress: {methods: [fp32]}\n")
    path("policy_bad_value", "policies/bad-value.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.5}}\nfuzz: {seed_data: digits, max_queries: ten}\ncompress: {methods: [fp32]}\n")
    path("policy_out_of_range", "policies/out-of-range.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.5}}\nfuzz: {seed_data: digits, num_seeds: 0}\ncompress: {methods: [fp32]}\n")
    path("policy_bad_criterion_setting", "policies/bad-setting.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.5}}\n"
        "coverage: {train_data: digits, test_data: [digits], criterion_settings: {kmnc_sections: 0}}\n")
    path("policy_bad_method_option", "policies/bad-recipe.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.5}}\ncompress: {methods: [int8-static], calib_data: digits, recipe: s4s4}\n")
    laughs = "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
    path("policy_alias_bomb", "policies/laughs.yaml").write_text("a: &a [x,x,x,x,x,x,x,x,x]\n" + laughs)  # 9^9 values
    path("policy_recursive", "policies/recursive.yaml").write_text("gate: &g {thresholds: {min_idc: 0.5}, again: *g}\n")
    path("policy_ok", "policies/ok.yaml").write_text("gate: {thresholds: {min_idc: 0.5}}\n")
    path("policy_preprocessing_key", "policies/preprocessing-key.yaml").write_text(
        "preprocessing: {m: {colour: red}}\ngate: {thresholds: {min_idc: 0.5}}\n")
    # special files and crafted headers (hardening, third round)
    import io
    import os
    import zipfile

    os.mkfifo(path("policy_fifo", "policies/fifo.yaml"))  # opening it for reading would block forever
    path("policy_duplicate_gate", "policies/duplicate-gate.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.9}, promote_alias: champion}\ngate: {thresholds: {min_idc: 0.1}}\n")
    path("policy_huge_integer", "policies/huge-integer.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.5}}\nfuzz: {seed_data: digits, max_queries: " + "9" * 5000 + "}\n")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (10**9, 28, 28)})
    with zipfile.ZipFile(path("npz_huge_header", "data/huge-header.npz"), "w") as archive:
        archive.writestr("x.npy", header.getvalue() + bytes(64))  # claims 784 GB, holds 64 bytes
        labels_file = io.BytesIO()
        np.save(labels_file, labels)
        archive.writestr("y.npy", labels_file.getvalue())
    np.savez(path("npz_half_labels", "data/half-labels.npz"), x=np.zeros((2, 8, 8), np.uint8), y=np.array([0, 0.5]))
    Image.new("L", (16000, 16000)).save(path("_bomb", "data/bomb-folder/0/big.png"))  # 256 Mpixel, 250 KB
    paths["folder_bomb"] = str(root / "data/bomb-folder")
    paths["adir"] = str(root / "out")
    path("_campaign", "out/campaign/seeds.jsonl").write_text("{}\n")
    paths["campaign"] = str(root / "out/campaign")
    _fourth_round(path, paths, root)
    _fifth_round(path, paths, root)
    return paths


def _fourth_round(path, paths: dict, root) -> None:
    """Assets of the fourth hardening round: models that answer NaN/Inf, a custom ONNX operator, a 3-channel
    8x8 model, damaged and misdirected MLflow model folders, policies with bytes no text holds."""
    import shutil

    import mlflow
    import torch
    from onnx import TensorProto, helper, save

    from mlflow_di.models import zoo

    class Scaled(torch.nn.Module):
        def __init__(self, factor: float, channels: int = 1):
            super().__init__()
            self.conv, self.fc, self.factor = torch.nn.Conv2d(channels, 2, 3), torch.nn.Linear(72, 10), factor

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).flatten(1)) * self.factor

    for key, factor, channels in (("nan_onnx", float("nan"), 1), ("inf_onnx", float("inf"), 1), ("rgb_onnx", 1.0, 3)):
        torch.onnx.export(Scaled(factor, channels).eval(), torch.randn(2, channels, 8, 8), str(path(key, f"models/{key}.onnx")),
                          input_names=["input"], dynamic_axes={"input": {0: "batch"}}, dynamo=False)
    graph = helper.make_graph([helper.make_node("MyOp", ["x"], ["y"], domain="my.domain", name="mine")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10])])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)],
                           ir_version=8), str(path("custom_op_onnx", "models/custom-op.onnx")))
    pt2 = path("garbage_pt2", "models/garbage-pt2")
    mlflow.pytorch.save_model(zoo.build("digits-cnn", seed=0), str(pt2),
                              input_example=np.zeros((2, 1, 8, 8), np.float32))
    (pt2 / "data" / "model.pt2").write_bytes(b"not a zip archive" * 20)
    elsewhere = path("data_outside", "models/data-outside")
    shutil.copytree(pt2, elsewhere)
    mlmodel = (elsewhere / "MLmodel").read_text()
    (elsewhere / "MLmodel").write_text(mlmodel.replace("model_data: data", "model_data: ../../../outside"))
    path("policy_not_utf8", "policies/latin1.yaml").write_bytes(b"gate: {thresholds: {min_idc: 0.5}}\n# caf\xe9\n")
    path("policy_nul", "policies/nul.yaml").write_bytes(b"gate: {thresholds: {min_idc: 0.5}}\x00\n")
    path("policy_escape", "policies/escape.yaml").write_bytes(b"gate: {thresholds: {min_idc: 0.5}, promote_alias: \x1b[2J}\n")
    path("policy_bad_alias", "policies/bad-alias.yaml").write_text(
        "gate: {thresholds: {min_idc: 0.5}, promote_alias: 'bad alias <script>'}\n")


def _fifth_round(path, paths: dict, root) -> None:
    """Assets of the fifth hardening round: memory bombs declared in headers (an npz member of zeros that
    unpacks to 1.2 GB from 5 MB, a model folder whose signature says 50,000x50,000 pixels) and a FIFO among
    a folder's images."""
    import io
    import os
    import re
    import zipfile

    import mlflow
    from PIL import Image

    from mlflow_di.models import zoo

    with zipfile.ZipFile(path("npz_zip_bomb", "data/zip-bomb.npz"), "w", compression=zipfile.ZIP_DEFLATED,
                         compresslevel=1) as archive:
        images = io.BytesIO()
        np.save(images, np.zeros((2, 8, 8), np.uint8))
        archive.writestr("x.npy", images.getvalue())
        with archive.open("y.npy", "w", force_zip64=True) as labels:  # 150 M int64 labels, streamed in
            header = io.BytesIO()
            np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False, "shape": (150_000_000,)})
            labels.write(header.getvalue())
            zeros = bytes(2**24)
            for _ in range(150_000_000 * 8 // len(zeros)):
                labels.write(zeros)
            labels.write(bytes(150_000_000 * 8 % len(zeros)))
    Image.new("L", (8, 8)).save(path("_fifo_image", "data/fifo-folder/0/ok.png"))
    os.mkfifo(root / "data/fifo-folder/0/pipe.png")  # opening it for reading would block forever
    paths["folder_fifo"] = str(root / "data/fifo-folder")
    wide = path("wide_signature", "models/wide-signature")
    mlflow.pytorch.save_model(zoo.build("digits-cnn", seed=0), str(wide), input_example=np.zeros((2, 1, 8, 8), np.float32))
    mlmodel, count = re.subn(r'"shape": \[-1,\s*1,\s*8,\s*8\]', '"shape": [-1, 1, 50000, 50000]',
                             (wide / "MLmodel").read_text())
    assert count == 1
    (wide / "MLmodel").write_text(mlmodel)


# (id, argv); "{key}" is replaced by the path assets[key]
CASES = [
    # ---------------------------------------------------------------- usage errors
    ("unknown-command", ["frobnicate"]),
    ("unknown-option", [*COVERAGE, "--bogus"]),
    ("describe-missing-uri", ["describe"]),
    ("import-keras-missing-arch", ["import-keras", "--weights", "{garbage_h5}", "--register-as", "x"]),
    ("coverage-missing-model-uri", ["coverage", "--train-data", "digits", "--test-data", "digits"]),
    ("compress-missing-method", ["compress", "--model-uri", "{pt}"]),
    ("fuzz-missing-seed-data", ["fuzz", "--original", "{pt}", "--compressed", "{pt}"]),
    ("gate-missing-model-uri", ["gate", "--min-idc", "0.5"]),
    ("fuzz-unknown-runtime", ["fuzz", "--original", "{pt}", "--compressed", "{pt}", "--seed-data", "digits[0:2]",
                              "--runtime", "tensorrt"]),
    ("compress-runtime-bad-precision", ["compress", "--model-uri", "{pt}", "--method", "fp32", "--runtime",
                                        "openvino:int4"]),
    ("compress-runtime-twice", ["compress", "--model-uri", "{pt}", "--method", "fp32", "--runtime",
                                "openvino,onnxruntime,openvino"]),
    ("gate-unknown-runtime", ["gate", "--model-uri", "models:/m/1", "--min-idc", "0.5", "--runtime", "tflite-gpu"]),
    ("fuzz-runtime-of-a-pytorch-model", ["fuzz", "--original", "{pt}", "--compressed", "{pt}", "--seed-data",
                                         "digits[0:2]", "--runtime", "openvino"]),
    ("pipeline-workers-not-a-count", ["pipeline", "--policy", "p.yaml", "--model-uri", "models:/m/1", "--workers",
                                      "many"]),
    ("top-m-not-int", [*COVERAGE, "--top-m", "abc"]),
    ("top-m-zero", [*COVERAGE, "--top-m", "0"]),
    ("top-m-above-neurons", [*COVERAGE, "--top-m", "1000"]),
    ("timeout-negative", [*FUZZ, "--timeout", "-1"]),
    ("timeout-zero", [*FUZZ, "--timeout", "0"]),
    ("timeout-nan", [*FUZZ, "--timeout", "nan"]),
    ("timeout-inf", [*FUZZ, "--timeout", "inf"]),
    ("fuzz-seed-negative", [*FUZZ, "--seed", "-1"]),
    ("gate-runs-not-run-ids", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5", "--runs", "abc,def"]),
    ("gate-max-disagreement-rate-above-one", ["gate", "--model-uri", "models:/absent/1", "--max-disagreement-rate",
                                              "1.5"]),
    ("gate-min-mean-queries-nan", ["gate", "--model-uri", "models:/absent/1", "--min-mean-queries", "nan"]),
    ("serve-poll-seconds-inf", ["serve", "--policy", "{policy_ok}", "--poll-seconds", "inf"]),
    ("num-seeds-zero", [*FUZZ[:-2], "--num-seeds", "0"]),
    ("batch-zero", [*FUZZ, "--batch", "0"]),
    ("workers-negative", [*FUZZ, "--workers", "-1"]),
    ("ray-address-garbage", [*FUZZ, "--workers", "2", "--ray-address", "nowhere"]),
    ("gpus-per-worker-negative", [*FUZZ, "--workers", "2", "--gpus-per-worker", "-0.5"]),
    ("workers-with-deepxplore", [*FUZZ, "--strategy", "deepxplore", "--workers", "2"]),
    ("amount-above-one", ["compress", "--model-uri", "{pt}", "--method", "prune-l1", "--amount", "1.5"]),
    ("amount-one", ["compress", "--model-uri", "{pt}", "--method", "prune-l1", "--amount", "1"]),
    ("clusters-one", [*COVERAGE, "--clusters", "1,2"]),
    ("clusters-letters", [*COVERAGE, "--clusters", "a,b"]),
    ("unknown-strategy", [*FUZZ, "--strategy", "bogus"]),
    ("unknown-method", ["compress", "--model-uri", "{pt}", "--method", "int3-magic"]),
    ("empty-method", ["compress", "--model-uri", "{pt}", "--method", ","]),
    ("unknown-criteria", [*COVERAGE, "--criteria", "idc,bogus"]),
    ("unknown-rule", [*COVERAGE, "--rule", "bogus"]),
    ("unknown-arch", ["import-keras", "--arch", "vgg99", "--weights", "{garbage_h5}", "--register-as", "x"]),
    ("gate-min-idc-above-one", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "1.5"]),
    ("gate-min-idc-not-number", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "high"]),
    ("gate-max-accuracy-drop-out-of-range", ["gate", "--model-uri", "models:/absent/1", "--max-accuracy-drop", "5"]),
    ("gate-threshold-without-value", ["gate", "--model-uri", "models:/absent/1", "--threshold", "min_idc"]),
    ("gate-threshold-unknown-name", ["gate", "--model-uri", "models:/absent/1", "--threshold", "min_magic=0.5"]),
    ("gate-threshold-out-of-range", ["gate", "--model-uri", "models:/absent/1", "--threshold", "min_idc=2"]),
    ("layer-and-layers", [*COVERAGE, "--layer", "X", "--layers", "all"]),
    ("coverage-workers-negative", [*COVERAGE, "--workers", "-1"]),
    ("coverage-workers-with-per-class", [*COVERAGE, "--workers", "2", "--per-class"]),
    ("coverage-ray-address-garbage", [*COVERAGE, "--workers", "2", "--ray-address", "nowhere"]),
    ("coverage-trace-dir-is-a-file", [*COVERAGE, "--workers", "2", "--trace-dir", "{afile}"]),
    ("layer-unknown", [*COVERAGE, "--layer", "no_such_layer"]),
    ("coverage-too-few-correct-inputs", [*COVERAGE, "--criteria", "idc"]),
    ("demo-epochs-zero", ["demo", "--epochs", "0"]),
    ("demo-fuzz-seeds-zero", ["demo", "--fuzz-seeds", "0"]),
    ("seed-not-int", [*COVERAGE, "--seed", "x"]),
    ("device-unknown", [*COVERAGE, "--device", "tpu"]),
    ("device-cuda-index-not-a-number", [*FUZZ, "--device", "cuda:x"]),
    ("coverage-batch-size-zero", [*COVERAGE, "--batch-size", "0"]),
    ("coverage-criterion-setting-no-equals", [*COVERAGE, "--criterion-setting", "margin"]),
    ("coverage-criterion-setting-undeclared", [*COVERAGE, "--criterion-setting", "margin=0.5"]),
    # ---------------------------------------------------------------- preprocessing overrides
    ("preprocessing-no-equals", ["describe", "{pt}", "--preprocessing", "scale"]),
    ("preprocessing-unknown-field", ["describe", "{pt}", "--preprocessing", "gamma=2"]),
    ("preprocessing-scale-not-number", ["describe", "{pt}", "--preprocessing", "scale=big"]),
    ("preprocessing-wrong-input-shape", ["describe", "{pt}", "--preprocessing", "input_shape=28/28/1"]),
    ("preprocessing-unknown-layout", coverage("--preprocessing", "layout=sideways")),
    # ---------------------------------------------------------------- data specs
    ("data-unknown-kind", coverage(train="imagenet:/data")),
    ("data-empty-spec", coverage(train=" ")),
    ("data-digits-with-path", coverage(train="digits:/some/path")),
    ("data-npz-without-path", coverage(train="npz:")),
    ("data-mnist-missing-dir", coverage(train="mnist:/no/such/mnist")),
    ("data-mnist-no-idx-files", coverage(train="mnist:{empty_dir}")),
    ("data-mnist-truncated-gz", coverage(train="mnist:{mnist_gz}")),
    ("data-mnist-truncated-idx", coverage(train="mnist:{mnist_short}")),
    ("data-mnist-not-idx", coverage(train="mnist:{mnist_text}")),
    ("data-mnist-train-split-absent", coverage(train="mnist-train:{mnist_gz}")),
    ("coverage-per-class-without-idc", coverage("--criteria", "nc", "--per-class")),
    ("coverage-per-class-not-boolean", coverage("--per-class", "maybe")),
    ("data-slice-letters", coverage(train="digits[a:b]")),
    ("data-slice-step", coverage(train="digits[0:10:2]")),
    ("data-slice-empty", coverage(train="digits[5:5]")),
    ("data-npz-missing", coverage(train="npz:/no/such/file.npz")),
    ("data-npz-without-x-y", coverage(train="npz:{npz_noxy}")),
    ("data-npz-not-zip", coverage(train="npz:{npz_garbage}")),
    ("data-npz-nan", coverage(train="npz:{npz_nan}")),
    ("data-npz-label-count", coverage(train="npz:{npz_count}")),
    ("data-folder-no-class-dirs", coverage(train="folder:{folder_flat}")),
    ("data-folder-corrupt-image", coverage(train="folder:{folder_corrupt}")),
    ("data-folder-mixed-sizes", coverage(train="folder:{folder_sizes}")),
    ("data-cifar10-corrupt-batch", coverage(train="cifar10:{cifar_garbage}")),
    ("data-cifar10-truncated-batch", coverage(train="cifar10:{cifar_cut}")),
    ("data-cifar10-not-a-dict", coverage(train="cifar10:{cifar_list}")),
    ("generate-coverage-latest-of-a-file", [*GENERATE[:4], "latest", *GENERATE[5:]]),
    ("repair-campaign-latest-of-a-file", ["repair", "--compressed", "{pt}", "--campaign", "latest"]),
    ("repair-campaign-all-of-a-file", ["repair", "--compressed", "{pt}", "--campaign", "all"]),
    ("data-cifar10-runs-code", coverage(train="cifar10:{cifar_code}")),
    ("data-npz-complex-pixels", coverage(train="npz:{npz_complex}")),
    ("data-cifar10-no-batches", coverage(train="cifar10:{empty_dir}")),
    ("data-wrong-image-size", coverage(train="npz:{npz_28}")),
    ("fuzz-seed-data-wrong-size", [*FUZZ[:5], "--seed-data", "npz:{npz_28}"]),
    # ---------------------------------------------------------------- model references
    ("model-missing-file", ["describe", "/no/such/model.pt"]),
    ("model-unknown-suffix", ["describe", "{txt_model}"]),
    ("model-folder-without-mlmodel", ["describe", "{empty_dir}"]),
    ("model-text-as-pt", ["describe", "{text_pt}"]),
    ("model-text-as-pkl", coverage(model="{text_pkl}")),
    ("model-empty-pt", ["describe", "{empty_pt}"]),
    ("model-state-dict", ["describe", "{state_pt}"]),
    ("model-pickled-list", ["describe", "{list_pt}"]),
    ("model-keras-malformed", ["describe", "keras:lenet5"]),
    ("model-keras-missing-h5", ["describe", "keras:lenet5:missing.h5"]),
    ("model-keras-not-hdf5", ["describe", "keras:lenet5:{garbage_h5}"]),
    ("model-keras-unknown-arch", ["describe", "keras:vgg99:{garbage_h5}"]),
    ("model-registry-absent-version", ["describe", "models:/absent/1"]),
    ("model-registry-absent-alias", coverage(model="models:/absent@champion")),
    ("model-runs-absent", ["describe", "runs:/0123456789abcdef0123456789abcdef/model"]),
    ("model-onnx-for-coverage", coverage(model="{garbage_onnx}")),
    ("model-onnx-unsupported-operator", coverage(model="{erf_onnx}")),
    ("data-labels-beyond-the-model", coverage(train="npz:{npz_label_12}")),
    ("model-pt2-normalised-example", coverage(model="{normalised_pt2}")),
    ("model-signature-without-shape", coverage(model="{shapeless}")),
    ("model-onnx-for-compress", ["compress", "--model-uri", "{garbage_onnx}", "--method", "prune-l1"]),
    ("model-garbage-onnx-describe", ["describe", "{garbage_onnx}"]),
    ("model-garbage-tflite-fuzz", ["fuzz", "--original", "{pt}", "--compressed", "{garbage_tflite}",
                                   "--seed-data", "digits[0:4]"]),
    ("import-keras-weights-missing", ["import-keras", "--arch", "lenet5", "--weights", "/no/such.h5",
                                      "--register-as", "x"]),
    ("import-keras-weights-not-hdf5", ["import-keras", "--arch", "lenet5", "--weights", "{garbage_h5}",
                                       "--register-as", "x"]),
    # ---------------------------------------------------------------- outputs
    ("json-out-under-a-file", coverage("--json-out", "{afile}/out.json")),
    # outputs the OS refuses although permission bits allow them (as root every folder is writable)
    ("json-out-in-proc", coverage("--json-out", "/proc/mlflow-di/out.json")),
    ("json-out-in-sys", [*ROBUSTNESS, "--json-out", "/sys/mlflow-di.json"]),
    ("out-dir-in-proc", [*FUZZ, "--out-dir", "/proc/mlflow-di-campaign"]),
    ("fuzz-json-out-in-proc", [*FUZZ, "--json-out", "/proc/self/mlflow-di.json"]),
    ("gate-junit-xml-in-proc", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5",
                                "--junit-xml", "/proc/mlflow-di/gate.xml"]),
    ("json-out-is-a-dir", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5", "--json-out", "{adir}"]),
    ("out-dir-is-a-file", [*FUZZ, "--out-dir", "{afile}"]),
    ("out-dir-under-a-file", [*FUZZ, "--out-dir", "{afile}/campaign"]),
    # ---------------------------------------------------------------- gate
    ("gate-no-threshold", ["gate", "--model-uri", "models:/absent/1"]),
    ("gate-model-uri-a-file", ["gate", "--model-uri", "{pt}", "--min-idc", "0.5"]),
    ("gate-model-uri-absent", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5"]),
    ("gate-model-uri-absent-alias", ["gate", "--model-uri", "models:/absent@champion", "--max-success-rate", "0.1"]),
    ("gate-baseline-is-the-model", ["gate", "--model-uri", "models:/absent/1", "--baseline", "models:/absent/1",
                                    "--max-idc-drop", "0.1"]),
    ("gate-baseline-unknown-alias", ["gate", "--model-uri", "models:/absent/1", "--baseline", "models:/absent@champion",
                                     "--max-idc-drop", "0.1"]),
    ("gate-baseline-without-relative-threshold", ["gate", "--model-uri", "models:/absent/1", "--baseline",
                                                  "models:/absent/2", "--min-idc", "0.5"]),
    ("gate-relative-threshold-without-baseline", ["gate", "--model-uri", "models:/absent/1", "--max-idc-drop", "0.1"]),
    ("gate-max-idc-drop-above-one", ["gate", "--model-uri", "models:/absent/1", "--baseline", "models:/absent/2",
                                     "--max-idc-drop", "1.5"]),
    ("gate-min-mean-queries-ratio-zero", ["gate", "--model-uri", "models:/absent/1", "--baseline", "models:/absent/2",
                                          "--min-mean-queries-ratio", "0"]),
    ("gate-junit-xml-under-a-file", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5",
                                     "--junit-xml", "{afile}/gate.xml"]),
    ("gate-summary-md-is-a-dir", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5",
                                  "--summary-md", "{adir}"]),
    # ---------------------------------------------------------------- compress
    ("compress-int8-static-without-calib", ["compress", "--model-uri", "{pt}", "--method", "int8-static"]),
    ("compress-register-as-two-methods", ["compress", "--model-uri", "{pt}", "--method", "int8-static,prune-l1",
                                          "--calib-data", "digits[0:20]", "--register-as", "x"]),
    ("compress-calib-data-bad", ["compress", "--model-uri", "{pt}", "--method", "int8-static",
                                 "--calib-data", "digits[0:10:2]"]),
    ("compress-keep-float-unknown-layer", ["compress", "--model-uri", "{pt}", "--method", "int8-static",
                                           "--calib-data", "digits[0:20]", "--keep-float", "conv9"]),
    ("compress-keep-float-with-prune", ["compress", "--model-uri", "{pt}", "--method", "prune-l1",
                                        "--keep-float", "conv1.0"]),
    ("compress-auto-keep-float-negative", ["compress", "--model-uri", "{pt}", "--method", "int8-static",
                                           "--calib-data", "digits[0:20]", "--auto-keep-float", "-1"]),
    ("compress-triggers-not-a-campaign", ["compress", "--model-uri", "{pt}", "--method", "int8-static",
                                          "--calib-data", "digits[0:20]", "--triggers", "{empty_dir}"]),
    ("compress-bound-nan", ["compress", "--model-uri", "{pt}", "--method", "int8-static", "--calib-data",
                            "digits[0:20]", "--holdout-data", "digits[20:40]", "--max-disagreement-rate", "nan"]),
    ("compress-bound-negative", ["compress", "--model-uri", "{pt}", "--method", "int8-static", "--calib-data",
                                 "digits[0:20]", "--holdout-data", "digits[20:40]", "--max-accuracy-drop", "-0.01"]),
    ("compress-bound-with-prune", ["compress", "--model-uri", "{pt}", "--method", "prune-l1",
                                   "--holdout-data", "digits[20:40]", "--max-disagreement-rate", "0.01"]),
    ("compress-bound-without-holdout", ["compress", "--model-uri", "{pt}", "--method", "int8-static",
                                        "--calib-data", "digits[0:20]", "--max-disagreement-rate", "0.01"]),
    ("compress-bound-with-keep-float", ["compress", "--model-uri", "{pt}", "--method", "int8-static",
                                        "--calib-data", "digits[0:20]", "--holdout-data", "digits[20:40]",
                                        "--max-disagreement-rate", "0.01", "--keep-float", "conv1.0"]),
    ("compress-holdout-without-bound", ["compress", "--model-uri", "{pt}", "--method", "int8-static",
                                        "--calib-data", "digits[0:20]", "--holdout-data", "digits[20:40]"]),
    # ---------------------------------------------------------------- fuzz
    ("fuzz-out-dir-holds-campaign", [*FUZZ, "--out-dir", "{campaign}"]),
    ("fuzz-resume-nothing", [*FUZZ, "--resume"]),
    ("fuzz-max-linf-zero", [*FUZZ, "--max-linf", "0"]),
    ("fuzz-max-linf-above-255", [*FUZZ, "--max-linf", "300"]),
    ("fuzz-min-ssim-one", [*FUZZ, "--min-ssim", "1"]),
    ("fuzz-min-ssim-nan", [*FUZZ, "--strategy", "boundary", "--min-ssim", "nan"]),
    ("fuzz-max-linf-negative", [*FUZZ, "--strategy", "boundary", "--max-linf", "-4"]),
    ("fuzz-min-ssim-on-8x8-digits", [*FUZZ, "--min-ssim", "0.5"]),
    ("fuzz-constraint-with-diffchaser", [*FUZZ, "--max-linf", "30", "--strategy", "diffchaser"]),
    ("fuzz-same-compressed-twice", [*FUZZ, "--compressed", "{pt}"]),
    ("fuzz-deepxplore-tflite-model", [*FUZZ[:3], "--compressed", "{garbage_tflite}", *FUZZ[5:], "--strategy", "deepxplore"]),
    ("fuzz-dx-option-without-deepxplore", [*FUZZ, "--dx-step", "5"]),
    ("fuzz-dx-occlusion-size-one-number", [*FUZZ, "--strategy", "deepxplore", "--dx-occlusion-size", "3"]),
    ("fuzz-dx-occlusion-outside-the-seeds", [*FUZZ, "--strategy", "deepxplore", "--dx-constraint", "occlusion",
                                             "--dx-occlusion-at", "9,0"]),
    ("fuzz-dx-with-max-linf", [*FUZZ, "--strategy", "deepxplore", "--max-linf", "20"]),
    ("fuzz-dx-constraint-unknown", [*FUZZ, "--strategy", "deepxplore", "--dx-constraint", "fog"]),
    ("fuzz-dx-threshold-one", [*FUZZ, "--strategy", "deepxplore", "--dx-threshold", "1"]),
    ("fuzz-dx-finer-steps-negative", [*FUZZ, "--strategy", "deepxplore", "--dx-finer-steps", "255,-1"]),
    ("fuzz-overlap-with-deepxplore", [*FUZZ, "--strategy", "deepxplore", "--overlap"]),
    ("fuzz-boundary-tflite-original", ["fuzz", "--original", "{garbage_tflite}", *FUZZ[3:], "--strategy", "boundary"]),
    ("fuzz-boundary-workers", [*FUZZ, "--strategy", "boundary", "--workers", "2"]),
    ("fuzz-boundary-min-ssim-on-8x8", [*FUZZ, "--strategy", "boundary", "--min-ssim", "0.9"]),
    ("fuzz-boundary-max-linf-zero", [*FUZZ, "--strategy", "boundary", "--max-linf", "0"]),
    ("gate-max-realistic-success-rate-above-one", ["gate", "--model-uri", "models:/absent/1",
                                                   "--max-realistic-success-rate", "1.5"]),
    ("gate-max-realistic-success-rate-nan", ["gate", "--model-uri", "models:/absent/1",
                                             "--max-realistic-success-rate", "nan"]),
    # ---------------------------------------------------------------- inspect
    ("inspect-hypotheses-module-absent", [*INSPECT, "--hypotheses", "no_such_module_xyz:HYPOTHESES"]),
    ("inspect-hypotheses-not-module-attribute", [*INSPECT, "--hypotheses", "just_a_name"]),
    ("inspect-hypotheses-repeated", [*INSPECT, "--hypotheses", "builtin", "--hypotheses", "builtin"]),
    ("inspect-layer-absent", [*INSPECT, "--layer", "nope"]),
    ("inspect-measure-unknown", [*INSPECT, "--measures", "kendall"]),
    ("inspect-tolerance-zero", [*INSPECT, "--tolerance", "0"]),
    ("inspect-confidence-one", [*INSPECT, "--confidence", "1"]),
    ("inspect-top-m-above-layer", [*INSPECT, "--units", "important", "--top-m", "9999"]),
    ("inspect-coverage-run-absent", [*INSPECT, "--coverage", "0123456789abcdef0123456789abcdef"]),
    ("inspect-coverage-folder-without-idc", [*INSPECT, "--coverage", "{empty_dir}"]),
    # ---------------------------------------------------------------- generate
    ("generate-coverage-run-absent", GENERATE),
    ("generate-coverage-folder-without-idc", [*GENERATE, "--coverage", "{empty_dir}"]),
    ("generate-budget-zero", [*GENERATE, "--budget", "0"]),
    ("generate-num-seeds-zero", [*GENERATE, "--num-seeds", "0"]),
    ("generate-data-wrong-size", [*GENERATE[:-1], "npz:{npz_28}"]),
    # ---------------------------------------------------------------- repair
    ("repair-campaign-absent", ["repair", "--compressed", "{garbage_onnx}", "--campaign", "{empty_dir}/none"]),
    ("repair-campaign-folder-empty", ["repair", "--compressed", "{garbage_onnx}", "--campaign", "{empty_dir}"]),
    # ---------------------------------------------------------------- robustness
    ("robustness-unknown-corruption", [*ROBUSTNESS, "--corruptions", "jpeg,fog"]),
    ("robustness-no-corruption", [*ROBUSTNESS, "--corruptions", ","]),
    ("robustness-severity-zero", [*ROBUSTNESS, "--severities", "0"]),
    ("robustness-severity-six", [*ROBUSTNESS, "--severities", "1,6"]),
    ("robustness-severity-not-int", [*ROBUSTNESS, "--severities", "high"]),
    ("robustness-no-images", [*ROBUSTNESS[:-1], "digits[4:4]"]),
    ("robustness-num-images-zero", [*ROBUSTNESS, "--num-images", "0"]),
    ("robustness-compressed-twice", [*ROBUSTNESS, "--compressed", "{pt}"]),
    ("robustness-data-wrong-size", [*ROBUSTNESS[:-1], "npz:{npz_28}"]),
    ("gate-min-robustness-agreement-above-one", ["gate", "--model-uri", "models:/absent/1",
                                                 "--min-robustness-agreement", "1.5"]),
    # ---------------------------------------------------------------- pipeline
    ("pipeline-policy-missing", ["pipeline", "--policy", "{empty_dir}/absent.yaml", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-unknown-key", ["pipeline", "--policy", "{policy_unknown_key}", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-bad-value", ["pipeline", "--policy", "{policy_bad_value}", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-out-of-range", ["pipeline", "--policy", "{policy_out_of_range}", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-bad-criterion-setting", ["pipeline", "--policy", "{policy_bad_criterion_setting}", "--model-uri",
                                               "models:/m/1"]),
    ("pipeline-policy-bad-method-option", ["pipeline", "--policy", "{policy_bad_method_option}", "--model-uri",
                                           "models:/m/1"]),
    ("pipeline-policy-preprocessing-unknown-key", ["pipeline", "--policy", "{policy_preprocessing_key}",
                                                   "--model-uri", "models:/m/1"]),
    # ---------------------------------------------------------------- serve (refused before any port is bound)
    ("serve-policy-unknown-key", ["serve", "--policy", "{policy_unknown_key}", "--state-dir", "{empty_dir}/service"]),
    ("pipeline-policy-alias-bomb", ["pipeline", "--policy", "{policy_alias_bomb}", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-recursive-alias", ["pipeline", "--policy", "{policy_recursive}", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-dev-zero", ["pipeline", "--policy", "/dev/zero", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-fifo", ["pipeline", "--policy", "{policy_fifo}", "--model-uri", "models:/m/1"]),
    ("serve-policy-fifo", ["serve", "--policy", "{policy_fifo}"]),
    ("pipeline-policy-duplicate-section", ["pipeline", "--policy", "{policy_duplicate_gate}", "--model-uri",
                                           "models:/m/1"]),
    ("pipeline-policy-huge-integer", ["pipeline", "--policy", "{policy_huge_integer}", "--model-uri", "models:/m/1"]),
    ("data-npz-dev-zero", coverage(train="npz:/dev/zero")),
    ("json-out-dev-full", coverage("--criteria", "nc", "--json-out", "/dev/full")),
    ("compress-recipe-unknown", ["compress", "--model-uri", "{pt}", "--method", "int8-static", "--calib-data",
                                 "digits[0:20]", "--recipe", "s4s4"]),
    ("compress-method-option-without-its-method", ["compress", "--model-uri", "{pt}", "--method", "fp32",
                                                   "--recipe", "s8s8"]),
    ("compress-calibration-unknown", ["compress", "--model-uri", "{pt}", "--method", "int8-static", "--calib-data",
                                      "digits[0:20]", "--calibration", "kl"]),
    ("compress-semantics-unknown", ["compress", "--model-uri", "{pt}", "--method", "int8-static", "--calib-data",
                                    "digits[0:20]", "--semantics", "vnni"]),
    ("gate-min-speedup-zero", ["gate", "--model-uri", "models:/absent/1", "--min-speedup", "0"]),
    ("gate-semantics-unknown", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5", "--semantics", "cpu"]),
    ("fuzz-semantics-reference-of-a-pytorch-model", [*FUZZ, "--semantics", "reference"]),
    ("data-npz-header-claims-a-huge-shape", coverage(train="npz:{npz_huge_header}")),
    ("data-npz-fractional-labels", coverage(train="npz:{npz_half_labels}")),
    ("data-slice-of-5000-digits", coverage(train="digits[0:" + "9" * 5000 + "]")),
    ("data-folder-decompression-bomb", coverage(train="folder:{folder_bomb}")),
    ("preprocessing-resize-huge", [*COVERAGE, "--preprocessing", "resize=99999999999"]),
    # ---------------------------------------------------------------- fifth round: bombs, special files, names
    ("data-npz-zip-bomb", coverage(train="npz:{npz_zip_bomb}")),
    ("data-folder-fifo", coverage(train="folder:{folder_fifo}")),
    ("model-signature-50000-wide", ["describe", "{wide_signature}"]),
    ("compress-register-as-newline", ["compress", "--model-uri", "{pt}", "--method", "prune-l1", "--register-as", "a\nb"]),
    ("compress-register-as-empty", ["compress", "--model-uri", "{pt}", "--method", "prune-l1", "--register-as", ""]),
    ("compress-register-as-slash", ["compress", "--model-uri", "{pt}", "--method", "prune-l1", "--register-as",
                                    "team/digits"]),
    ("repair-register-as-dot-dot", ["repair", "--compressed", "{pt}", "--campaign", "{campaign}", "--register-as", ".."]),
    ("import-keras-register-as-escape", ["import-keras", "--arch", "lenet1", "--weights", "{garbage_h5}",
                                         "--register-as", "x\x1b[2J"]),
    ("gate-max-accuracy-drop-negative", ["gate", "--model-uri", "models:/absent/1", "--max-accuracy-drop", "-1"]),
    ("gate-max-class-accuracy-drop-negative", ["gate", "--model-uri", "models:/absent/1", "--max-class-accuracy-drop",
                                               "-0.5"]),
    ("serve-policy-alias-bomb", ["serve", "--policy", "{policy_alias_bomb}", "--state-dir", "{empty_dir}/service"]),
    ("serve-policy-missing", ["serve", "--policy", "{empty_dir}/absent.yaml", "--state-dir", "{empty_dir}/service"]),
    ("serve-webhook-secret-unset", ["serve", "--policy", "{policy_ok}", "--state-dir", "{empty_dir}/service",
                                    "--webhook-secret-env", "MLFLOW_DI_NO_SUCH_SECRET_VARIABLE"]),
    ("serve-register-webhook-without-secret", ["serve", "--policy", "{policy_ok}", "--state-dir", "{empty_dir}/service",
                                               "--register-webhook", "http://127.0.0.1:9/webhook"]),
    ("serve-register-webhook-not-a-url", ["serve", "--policy", "{policy_ok}", "--state-dir", "{empty_dir}/service",
                                          "--register-webhook", "127.0.0.1:9/webhook"]),
    ("serve-nothing-brings-jobs", ["serve", "--policy", "{policy_ok}", "--state-dir", "{empty_dir}/service",
                                   "--poll-seconds", "0"]),
    ("serve-workers-zero", ["serve", "--policy", "{policy_ok}", "--workers", "0"]),
    ("serve-ray-address-garbage", ["serve", "--policy", "{policy_ok}", "--ray-address", "nowhere"]),
    ("serve-ray-address-unreachable", ["serve", "--policy", "{policy_ok}", "--state-dir", "{empty_dir}/service",
                                       "--ray-address", "127.0.0.1:9"]),
    ("serve-port-out-of-range", ["serve", "--policy", "{policy_ok}", "--port", "70000"]),
    ("serve-poll-seconds-negative", ["serve", "--policy", "{policy_ok}", "--poll-seconds", "-5"]),
    ("serve-max-attempts-zero", ["serve", "--policy", "{policy_ok}", "--max-attempts", "0"]),
    ("serve-state-dir-is-a-file", ["serve", "--policy", "{policy_ok}", "--state-dir", "{afile}"]),
    # ---------------------------------------------------------------- tracking store
    ("tracking-server-down", ["--tracking-uri", "http://127.0.0.1:9", "gate", "--model-uri", "models:/m/1",
                              "--min-idc", "0.5"]),
    ("tracking-timeout-nan", ["--tracking-uri", "http://127.0.0.1:9", "--tracking-timeout", "nan", "gate",
                              "--model-uri", "models:/m/1", "--min-idc", "0.5"]),
    ("tracking-server-down-describe", ["--tracking-uri", "http://127.0.0.1:9", "describe", "models:/m/1"]),
    # ---------------------------------------------------------------- hardening, fourth round
    ("fuzz-model-answers-nan", ["fuzz", "--original", "{nan_onnx}", "--compressed", "{nan_onnx}", "--seed-data",
                                "digits[0:4]"]),
    ("robustness-nan-original-inf-compressed", ["robustness", "--model-uri", "{nan_onnx}", "--compressed", "{inf_onnx}",
                                                "--data", "digits[0:4]"]),
    ("coverage-model-answers-nan", coverage(model="{nan_onnx}")),
    ("compress-model-answers-nan", ["compress", "--model-uri", "{nan_onnx}", "--method", "int8-dynamic", "--eval-data",
                                    "digits[0:20]", "--no-benefit"]),
    ("coverage-custom-onnx-operator", coverage(model="{custom_op_onnx}")),
    ("fuzz-channel-mismatch", ["fuzz", "--original", "{rgb_onnx}", "--compressed", "{rgb_onnx}", "--seed-data",
                               "digits[0:4]"]),
    ("describe-garbage-pt2", ["describe", "{garbage_pt2}"]),
    ("describe-mlmodel-data-outside", ["describe", "{data_outside}"]),
    ("pipeline-policy-not-utf8", ["pipeline", "--policy", "{policy_not_utf8}", "--model-uri", "models:/m/1"]),
    ("pipeline-policy-nul", ["pipeline", "--policy", "{policy_nul}", "--model-uri", "models:/m/1"]),
    ("serve-policy-escape", ["serve", "--policy", "{policy_escape}", "--state-dir", "{empty_dir}/service"]),
    ("pipeline-policy-bad-alias", ["pipeline", "--policy", "{policy_bad_alias}", "--model-uri", "models:/m/1"]),
    ("gate-promote-alias-invalid", ["gate", "--model-uri", "models:/absent/1", "--min-idc", "0.5", "--promote-alias",
                                    "bad alias <script>"]),
    ("gate-model-name-with-newline", ["gate", "--model-uri", "models:/two\nlines/1", "--min-idc", "0.5"]),
    ("describe-model-name-with-escape", ["describe", "models:/clear\x1b[2Jscreen/1"]),
]

#: What the one error line must name, for cases where a later, different error could hide the
#: intended one (the command would otherwise go on and fail elsewhere).
FRAGMENTS = {
    "fuzz-unknown-runtime": "unknown runtime 'tensorrt'",
    "compress-runtime-bad-precision": "offers the precisions default, f32, bf16, not 'int4'",
    "compress-runtime-twice": "names openvino twice",
    "gate-unknown-runtime": "unknown runtime 'tflite-gpu'",
    "fuzz-runtime-of-a-pytorch-model": "opens onnx models, not",
    "pipeline-workers-not-a-count": "neither a count (0 or more) nor 'policy'",
    "fuzz-model-answers-nan": "answered NaN or Inf on 4 of 4 images",
    "robustness-nan-original-inf-compressed": "answered NaN or Inf",
    "coverage-model-answers-nan": "answered NaN or Inf",
    "compress-model-answers-nan": "answered NaN or Inf",
    "coverage-custom-onnx-operator": "ONNX Runtime cannot run it either",
    "fuzz-channel-mismatch": "images have 1 channel(s) but the model expects 3",
    "describe-garbage-pt2": "cannot read the pt2 (torch.export) model",
    "describe-mlmodel-data-outside": "outside the model's folder",
    "pipeline-policy-not-utf8": "not UTF-8 text",
    "pipeline-policy-nul": "a control character ('\\x00')",
    "serve-policy-escape": "a control character ('\\x1b')",
    "pipeline-policy-bad-alias": "gate.promote_alias",
    "gate-promote-alias-invalid": "is not an alias MLflow accepts",
    "gate-model-name-with-newline": "models:/two\\x0alines/1",
    "describe-model-name-with-escape": "clear\\x1b[2Jscreen",
    "pipeline-policy-dev-zero": "is a device, not a regular file",
    "pipeline-policy-fifo": "is a FIFO, not a regular file",
    "serve-policy-fifo": "is a FIFO, not a regular file",
    "pipeline-policy-duplicate-section": "'gate' is given twice (lines 1 and 2)",
    "pipeline-policy-huge-integer": "5,000 characters long",
    "data-npz-dev-zero": "is a device, not a regular file",
    "json-out-dev-full": "No space left on device",
    "compress-recipe-unknown": "Invalid value for '--recipe': 's4s4' is not one of 'u8u8'",
    "compress-method-option-without-its-method": "--recipe is an option of int8-static; add it to --method (got fp32)",
    "compress-calibration-unknown": "Invalid value for '--calibration': 'kl' is not one of 'minmax'",
    "compress-semantics-unknown": "--semantics",
    "gate-min-speedup-zero": "--min-speedup",
    "gate-semantics-unknown": "--semantics",
    "fuzz-semantics-reference-of-a-pytorch-model": "--semantics reference applies to ONNX compressed models",
    "data-npz-header-claims-a-huge-shape": "claims shape (1000000000, 28, 28)",
    "data-npz-fractional-labels": "has label 0.5 (image 1)",
    "data-slice-of-5000-digits": "more than 18 digits",
    "data-folder-decompression-bomb": "too big to decode safely",
    "preprocessing-resize-huge": "from 1 to 16384",
    "gate-max-accuracy-drop-negative": "--max-accuracy-drop",
    "gate-max-class-accuracy-drop-negative": "--max-class-accuracy-drop",
    "data-labels-beyond-the-model": "has labels 0..12 but the model has 10 outputs",
    "pipeline-policy-preprocessing-unknown-key": "unknown key preprocessing.m.colour",
    "model-onnx-unsupported-operator": "ONNX operator Erf",
    "model-pt2-normalised-example": "normalised with a mean and std",
    "model-signature-without-shape": "input shape unknown",
    "workers-negative": "--workers",
    "ray-address-garbage": "--ray-address",
    "gpus-per-worker-negative": "--gpus-per-worker",
    "workers-with-deepxplore": "--workers",
    "json-out-under-a-file": "--json-out",
    "json-out-in-proc": "--json-out",
    "json-out-in-sys": "--json-out",
    "out-dir-in-proc": "--out-dir",
    "fuzz-json-out-in-proc": "--json-out",
    "gate-junit-xml-in-proc": "--junit-xml",
    "json-out-is-a-dir": "--json-out",
    "out-dir-is-a-file": "--out-dir",
    "out-dir-under-a-file": "--out-dir",
    "layer-and-layers": "--layers",
    "coverage-workers-negative": "--workers",
    "coverage-workers-with-per-class": "--per-class",
    "coverage-ray-address-garbage": "--ray-address",
    "coverage-trace-dir-is-a-file": "--trace-dir",
    "gate-no-threshold": "threshold",
    "gate-min-idc-above-one": "--min-idc",
    "gate-threshold-without-value": "NAME=VALUE",
    "gate-threshold-unknown-name": "unknown threshold min_magic",
    "gate-threshold-out-of-range": "--min-idc is a fraction",
    "fuzz-out-dir-holds-campaign": "--resume",
    "fuzz-resume-nothing": "nothing to resume",
    "fuzz-max-linf-zero": "--max-linf",
    "fuzz-max-linf-above-255": "--max-linf",
    "fuzz-min-ssim-one": "--min-ssim",
    "fuzz-min-ssim-on-8x8-digits": "11x11",
    "fuzz-overlap-with-deepxplore": "--overlap applies to the black-box strategies",
    "fuzz-constraint-with-diffchaser": "dflare strategies",
    "fuzz-same-compressed-twice": "given twice",
    "fuzz-deepxplore-tflite-model": "needs the gradients of PyTorch models",
    "fuzz-dx-option-without-deepxplore": "setting of --strategy deepxplore",
    "fuzz-dx-occlusion-size-one-number": "occlusion size",
    "fuzz-dx-finer-steps-negative": "each step must be a positive number",
    "fuzz-dx-occlusion-outside-the-seeds": "outside the 8x8",
    "fuzz-dx-with-max-linf": "--dx-constraint",
    "fuzz-boundary-tflite-original": "needs the gradients of PyTorch models",
    "fuzz-boundary-workers": "boundary runs in this process",
    "fuzz-boundary-min-ssim-on-8x8": "--min-ssim needs images of at least 11x11",
    "fuzz-boundary-max-linf-zero": "--max-linf",
    "gate-max-realistic-success-rate-above-one": "--max-realistic-success-rate",
    "fuzz-dx-constraint-unknown": "--dx-constraint",
    "fuzz-dx-threshold-one": "--dx-threshold",
    "tracking-server-down": "http://127.0.0.1:9",
    "timeout-nan": "--timeout",
    "fuzz-min-ssim-nan": "--min-ssim",
    "fuzz-max-linf-negative": "--max-linf",
    "timeout-inf": "--timeout",
    "fuzz-seed-negative": "--seed",
    "gate-min-mean-queries-nan": "--min-mean-queries",
    "gate-max-disagreement-rate-above-one": "--max-disagreement-rate",
    "gate-runs-not-run-ids": "--runs",
    "serve-poll-seconds-inf": "--poll-seconds",
    "data-cifar10-runs-code": "builtins.print",
    "data-npz-complex-pixels": "real numbers",
    "tracking-server-down-describe": "does not answer",
    "tracking-timeout-nan": "--tracking-timeout",
    "compress-int8-static-without-calib": "--calib-data",
    "compress-register-as-two-methods": "--register-as",
    "compress-keep-float-unknown-layer": "'conv9'",
    "compress-keep-float-with-prune": "int8-static only",
    "compress-auto-keep-float-negative": "--auto-keep-float",
    "compress-triggers-not-a-campaign": "holds no fuzzing campaign",
    "data-wrong-image-size": "28x28",
    "data-mnist-truncated-gz": "gzip",
    "data-mnist-train-split-absent": "no MNIST train split",
    "coverage-per-class-without-idc": "--per-class",
    "coverage-per-class-not-boolean": "--per-class",
    "fuzz-seed-data-wrong-size": "28x28",
    "device-unknown": "--device",
    "device-cuda-index-not-a-number": "cpu, cuda or cuda:N",
    "coverage-batch-size-zero": "--batch-size",
    "coverage-criterion-setting-no-equals": "as FIELD=VALUE",
    "coverage-criterion-setting-undeclared": "unknown criterion setting 'margin'; choose one of: nc_threshold, kmnc_sections",
    "inspect-hypotheses-module-absent": "no_such_module_xyz",
    "inspect-hypotheses-not-module-attribute": "MODULE:ATTRIBUTE",
    "inspect-hypotheses-repeated": "unique",
    "inspect-layer-absent": "'nope'",
    "inspect-measure-unknown": "--measures",
    "inspect-tolerance-zero": "--tolerance",
    "inspect-confidence-one": "--confidence",
    "inspect-top-m-above-layer": "--top-m",
    "inspect-coverage-run-absent": "0123456789abcdef0123456789abcdef",
    "inspect-coverage-folder-without-idc": "idc.json",
    "generate-coverage-run-absent": "0123456789abcdef0123456789abcdef",
    "generate-coverage-latest-of-a-file": "--coverage latest needs a registered model version",
    "repair-campaign-latest-of-a-file": "--campaign latest needs a registered model version",
    "repair-campaign-all-of-a-file": "--campaign all needs a registered model version",
    "generate-coverage-folder-without-idc": "idc.json",
    "generate-budget-zero": "--budget",
    "generate-num-seeds-zero": "--num-seeds",
    "generate-data-wrong-size": "28x28",
    "repair-campaign-absent": "none",
    "repair-campaign-folder-empty": "campaign",
    "robustness-unknown-corruption": "'fog'",
    "robustness-no-corruption": "--corruptions",
    "robustness-severity-zero": "--severities",
    "robustness-severity-six": "from 1 to 5",
    "robustness-severity-not-int": "--severities",
    "robustness-no-images": "digits[4:4]",
    "robustness-num-images-zero": "--num-images",
    "robustness-compressed-twice": "named twice",
    "robustness-data-wrong-size": "28x28",
    "gate-min-robustness-agreement-above-one": "--min-robustness-agreement",
    "gate-baseline-is-the-model": "the candidate itself",
    "gate-baseline-unknown-alias": "--baseline: cannot find models:/absent@champion",
    "gate-baseline-without-relative-threshold": "needs a relative threshold",
    "gate-relative-threshold-without-baseline": "--max-idc-drop compare(s) with a baseline",
    "gate-max-idc-drop-above-one": "--max-idc-drop",
    "gate-min-mean-queries-ratio-zero": "--min-mean-queries-ratio",
    "gate-junit-xml-under-a-file": "--junit-xml",
    "pipeline-policy-missing": "absent.yaml",
    "pipeline-policy-alias-bomb": "aliases expand to more than 10,000 values",
    "pipeline-policy-recursive-alias": "cannot be recursive",
    "serve-policy-alias-bomb": "aliases expand to more than 10,000 values",
    "pipeline-policy-unknown-key": "unknown-key.yaml: unknown key fuzz.budget",
    "pipeline-policy-bad-value": "bad-value.yaml: fuzz.max_queries must be an integer, got 'ten'",
    "pipeline-policy-out-of-range": "out-of-range.yaml: fuzz.num_seeds: 0 is not in the range x>=1",
    "pipeline-policy-bad-criterion-setting": ("bad-setting.yaml: coverage.criterion_settings: criterion setting's "
                                              "kmnc_sections must be at least 1, got 0"),
    "pipeline-policy-bad-method-option": "bad-recipe.yaml: compress.recipe: 's4s4' is not one of 'u8u8'",
    "gate-summary-md-is-a-dir": "--summary-md",
    "serve-policy-unknown-key": "unknown-key.yaml: unknown key fuzz.budget",
    "serve-policy-missing": "absent.yaml",
    "serve-webhook-secret-unset": "MLFLOW_DI_NO_SUCH_SECRET_VARIABLE is not set",
    "serve-register-webhook-without-secret": "--webhook-secret-env",
    "serve-register-webhook-not-a-url": "--register-webhook",
    "serve-nothing-brings-jobs": "--poll-seconds 0",
    "serve-workers-zero": "--workers",
    "serve-ray-address-garbage": "--ray-address",
    "serve-ray-address-unreachable": "cannot reach the Ray cluster at '127.0.0.1:9'",
    "serve-port-out-of-range": "--port",
    "serve-poll-seconds-negative": "--poll-seconds",
    "serve-max-attempts-zero": "--max-attempts",
    "serve-state-dir-is-a-file": "--state-dir",
    "data-npz-zip-bomb": "array 'y' of shape (150000000,) would take 1.1 GiB",
    "data-folder-fifo": "pipe.png' is a FIFO",
    "model-signature-50000-wide": "50000x50000x1",
    "compress-register-as-newline": "control character \\x0a",
    "compress-register-as-empty": "it is empty",
    "compress-register-as-slash": "'/'",
    "repair-register-as-dot-dot": "path step",
    "import-keras-register-as-escape": "\\x1b",
}

#: Cases the current code gets wrong (kept, asserted, reported; remove once fixed).
KNOWN_BUGS: dict[str, str] = {}  # case id -> why it still fails (strict xfail); empty: every case holds


def _params() -> list:
    return [pytest.param(argv, id=case_id, marks=[pytest.mark.xfail(strict=True, reason=f"bug: {KNOWN_BUGS[case_id]}")]
                         if case_id in KNOWN_BUGS else []) for case_id, argv in CASES]


def test_case_ids_are_unique():
    ids = [case_id for case_id, _ in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 50


def running_runs(uri: str) -> list:
    """Runs in status RUNNING in any experiment of the store at ``uri`` (none when it has no experiments)."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(uri)
    experiments = client.search_experiments(view_type=ViewType.ALL)
    if not experiments:
        return []
    return client.search_runs([e.experiment_id for e in experiments], "attributes.status = 'RUNNING'",
                              run_view_type=ViewType.ALL)


@pytest.mark.parametrize("argv", _params())
def test_bad_input(argv, request, assets, tracking_uri, capsys, record_property):
    import mlflow

    case_id = request.node.callspec.id
    args = [arg.format(**assets) for arg in argv]
    started = time.perf_counter()
    try:
        code = main(args)
    except BaseException as exc:  # noqa: BLE001 - the console script would print a traceback
        code = f"raised {type(exc).__name__}: {str(exc)[:300]}"
    seconds = time.perf_counter() - started
    err = capsys.readouterr().err
    lines = err.splitlines()
    record_property("error_line", lines[-1] if lines else "")
    problems = []
    if code != 2:
        problems.append(f"exit {code!r}, not 2")
    if "Traceback" in err:
        problems.append("a traceback on stderr")
    if len(lines) != 1 or not lines[0].startswith(PREFIX) or not lines[0][len(PREFIX):].strip():
        problems.append(f"stderr is {len(lines)} line(s), not one '{PREFIX}...' line")
    elif case_id in FRAGMENTS and FRAGMENTS[case_id] not in lines[0]:
        problems.append(f"the error is not about {FRAGMENTS[case_id]!r}")
    if mlflow.active_run() is not None:
        problems.append(f"run {mlflow.active_run().info.run_id} is still active in the process")
    running = running_runs(tracking_uri)
    if running:
        problems.append(f"{len(running)} run(s) left RUNNING: {[r.info.run_name for r in running]}")
    if any(arg.startswith("http://127.0.0.1:9") for arg in args) and seconds >= 15:
        problems.append(f"a dead tracking server took {seconds:.1f} s to report")
    assert not problems, "; ".join(problems) + f" (after {seconds:.1f} s); stderr:\n{err}"


#: A few cases again as the console script runs them (a fresh process, real stderr): in process,
#: pytest keeps Python warnings and library log handlers off ``capsys``; here they would show.
SUBPROCESS_CASES = ["data-mnist-truncated-gz", "model-state-dict", "gate-model-uri-absent", "tracking-server-down"]


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_bad_input_in_a_fresh_process(case_id, assets, tracking_uri):
    argv = dict(CASES)[case_id]
    args = [arg.format(**assets) for arg in argv]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mlflow_di.cli", *args], capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - started
    lines = done.stderr.splitlines()
    shown = f"exit {done.returncode} after {seconds:.1f} s; stderr:\n{done.stderr}"
    assert done.returncode == 2, shown
    assert len(lines) == 1 and lines[0].startswith(PREFIX) and "Traceback" not in done.stderr, shown
    assert running_runs(tracking_uri) == [], shown


def test_a_second_process_on_a_running_campaign_is_one_line_naming_the_first(assets, tracking_uri, tmp_path, capsys):
    """``--resume`` while the campaign's first process still runs: refused before any run is touched."""
    folder = tmp_path / "campaign"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mlflow_di.folder_lock import FolderLock; "
         f"FolderLock({str(folder)!r}, 'x').acquire(); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main([arg.format(**assets) for arg in FUZZ] + ["--out-dir", str(folder), "--resume"])
    finally:
        holder.kill()
        holder.wait()
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"another mlflow-di process (pid {holder.pid})" in lines[0] and "--out-dir" in lines[0]
    assert running_runs(tracking_uri) == []
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert not experiments or not client.search_runs(experiments)  # no run started, none closed as orphaned


@pytest.fixture()
def impostor_server():
    """A server on 127.0.0.1 that is not (quite) MLflow: ``/health`` answers what ``health`` says
    (status, body) and every other path hangs until the test ends."""
    import http.server
    import threading

    release = threading.Event()
    behaviour = {"health": (200, b"OK")}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                status, body = behaviour["health"]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                release.wait(60)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", behaviour
    release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("health, fragment", [
    ((404, b"<html>not found</html>"), "is not an MLflow tracking server: /health answered 404"),
    ((200, b"<html>welcome to nginx</html>"), "is not an MLflow tracking server"),
    ((200, b"OK"), "answers /health but not its API (no reply within"),
], ids=["health-404", "health-not-mlflow", "api-hangs"])
def test_a_tracking_server_that_is_not_mlflow_or_hangs_is_one_line_naming_it(impostor_server, health, fragment,
                                                                             capsys, tracking_uri):
    uri, behaviour = impostor_server
    behaviour["health"] = health
    started = time.perf_counter()
    code = main(["--tracking-uri", uri, "--tracking-timeout", "3", "gate", "--model-uri", "models:/m/1",
                 "--min-idc", "0.5"])
    seconds = time.perf_counter() - started
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(PREFIX), lines
    assert fragment in lines[0] and uri in lines[0] and "models:/m/1" not in lines[0]
    assert seconds < 10, f"took {seconds:.1f} s with --tracking-timeout 3"


@pytest.mark.parametrize("name", ["team\nnightly", "", "tab\there"], ids=["newline", "empty", "tab"])
def test_an_experiment_name_no_one_can_type_is_refused_before_any_run(name, assets, tracking_uri, capsys, monkeypatch):
    """MLFLOW_EXPERIMENT_NAME with a control character (or empty) is one line and exit 2 before any work: no
    experiment of that name, no run."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    code = main([arg.format(**assets) for arg in COVERAGE])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(PREFIX) and "cannot name an experiment" in lines[0]
    assert MlflowClient(tracking_uri).get_experiment_by_name(name) is None and running_runs(tracking_uri) == []
