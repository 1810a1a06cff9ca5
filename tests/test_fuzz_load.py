"""A verdict belongs to the model, not to the runner's load: a seed's budget is work (queries to the
compressed model; the boundary walk also bounds its gradient passes), so a seeded campaign gives the
same records on an idle machine and beside processes that keep every core busy. Time is only a
safety net (CPU seconds per seed, mlflow_di.fuzz.charge): a seed that reaches it is recorded as
stopped at ``timeout``, the campaign is INCOMPLETE, and ``resume`` searches it again with any
timeout. How tight the net may be under load is measured, not tested (benchmarks/bench_load.py):
a test cannot depend on the speed or load of the machine it runs on."""
import itertools
import os
import subprocess
import sys
import time

import pytest

from mlflow_di.data import load_images
from mlflow_di.fuzz import lockstep
from mlflow_di.fuzz.boundary import BoundaryWalk, run_boundary
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.contract import DEFAULT_TIMEOUT
from mlflow_di.fuzz.realism import Constraint
from mlflow_di.fuzz.results import comparable_records
from mlflow_di.models import zoo
from mlflow_di.models.loading import load_classifier, load_torch_model
from mlflow_di.models.torch_model import TorchModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_QUERIES = 60


@pytest.fixture(scope="module")
def lenet_pair(shared_dir, mnist_spec):
    """The DFlare reference pair (LeNet-5 and its int8 TFLite), ten MNIST test seeds."""
    models = shared_dir / "models" / "dflare"
    return (load_torch_model(f"keras:lenet5-same:{models / 'lenet5.h5'}"), load_classifier(str(models / "lenet5-quan.lite")),
            load_images(f"{mnist_spec}[9700:9710]"))


def campaign(kind: str, pair, timeout: float = DEFAULT_TIMEOUT):
    original, compressed, seeds = pair
    if kind == "boundary":
        walk = BoundaryWalk(constraint=Constraint(min_ssim=0.97), steps=20, targets=3, restarts=0)
        return run_boundary(original, compressed, seeds, walk,
                            timeout=timeout, max_queries=MAX_QUERIES, seed=3, progress=False)
    return run_campaign(original.classifier(), compressed, seeds, strategy="dflare", timeout=timeout,
                        max_queries=MAX_QUERIES, seed=3, batch=4, progress=False)


def without_seconds(result) -> list[dict]:
    return [{key: value for key, value in record.to_dict().items() if key != "seconds"} for record in result.records]


class Burners:
    """Processes that keep every core busy (one spinning process per core, beside the campaign and whatever
    else runs) while the block runs; stopped by their PIDs. Four per core (8 spinning processes here) left the
    campaign about a ninth of the machine, not a third, and took it from the rest of the suite, without changing
    what is tested: the work budget, not time, ends a seed, and the last assertion checks that the load was real."""

    def __enter__(self):
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(os.cpu_count() or 2)]
        time.sleep(0.5)
        return self

    def __exit__(self, *exc_info):
        for process in self.processes:
            process.kill()
            process.wait()
        return False


@pytest.mark.parametrize("kind", ["boundary", "dflare"])
def test_a_seeded_campaign_gives_the_same_records_idle_and_under_load(kind, lenet_pair):
    """With the default safety net the work budget binds on every seed, idle and under load."""
    idle = campaign(kind, lenet_pair)
    searched = [r for r in idle.records if not r.already_deviating]
    assert searched and all(r.stop.value in ("trigger", "max_queries") for r in searched)
    assert any(r.stop.value == "max_queries" for r in searched), "the query limit must bind on some seed"
    wall = time.perf_counter()
    with Burners():
        loaded = campaign(kind, lenet_pair)
    wall = time.perf_counter() - wall
    assert without_seconds(loaded) == without_seconds(idle)
    assert wall > sum(r.seconds for r in loaded.records)  # the load was real: more wall time than CPU charged


@pytest.fixture(scope="module")
def digits_pair():
    """Two untrained digits CNNs (they disagree on many digits) and 12 seeds: a cheap black-box pair."""
    spec = zoo.architecture("digits-cnn")
    models = [TorchModel(zoo.build("digits-cnn", seed=seed), spec.preprocessing, name=f"cnn{seed}").classifier()
              for seed in (0, 1)]
    return (*models, load_images("digits[0:12]"))


def test_the_safety_net_makes_the_run_incomplete_and_resume_searches_those_seeds_again(digits_pair, tmp_path,
                                                                                       monkeypatch):
    original, compressed, seeds = digits_pair
    settings = dict(strategy="dflare", max_queries=400, seed=1, batch=4, progress=False)
    fresh = run_campaign(original, compressed, seeds, **settings)
    assert sum(r.stop.value == "max_queries" for r in fresh.records) >= 1  # some seed spends its whole budget

    ticks = itertools.count()  # a clock that charges every search turn a second: the net fires on long seeds
    monkeypatch.setattr(lockstep, "search_clock", lambda: float(next(ticks)))
    stopped = run_campaign(original, compressed, seeds, timeout=30.0, out_dir=tmp_path / "c", **settings)
    timed_out = {r.index for r in stopped.records if r.stop.value == "timeout"}
    assert timed_out and stopped.complete  # every seed has a record; those of the net are not findings
    assert all(not r.success for r in stopped.records if r.index in timed_out)
    monkeypatch.undo()

    resumed = run_campaign(original, compressed, seeds, timeout=DEFAULT_TIMEOUT, out_dir=tmp_path / "c", resume=True,
                           **settings)  # another safety net: not a setting the records depend on
    assert comparable_records(resumed) == comparable_records(fresh)  # the net's seeds searched again, to the same end
