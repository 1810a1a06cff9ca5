"""Model layer: each backend gives the same probabilities from raw images; the loader resolves
files and MLflow URIs and carries the preprocessing; bad references fail in one line."""
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import mlflow_di
from mlflow_di.mlflow_edge import models as edge_models, runs as tracking
from mlflow_di.errors import UserError
from mlflow_di.models.classifier import OnnxClassifier, TFLiteClassifier, TorchClassifier
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel

PREP = Preprocessing(input_shape=(4, 4, 1))


def tiny_torch(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 3))


def tiny_onnx(module: nn.Module, path, with_metadata=True):
    """The same linear model as an ONNX graph built by hand (dynamic batch, NCHW input)."""
    weight, bias = module[1].weight.detach().numpy(), module[1].bias.detach().numpy()
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["x"], ["flat"], axis=1),
         helper.make_node("Gemm", ["flat", "W", "b"], ["logits"], transB=1)],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 4, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if with_metadata:
        helper.set_model_props(model, {"mlflow_di.preprocessing": PREP.to_json()})
    onnx.save(model, str(path))
    return path


def images(n=5, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 4, 4, 1), dtype=np.uint8)


def test_torch_and_onnx_backends_agree(tmp_path):
    module = tiny_torch()
    expected = TorchClassifier(module, PREP).predict_proba(images())
    onnx_classifier = OnnxClassifier(tiny_onnx(module, tmp_path / "m.onnx"))
    assert onnx_classifier.preprocessing == PREP  # read from the ONNX metadata
    np.testing.assert_allclose(onnx_classifier.predict_proba(images()), expected, atol=1e-6)
    np.testing.assert_allclose(expected.sum(axis=1), 1.0, atol=1e-6)
    assert onnx_classifier.num_classes == 3
    # batching must not change results
    np.testing.assert_allclose(onnx_classifier.predict_proba(images(), batch_size=2), expected, atol=1e-6)


def test_onnx_without_metadata_infers_layout_and_shape(tmp_path):
    classifier = OnnxClassifier(tiny_onnx(tiny_torch(), tmp_path / "m.onnx", with_metadata=False))
    assert classifier.preprocessing.layout == "NCHW" and classifier.preprocessing.input_shape == (4, 4, 1)


def test_tflite_reference_models_score_as_published(shared_dir, mnist_spec):
    pytest.importorskip("ai_edge_litert")
    data = mlflow_di.load_images(mnist_spec)
    for name, correct in (("lenet1-quan.lite", 9784), ("lenet5-quan.lite", 9879)):
        classifier = mlflow_di.load_classifier(str(shared_dir / "models" / "dflare" / name))
        assert isinstance(classifier, TFLiteClassifier)
        assert int((classifier.predict(data.images) == data.labels).sum()) == correct


def test_torch_pickle_file_with_and_without_metadata(tmp_path):
    module = tiny_torch()
    torch.save(module, tmp_path / "plain.pt")
    torch.save({"module": module, "mlflow_di": {"preprocessing": PREP.to_dict()}}, tmp_path / "meta.pt")
    model = mlflow_di.load_torch_model(str(tmp_path / "meta.pt"))
    assert model.preprocessing == PREP
    plain = mlflow_di.load_classifier(str(tmp_path / "plain.pt"), preprocessing="input_shape=4/4/1")
    np.testing.assert_allclose(plain.predict_proba(images()), model.classifier().predict_proba(images()), atol=1e-7)


def test_mlflow_uris_carry_the_preprocessing(tracking_uri):
    import mlflow

    model = TorchModel(tiny_torch(), PREP, name="tiny")
    with tracking.tracked_run("t") as run:
        info = edge_models.log_torch_model(model, registered_model_name="tiny")
    mlflow.MlflowClient().set_registered_model_alias("tiny", "champion", info.registered_model_version)
    expected = model.classifier().predict_proba(images())
    for uri in ("models:/tiny/1", "models:/tiny@champion", f"runs:/{run.info.run_id}/model"):
        loaded = mlflow_di.load_torch_model(uri)
        assert loaded.preprocessing == PREP, uri
        np.testing.assert_allclose(mlflow_di.load_classifier(uri).predict_proba(images()), expected, atol=1e-7)
    assert mlflow.get_run(run.info.run_id).info.status == "FINISHED"


