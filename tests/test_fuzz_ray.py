"""Campaigns on Ray workers give the records of a local campaign; a dead worker loses nothing.

The models are the brightness pair of test_fuzz_campaign (a band of mean brightness where they
disagree), pickled by value to the workers. One local Ray cluster serves the session (conftest).
"""
import os
import sys

import numpy as np
import pytest

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz import load_campaign, run_campaign
from mlflow_di.fuzz.campaign import run_campaigns
from mlflow_di.fuzz.distributed import RayExecutor, check_address
from mlflow_di.fuzz.results import comparable_records
from tests.test_fuzz_campaign import HIGH, LOW, Brightness

pytestmark = pytest.mark.slow

QUERIES = 400


@pytest.fixture(scope="module")
def ray(ray_cluster):
    """The session's cluster, with this module's and test_fuzz_campaign's classes sent by value
    (the workers cannot import test modules)."""
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[Brightness.__module__])
    return ray_cluster


@pytest.fixture()
def seeds() -> ImageSet:
    rng = np.random.default_rng(5)
    return ImageSet(rng.integers(0, 100, (14, 8, 8, 1), dtype=np.uint8), rng.integers(0, 2, 14), "dark")


def executor(**options) -> RayExecutor:
    return RayExecutor(**{"workers": 2, "cpus_per_worker": 0.5, "chunk_size": 3, **options})


class DiesOnce(Brightness):
    """A model whose first call in a Ray worker kills that worker's process (the marker file says it happened)."""

    def __init__(self, threshold, marker, driver_pid):
        super().__init__(threshold)
        self.marker, self.driver_pid = str(marker), driver_pid

    def predict_proba(self, images):
        if os.getpid() != self.driver_pid and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        return super().predict_proba(images)


class AlwaysDies(Brightness):
    def __init__(self, threshold, driver_pid):
        super().__init__(threshold)
        self.driver_pid = driver_pid

    def predict_proba(self, images):
        if os.getpid() != self.driver_pid:
            os._exit(1)
        return super().predict_proba(images)


def test_a_ray_campaign_has_the_records_and_folder_of_a_local_one(ray, seeds, tmp_path):
    local = run_campaign(Brightness(LOW), Brightness(HIGH), seeds, max_queries=QUERIES, batch=4, seed=1,
                         out_dir=tmp_path / "local", progress=False)
    spread = executor(chunk_size=None)
    # the workers also overlap their model calls with their searches: chunks of 8 seeds, two shifts of 4
    distributed = run_campaign(Brightness(LOW), Brightness(HIGH), seeds, max_queries=QUERIES, batch=4, seed=1,
                               out_dir=tmp_path / "ray", progress=False, executor=spread, overlap=True)
    assert spread.stats["chunks"] == 2 and spread.stats["workers"] == 2
    assert comparable_records(local) == comparable_records(distributed)
    assert distributed.complete and distributed.summary.triggers == local.summary.triggers > 0
    np.testing.assert_array_equal(local.triggers, distributed.triggers)
    queries = sum(r.queries for r in local.records)
    assert sum(r.queries for r in distributed.records) == queries <= distributed.run_stats.inputs
    assert comparable_records(load_campaign(tmp_path / "ray")) == comparable_records(local)


def test_several_exports_and_a_resumed_campaign_match_the_local_run(ray, seeds, tmp_path):
    pair = [Brightness(HIGH), Brightness(0.34)]
    local = run_campaigns(Brightness(LOW), pair, seeds, max_queries=QUERIES, batch=4, progress=False)
    # the first seeds locally, interrupted; the rest on Ray with --resume
    folders = [tmp_path / "a", tmp_path / "b"]
    run_campaigns(Brightness(LOW), pair, seeds, max_queries=QUERIES, batch=4, progress=False, out_dirs=folders,
                  executor=_Interrupting(after=2))
    resumed = run_campaigns(Brightness(LOW), pair, seeds, max_queries=QUERIES, batch=4, progress=False,
                            out_dirs=folders, resume=True, executor=executor())
    for alone, together in zip(local, resumed):
        assert comparable_records(alone) == comparable_records(together)
        assert together.complete


class _Interrupting:
    """An executor that searches ``after`` seeds of each lane here, then acts as if Ctrl-C was pressed."""

    def __init__(self, after: int):
        self.after = after

    def execute(self, runner):
        for lane in runner.lanes:
            lane.todo = lane.todo[:self.after]
            lane.p_original, lane.p_compressed = lane.p_original[:self.after], lane.p_compressed[:self.after]
        runner.search_all()
        raise KeyboardInterrupt


