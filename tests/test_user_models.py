"""CNNs as users write them (benchmarks/user_models.py): residual additions and differences in their own
forward, concatenations, a squeeze-excitation gate through a reshape, a depthwise inverted residual, one block
applied twice, a mean head, two resolutions concatenated. Each conserves LRP relevance in every form a user
brings it in (the module itself, as a pickle loads it; rebuilt from torch.export, as pt2 is; converted from
ONNX's default exporter) and has one IDC in all of them; the model of issue #65 runs through every command
logged as MLflow users log it (pt2 by default, torch.onnx.export + mlflow.onnx.log_model)."""
import json

import numpy as np
import pytest
import torch

from benchmarks.check_lrp_conservation import bias_free, lrp_logits
from benchmarks.user_models import MODELS, forms, log_as_users_do, trained

from mlflow_di.cli import main
from mlflow_di.coverage.idc import ImportanceDrivenCoverage
from mlflow_di.coverage.relevance import input_relevance
from mlflow_di.data import load_images
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bias_free_forms(tmp_path_factory):
    """Per model: its inputs and its bias-free forms (made once: ONNX's default exporter takes seconds a model)."""
    made = {}

    def of(name):
        if name not in made:
            model_class = MODELS[name]
            x = torch.rand(4, 1, model_class.size, model_class.size, generator=torch.Generator().manual_seed(1))
            torch.manual_seed(0)
            made[name] = x, forms(bias_free(model_class().eval(), x), tmp_path_factory.mktemp(name))
        return made[name]

    return of


@pytest.mark.parametrize("name", MODELS)
def test_lrp_conserves_relevance_through_the_users_own_code_in_every_form(name, bias_free_forms):
    """Input relevance sums to the explained logit (bias-free models, LRP-epsilon with a negligible epsilon), to
    2e-3 as for torchvision's families, whichever form the model comes in."""
    x, every = bias_free_forms(name)
    for form, module in every.items():
        start = lrp_logits(module, x).max(dim=1).values.numpy()
        relevance = input_relevance(module, x, epsilon=1e-20, progress=False)
        np.testing.assert_allclose(relevance.reshape(len(x), -1).sum(axis=1) / start, 1.0, atol=2e-3, err_msg=form)


@pytest.mark.parametrize("name", MODELS)
def test_idc_is_the_same_in_every_form(name, bias_free_forms):
    """The same important neurons, clusters and IDC of the last hidden layer from the module, its pt2 rebuild and
    its ONNX view (batch norms folded into their convolutions there: the same function)."""
    model_class = MODELS[name]
    train, test = load_images("digits[0:300]"), load_images("digits[300:400]")
    preprocessing = Preprocessing(scale=1 / 255, layout="NCHW", input_shape=(model_class.size,) * 2 + (1,),
                                  resize=None if model_class.size == 8 else model_class.size)
    results = {}
    for form, module in bias_free_forms(name)[1].items():
        model = TorchModel(module, preprocessing, name=f"{name}-{form}")
        idc = ImportanceDrivenCoverage(layers="fc1", only_correct=False, progress=False).fit(model, train)
        report = idc.score(test)
        results[form] = (idc.important_neurons_.tolist(), report.clusters_per_neuron, report.covered, report.total,
                         report.reachable, report.covered_reachable)
    assert results["pt2"] == results["pickle"] == results["onnx"], results


def test_the_issues_model_logged_as_users_do_runs_through_every_command(tracking_uri, tmp_path, capsys):
    """OwnCNN (a residual add in its forward, one pool module called twice), trained on the digits upscaled to
    28x28 and logged with MLflow's defaults (pt2) and as ONNX from torch.onnx.export's default exporter: describe,
    coverage (IDC and every criterion: equal IDC and the same important neurons in both forms), compress
    (int8-static, prune-l1), fuzz (dflare, boundary), gate and pipeline run on both."""
    uris = log_as_users_do(trained("own-cnn", epochs=2), "own", tmp_path)
    resize = ["--preprocessing", "resize=28"]
    coverage = {}
    for form in ("pt2", "onnx"):
        uri = uris[form]
        assert main(["describe", uri]) == 0, capsys.readouterr().err
        out = tmp_path / f"coverage-{form}.json"
        assert main(["coverage", "--model-uri", uri, "--train-data", "digits[0:300]", "--test-data", "digits[1300:1450]",
                     "--idc-resamples", "5", *resize, "--json-out", str(out)]) == 0, capsys.readouterr().err
        coverage[form] = json.loads(out.read_text())
    keys = ("idc", "idc_reachable", "important_neurons", "clusters_per_neuron", "layer")
    assert {k: coverage["pt2"][k] for k in keys} == {k: coverage["onnx"][k] for k in keys}
    assert {"nc", "kmnc", "nbc", "snac", "tknc", "lsc", "dsc"} <= set(coverage["onnx"])
    for form in ("pt2", "onnx"):
        assert main(["compress", "--model-uri", uris[form], "--method", "int8-static,prune-l1", "--calib-data",
                     "digits[0:100]", "--eval-data", "digits[1300:1450]", "--no-benefit", *resize]) == 0, \
            capsys.readouterr().err
    export = "models:/own-pt2-int8-static/1"
    for form, strategy in (("pt2", "dflare"), ("pt2", "boundary"), ("onnx", "boundary")):
        out = tmp_path / f"fuzz-{form}-{strategy}.json"
        assert main(["fuzz", "--original", uris[form], "--compressed", export, "--seed-data", "digits[1300:1310]",
                     "--strategy", strategy, "--max-queries", "30", "--preprocessing-original", "resize=28",
                     "--preprocessing-compressed", "resize=28", "--out-dir", str(tmp_path / f"c-{form}-{strategy}"),
                     "--json-out", str(out)]) == 0, capsys.readouterr().err
        assert json.loads(out.read_text())["seeds"] == 10
    code = main(["gate", "--model-uri", uris["pt2"], "--compressed", export, "--min-idc", "0.01",
                 "--max-accuracy-drop", "1"])
    assert code in (0, 1, 3), capsys.readouterr().err  # a verdict; 2 would mean it could not judge
    policy = tmp_path / "policy.yaml"
    policy.write_text("preprocessing: {own-onnx: {resize: 28}}\n"
                      "coverage: {train_data: 'digits[0:200]', test_data: ['digits[1300:1400]'], idc_resamples: 5}\n"
                      "gate: {thresholds: {min_idc: 0.01}}\n")
    assert main(["pipeline", "--policy", str(policy), "--model-uri", uris["onnx"], "--state-dir",
                 str(tmp_path / "state")]) in (0, 1, 3), capsys.readouterr().err