def test_pt2_model_is_white_box_with_the_metadata_preprocessing(tracking_uri):
    import mlflow

    module = tiny_torch()
    with mlflow.start_run():
        mlflow.pytorch.log_model(module, name="m", serialization_format="pt2", registered_model_name="pt2",
                                 input_example=np.zeros((2, 1, 4, 4), np.float32),
                                 metadata={"mlflow_di": {"preprocessing": PREP.to_dict()}})
    model = mlflow_di.load_torch_model("models:/pt2/1")
    assert model.preprocessing == PREP
    assert model.layer_names() == ["0", "1"]
    assert [type(layer).__name__ for layer in model.module.children()] == ["Flatten", "Linear"]
    probabilities = mlflow_di.load_classifier("models:/pt2/1").predict_proba(images())
    np.testing.assert_allclose(probabilities, TorchClassifier(module, PREP).predict_proba(images()), atol=1e-6)


@pytest.mark.parametrize("uri, fragment", [
    ("missing.onnx", "does not exist"),
    ("models:/nope/1", "cannot load model"),
    ("keras:lenet5", "bad keras reference"),
])
def test_bad_references_fail_in_one_line(tracking_uri, uri, fragment):
    with pytest.raises(UserError, match=fragment) as caught:
        mlflow_di.load_classifier(uri)
    assert "\n" not in str(caught.value)


def test_state_dict_and_unknown_suffix_are_explained(tmp_path):
    torch.save(tiny_torch().state_dict(), tmp_path / "sd.pt")
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="state dict"):
        mlflow_di.load_torch_model(str(tmp_path / "sd.pt"))
    with pytest.raises(UserError, match="cannot tell what kind"):
        mlflow_di.load_classifier(str(tmp_path / "model.bin"))


def test_an_onnx_file_opens_white_box_with_its_stored_preprocessing(tmp_path):
    module = tiny_torch()
    model = mlflow_di.load_torch_model(str(tiny_onnx(module, tmp_path / "m.onnx")))
    assert model.preprocessing == PREP
    np.testing.assert_allclose(model.classifier().predict_proba(images()),
                               TorchClassifier(module, PREP).predict_proba(images()), atol=1e-6)


def test_a_tflite_model_is_not_white_box(tmp_path):
    path = tmp_path / "m.tflite"
    path.write_bytes(b"")
    with pytest.raises(UserError, match=r"is a tflite model \(TFLite / LiteRT\), which opens only as a black box"):
        mlflow_di.load_torch_model(str(path))


def test_wrong_image_shape_and_dtype():
    classifier = TorchClassifier(tiny_torch(), PREP)
    with pytest.raises(UserError, match="expects 4x4x1"):
        classifier.predict_proba(np.zeros((1, 8, 8, 1), np.uint8))
    with pytest.raises(UserError, match="uint8"):
        classifier.predict_proba(np.zeros((1, 4, 4, 1), np.float32))


def test_unknown_layer_lists_the_available_ones():
    model = TorchModel(tiny_torch(), PREP)
    with pytest.raises(UserError, match="available layers: 0, 1"):
        model.module_by_name("fc9")
    assert [(info.name, info.neurons) for info in model.describe_layers()] == [("0", 16), ("1", 3)]


def test_a_batch_on_the_models_device_gives_the_probabilities_of_its_host_copy(tmp_path):
    # predict_device_batch (a campaign's mutants made where the model runs): the same bits as predict_proba,
    # in chunks of the default batch size too; only PyTorch classifiers on that device take such batches
    from mlflow_di.models.classifier import takes_device_batches

    prep = Preprocessing(input_shape=(4, 4, 1), mean=(0.4,), std=(0.2,), scale=1 / 255)
    classifier = TorchClassifier(tiny_torch(), prep)
    batch = images(300, seed=4)
    classifier.default_batch_size = 128
    expected = classifier.predict_proba(batch)
    np.testing.assert_array_equal(classifier.predict_device_batch(torch.from_numpy(batch)), expected)
    # the GPU's path (preprocessing by torch where the batch is), run on the CPU
    np.testing.assert_array_equal(classifier._classified_where_it_is(torch.from_numpy(batch)), expected)
    np.testing.assert_array_equal(prep.apply_on(torch.from_numpy(batch), "cpu").numpy(), prep.apply(batch))
    # on the CPU a batch is never kept "on the device": the host's rows are that memory already
    assert not takes_device_batches(classifier, "cpu") and not takes_device_batches(classifier, torch.device("cpu"))
    if torch.cuda.is_available():
        assert not takes_device_batches(classifier, "cuda")  # the model runs on the CPU
        on_gpu = TorchClassifier(tiny_torch().to("cuda"), prep)
        assert takes_device_batches(on_gpu, "cuda") and takes_device_batches(on_gpu, torch.device("cuda", 0))
        assert not takes_device_batches(OnnxClassifier(tiny_onnx(tiny_torch(), tmp_path / "m.onnx")), "cuda")
        assert not takes_device_batches(object(), "cuda")