def test_a_worker_that_dies_loses_nothing_and_duplicates_nothing(ray, seeds, tmp_path):
    marker = tmp_path / "died"
    local = run_campaign(Brightness(LOW), Brightness(HIGH), seeds, max_queries=QUERIES, batch=4, progress=False)
    distributed = run_campaign(Brightness(LOW), DiesOnce(HIGH, marker, os.getpid()), seeds, max_queries=QUERIES,
                               batch=4, out_dir=tmp_path / "ray", progress=False, executor=executor())
    assert marker.exists(), "a worker was killed"
    assert comparable_records(distributed) == comparable_records(local)
    lines = (tmp_path / "ray" / "records.jsonl").read_text().splitlines()
    assert len(lines) == len(seeds), "every seed written once"


def test_a_worker_that_keeps_dying_stops_the_campaign_in_one_line(ray, seeds, tmp_path):
    with pytest.raises(UserError, match=r"a Ray worker died on seeds \d+\.\.\d+ 1 times .*resume"):
        run_campaign(Brightness(LOW), AlwaysDies(HIGH, os.getpid()), seeds, max_queries=QUERIES, batch=4,
                     out_dir=tmp_path / "ray", progress=False, executor=executor(max_retries=0))


@pytest.mark.parametrize("address, fragment", [("nowhere", "bad Ray address"), ("http://x:1", "bad Ray address")])
def test_bad_addresses_are_refused_before_ray_starts(address, fragment):
    with pytest.raises(UserError, match=fragment):
        check_address(address)


def test_an_address_where_nothing_listens_is_refused_even_with_ray_already_running_here(ray):
    """Ray initialised in this process (this session's cluster) is used when asked for, but a mistyped address is
    not silently taken for it: a service started in such a process with --ray-address HOST:9 refused nothing and
    waited forever."""
    import socket

    from mlflow_di._ray import connect

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with pytest.raises(UserError, match=rf"cannot reach the Ray cluster at '127.0.0.1:{free}'"):
        connect(f"127.0.0.1:{free}")
    assert connect("local") == (ray, False)  # the running cluster, left running


@pytest.mark.parametrize("options, fragment", [({"workers": 0}, "at least 1 worker"),
                                               ({"gpus_per_worker": -1}, "must not be negative"),
                                               ({"chunk_size": 0}, "at least 1 seed")])
def test_bad_executor_settings_are_one_line(options, fragment):
    with pytest.raises(UserError, match=fragment):
        RayExecutor(**options)


def test_fuzz_workers_2_on_registered_digits_models_gives_the_records_of_workers_0(ray, registered_cnn, tmp_path,
                                                                                   capsys):
    from mlflow_di.cli import main

    assert main(["compress", "--model-uri", registered_cnn, "--method", "prune-l1", "--amount", "0.3",
                 "--eval-data", "digits[1300:1400]"]) == 0
    common = ["--original", registered_cnn, "--compressed", "models:/cnn-prune-l1/1", "--seed-data",
              "digits[1300:1316]", "--max-queries", "80", "--batch", "4", "--seed", "3"]
    assert main(["fuzz", *common, "--out-dir", str(tmp_path / "local")]) == 0
    assert main(["fuzz", *common, "--workers", "2", "--cpus-per-worker", "0.5", "--out-dir",
                 str(tmp_path / "ray")]) == 0
    assert "searching on 2 Ray workers (local)" in capsys.readouterr().out
    assert comparable_records(load_campaign(tmp_path / "local")) == comparable_records(load_campaign(tmp_path / "ray"))


def test_a_shipped_registry_model_loads_from_its_files_alone(registered_cnn, tmp_path, monkeypatch):
    from mlflow_di.models.loading import load_classifier
    from mlflow_di.models.shipping import Shipment, ship

    model = load_classifier(registered_cnn, "scale=0.0625")
    package = ship(model)
    assert isinstance(package, Shipment) and "MLmodel" in package.files and package.size > 1000
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens: the copy must not ask
    copy = package.load(tmp_path / "copy")
    images = np.random.default_rng(0).integers(0, 17, (5, 8, 8, 1), dtype=np.uint8)
    np.testing.assert_array_equal(copy.predict_proba(images), model.predict_proba(images))
    assert copy.name == model.name and copy.preprocessing == model.preprocessing
    assert ship(Brightness(LOW)).threshold == LOW  # a model built in Python travels as it is
