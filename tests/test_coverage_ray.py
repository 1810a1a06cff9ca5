"""Coverage passes split into batches (in process, and on a pool of Ray actors) give the local path's results exactly.

The Ray tests use the session's local cluster (conftest: 2 CPUs); workers ask for half a CPU each
so two actors and the driver never wait on each other.
"""
import json
import math
import pickle

import numpy as np
import pytest

from mlflow_di.coverage.partials import ExactSum, FitJob, LocalPasses, exact_column_sums, read_trace
from mlflow_di.coverage.suite import CoverageSuite
from mlflow_di.data import load_images
from mlflow_di.errors import UserError

TRAIN, TEST = "digits[0:400]", "digits[1500:1700]"


@pytest.fixture(scope="module")
def model():
    """digits-cnn trained briefly (so surprise adequacy and IDC's clusters mean something)."""
    import torch

    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel
    from mlflow_di.models.training import train_classifier

    spec = zoo.architecture("digits-cnn")
    model = TorchModel(zoo.build("digits-cnn", seed=0), spec.preprocessing, name="cnn")
    train = load_images("digits[0:400]")
    train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels), epochs=3,
                     progress=False)
    return model


def fitted_and_scored(model, passes):
    suite = CoverageSuite(layers="all", top_m=3, batch_size=48, progress=False)
    suite.fit(model, load_images(TRAIN), passes=passes)
    return suite, suite.score_all([load_images(TEST), load_images("digits[1700:1797]")], passes=passes)


def assert_same(expected, actual):
    """Fitted models (IDC JSON, criteria statistics) and every result equal, bit for bit."""
    (suite_a, results_a), (suite_b, results_b) = expected, actual
    assert suite_a.idc_.to_json() == suite_b.idc_.to_json()
    for name in ("low_", "high_", "sa_traces_", "sa_classes_"):
        np.testing.assert_array_equal(getattr(suite_a.classic_, name), getattr(suite_b.classic_, name))
    np.testing.assert_array_equal(suite_a.classic_.distance_.nearest_other_, suite_b.classic_.distance_.nearest_other_)
    assert suite_a.classic_.layer_sizes_ == suite_b.classic_.layer_sizes_
    for a, b in zip(results_a, results_b, strict=True):
        assert json.dumps(a.summary()) == json.dumps(b.summary())
        assert a.criteria.to_json() == b.criteria.to_json()  # cells, lsa/dsa per input, settings
        assert {k: r.to_json() for k, r in a.idc.items()} == {k: r.to_json() for k, r in b.idc.items()}
    assert 0 < results_a[-1].metrics()["lsc"] and 0 < results_a[-1].metrics()["idc"]


def test_exact_sums_are_the_correctly_rounded_sum_in_any_order_or_split():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((700, 5)) * 10.0 ** rng.integers(-30, 30, (700, 5))).astype(np.float32)
    expected = np.array([math.fsum(values[:, j].astype(float)) for j in range(5)])
    np.testing.assert_array_equal(exact_column_sums(values), expected)
    merged = ExactSum(5)
    for start in reversed(range(0, 700, 64)):  # batches of 64, merged last to first
        merged.merge(ExactSum(5).add(values[start:start + 64]))
    np.testing.assert_array_equal(merged.value(), expected)
    special = np.array([[np.nan, np.inf, np.inf, 1e308], [0, -np.inf, 1, 1e308]])
    assert np.array_equal(exact_column_sums(special), [np.nan, np.nan, np.inf, np.inf], equal_nan=True)


def test_passes_batch_by_batch_in_process_equal_the_local_path(model):
    assert_same(fitted_and_scored(model, None), fitted_and_scored(model, LocalPasses()))


