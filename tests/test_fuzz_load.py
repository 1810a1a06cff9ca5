"""A verdict belongs to the model, not to the runner's load: a seed's budget is charged in CPU
seconds (mlflow_di.fuzz.charge), so a seeded campaign whose binding limit is --max-queries gives
the same records on an idle machine and beside processes that keep every core busy, even with a
--timeout that the same campaign's wall-clock time under that load would exceed."""
import os
import subprocess
import sys
import time

import pytest

from mlflow_di.data import load_images
from mlflow_di.fuzz.boundary import BoundaryWalk, run_boundary
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.realism import Constraint
from mlflow_di.models.loading import load_classifier, load_torch_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_QUERIES = 60


@pytest.fixture(scope="module")
def lenet_pair(shared_dir, mnist_spec):
    """The DFlare reference pair (LeNet-5 and its int8 TFLite), ten MNIST test seeds."""
    models = shared_dir / "models" / "dflare"
    return (load_torch_model(f"keras:lenet5-same:{models / 'lenet5.h5'}"), load_classifier(str(models / "lenet5-quan.lite")),
            load_images(f"{mnist_spec}[9700:9710]"))


def campaign(kind: str, pair, timeout: float):
    original, compressed, seeds = pair
    if kind == "boundary":
        return run_boundary(original, compressed, seeds, BoundaryWalk(constraint=Constraint(min_ssim=0.97), steps=20, targets=3, restarts=0),
                            timeout=timeout, max_queries=MAX_QUERIES, seed=3, progress=False)
    return run_campaign(original.classifier(), compressed, seeds, strategy="dflare", timeout=timeout,
                        max_queries=MAX_QUERIES, seed=3, batch=4, progress=False)


def without_seconds(result) -> list[dict]:
    return [{key: value for key, value in record.to_dict().items() if key != "seconds"} for record in result.records]


class Burners:
    """Processes that keep every core busy (four times over) while the block runs; stopped by their PIDs."""

    def __enter__(self):
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(4 * (os.cpu_count() or 2))]
        time.sleep(0.5)
        return self

    def __exit__(self, *exc_info):
        for process in self.processes:
            process.kill()
            process.wait()
        return False


@pytest.mark.parametrize("kind", ["boundary", "dflare"])
def test_a_seeded_campaign_gives_the_same_records_idle_and_under_load(kind, lenet_pair):
    idle = campaign(kind, lenet_pair, timeout=600.0)
    searched = [r for r in idle.records if not r.already_deviating]
    assert searched and all(r.stop.value in ("trigger", "max_queries") for r in searched)
    assert any(r.stop.value == "max_queries" for r in searched), "the query limit must bind on some seed"
    # A time limit three times the most CPU any seed needed idle. Beside four busy processes per core
    # this process gets under a quarter of a core, so a wall-clock charge would stop the boundary
    # walk's most expensive seeds (about 0.4 s each idle: under SSIM >= 0.97 half the seeds run out of
    # queries) early; a CPU-seconds charge does not.
    timeout = max(3 * max(r.seconds for r in searched), 0.2)
    wall = time.perf_counter()
    with Burners():
        loaded = campaign(kind, lenet_pair, timeout)
    wall = time.perf_counter() - wall
    assert without_seconds(loaded) == without_seconds(idle)
    assert wall > sum(r.seconds for r in loaded.records)  # the load was real: more wall time than CPU charged