def test_a_pass_in_batches_traces_its_model_once(model, monkeypatch):
    # the batch-norm pairs and the check for unhandled tensor arithmetic: one fx trace a pass, not two a batch
    from mlflow_di.coverage import canonizers

    traced, trace = [], canonizers._Tracer.trace
    monkeypatch.setattr(canonizers._Tracer, "trace", lambda self, *args: traced.append(1) or trace(self, *args))
    CoverageSuite(criteria="idc", top_m=3, batch_size=48, progress=False).fit(model, load_images(TRAIN),
                                                                              passes=LocalPasses())
    assert len(traced) == 1  # 400 images: nine batches, one trace for the pairs and the check
    job = FitJob(["fc"])
    job._traced[("batch-norm pairs", id(model.module), None)] = [(model.module, model.module)]
    assert pickle.loads(pickle.dumps(job))._traced == {}  # a worker's copy traces its own model
    with pytest.raises(UserError, match="multiplies two tensors .* classic criteria"):  # and it still refuses
        CoverageSuite(criteria="idc", layers=["fc"], top_m=1, batch_size=48, progress=False).fit(
            _gated(model), load_images(TRAIN), passes=LocalPasses())


def _gated(model):
    """``model`` with its logits multiplied by a tensor its forward code computes (no gate): arithmetic LRP has no rule
    for."""
    from torch import nn

    from mlflow_di.models.torch_model import TorchModel

    class Gated(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.fc = nn.Linear(10, 10)

        def forward(self, x):
            logits = self.fc(self.inner(x))
            return logits * logits.detach()  # a product of two signals, neither a sigmoid gate

    return TorchModel(Gated(model.module), model.preprocessing, "gated")


def test_trace_files_are_parquet_per_batch_and_a_missing_one_is_one_line(model, tmp_path):
    data = load_images("digits[0:100]")
    job = FitJob(["fc1"], only_correct=False)
    with LocalPasses(trace_dir=str(tmp_path)).run(job, model, data, 32) as output:
        files = sorted(p.name for p in (output.traces / "idc").iterdir())
        assert files == ["000000000000.parquet", "000000000032.parquet", "000000000064.parquet", "000000000096.parquet"]
        rows = read_trace(output.traces / "idc", [0, 32, 64, 96], 100, ["fc1#0", "fc1#31"])
        assert rows["fc1#0"].shape == (100,) and rows["fc1#0"].dtype == np.float32
        with pytest.raises(UserError, match="trace file of the batch at input 128 .* every node shares"):
            read_trace(output.traces / "idc", [0, 128], 100, ["fc1#0"])
    assert not any(tmp_path.iterdir())  # a pass's trace folder goes when the pass is merged


@pytest.fixture(scope="module")
def ray(ray_cluster):
    import sys

    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray_cluster


@pytest.mark.slow
def test_passes_on_a_ray_pool_equal_the_local_path(ray, model):
    from mlflow_di.coverage.distributed import RayPasses

    # TRAIN is read by the workers from its spec, the test sets travel through the object store
    passes = RayPasses(workers=2, cpus_per_worker=0.5, specs=[TRAIN], progress=False)
    assert_same(fitted_and_scored(model, None), fitted_and_scored(model, passes))
    assert [s["batches"] for s in passes.stats] == [9, 5 + 3] and all(s["workers"] == 2 for s in passes.stats)


@pytest.mark.slow
def test_coverage_workers_2_equals_workers_0(ray, registered_cnn, tmp_path, capsys):
    from mlflow_di.cli import main

    common = ["coverage", "--model-uri", registered_cnn, "--train-data", "digits[0:300]", "--test-data",
              "digits[1300:1450]", "--test-data", "digits[1450:1500]", "--layers", "all", "--top-m", "3",
              "--batch-size", "64", "--idc-resamples", "5"]  # 5 resamples (not 50): the intervals must still agree
    assert main([*common, "--json-out", str(tmp_path / "local.json")]) == 0
    assert main([*common, "--workers", "2", "--cpus-per-worker", "0.5", "--json-out", str(tmp_path / "ray.json")]) == 0
    assert "on 2 Ray workers (local)" in capsys.readouterr().out
    local, spread = (json.loads((tmp_path / name).read_text()) for name in ("local.json", "ray.json"))
    assert local == spread and local["idc"] > 0 and local["lsc"] > 0


def test_bad_ray_passes_settings_are_one_line():
    from mlflow_di.coverage.distributed import RayPasses

    with pytest.raises(UserError, match="at least 1 worker"):
        RayPasses(workers=0)
    with pytest.raises(UserError, match="must not be negative"):
        RayPasses(gpus_per_worker=-1)
