"""Work on a local multi-node Ray cluster that loses a node, or its driver, mid-work (run as a script by
tests/test_ray_node_loss.py, in its own process: one process joins one Ray cluster).

The cluster (``ray.cluster_utils.Cluster``, every node on the loopback address): a head with no CPUs and three
worker nodes of one CPU, so each of the two workers sits on its own node and one node is idle. Three losses:

- a fuzz campaign: once the first chunk is back, a node that holds a worker (no CPU left) is removed; its worker
  is restarted on the idle node and runs the chunks it held again;
- coverage fit and score on a pool of Ray actors (a node added back first): once the first batch is back, a node holding a
  worker is removed;
- a campaign's driver, a process of its own, SIGKILLed once its first chunk is saved; ``resume`` from this
  process completes the campaign.

Prints one JSON line: for each, whether the records (or coverage numbers) equal an in-process run's, whether it
completed, how much ran again, and the seconds each part took.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import threading
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node's address the loopback one, as _ray.connect

import numpy as np  # noqa: E402

import mlflow_di  # noqa: E402,F401  (torchvision guard first)


class Waiting:
    """Class 1 when the mean brightness exceeds ``t``; each call waits ``delay`` s (a model on a remote accelerator)."""

    def __init__(self, t: float, delay: float):
        self.t, self.delay, self.name = t, delay, f"brightness>{t}"

    def predict_proba(self, images):
        time.sleep(self.delay)
        p1 = 1 / (1 + np.exp(-40 * (images.reshape(len(images), -1).mean(axis=1) / 255 - self.t)))
        return np.stack([1 - p1, p1], axis=1)


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    began = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {node.node_id: node for node in (cluster.add_node(num_cpus=1) for _ in range(3))}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        started = time.perf_counter() - began
        found = {"cluster_seconds": started, "fuzz": lose_a_node_mid_campaign(cluster, nodes, began)}
        nodes.update({node.node_id: node for node in [cluster.add_node(num_cpus=1)]})  # three again
        cluster.wait_for_nodes()
        found["coverage"] = lose_a_node_mid_pass(cluster, nodes)
        found["driver"] = lose_the_driver(cluster.address)
        found["seconds"] = time.perf_counter() - began
        print(json.dumps(found))
    finally:
        ray.shutdown()
        cluster.shutdown()


def _seeds():
    from mlflow_di.data import ImageSet

    images = np.random.default_rng(0).integers(90, 140, (48, 8, 8, 1), dtype=np.uint8)
    return ImageSet(images, np.zeros(len(images), np.int64), "grey squares")


SETTINGS = dict(strategy="dflare", max_queries=30, batch=4, seed=0, timeout=600, progress=False)


def _busy_node(nodes: dict) -> str:
    """A node of ``nodes`` with no CPU free (one that holds a worker)."""
    from ray._private.state import available_resources_per_node

    while True:
        busy = [node_id for node_id, free in available_resources_per_node().items()
                if node_id in nodes and free.get("CPU", 0) < 1]
        if busy:
            return busy[0]
        time.sleep(0.05)


def lose_a_node_mid_campaign(cluster, nodes: dict, began: float) -> dict:
    """A fuzz campaign on two workers; a node holding one is removed once the first chunk is back."""
    from mlflow_di.fuzz import load_campaign
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.distributed import RayExecutor
    from mlflow_di.fuzz.results import comparable_records

    seeds, folder = _seeds(), tempfile.mkdtemp(prefix="mlflow-di-node-loss-")
    local = run_campaign(Waiting(0.45, 0.0), Waiting(0.47, 0.0), seeds, out_dir=f"{folder}/local", **SETTINGS)
    executor = RayExecutor(workers=2, address="auto", cpus_per_worker=1, chunk_size=4)
    lost = {}

    def lose_a_node():
        while not executor.stats.get("chunk_seconds"):
            time.sleep(0.05)
        lost["after_chunks"] = len(executor.stats["chunk_seconds"])
        cluster.remove_node(nodes.pop(_busy_node(nodes)))
        lost["at"] = time.perf_counter() - began

    threading.Thread(target=lose_a_node, daemon=True).start()
    campaign_began = time.perf_counter()
    spread = run_campaign(Waiting(0.45, 0.05), Waiting(0.47, 0.05), seeds, out_dir=f"{folder}/ray",
                          executor=executor, **SETTINGS)
    lost["campaign_seconds"] = time.perf_counter() - campaign_began
    lost["mean_chunk_seconds"] = float(np.mean(executor.stats["chunk_seconds"]))
    written = load_campaign(f"{folder}/ray")
    return {"equal": comparable_records(local) == comparable_records(spread),
            "written_equal": comparable_records(written) == comparable_records(local),
            "records": len(written.records), "seeds": len(seeds), "complete": spread.complete,
            "stats": {k: v for k, v in executor.stats.items() if not k.endswith("_seconds")}, "lost": lost}


def _wait(delay: float):
    def wait(module, inputs):
        time.sleep(delay)

    return wait


def _slow_cnn(delay: float):
    """digits-cnn (random weights) whose every call waits ``delay`` s (a model on a remote accelerator), so a pass
    lasts long enough to lose a node in it."""
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    module = zoo.build("digits-cnn", seed=0)
    if delay:
        module.register_forward_pre_hook(_wait(delay))
    return TorchModel(module, zoo.architecture("digits-cnn").preprocessing, name="cnn")


def lose_a_node_mid_pass(cluster, nodes: dict) -> dict:
    """Coverage fit and score on two Ray workers; a node holding one is removed once the fit's first batch is
    back. Returns whether the fitted suite and the results equal the local path's."""
    from mlflow_di import progress
    from mlflow_di.coverage.distributed import RayPasses
    from mlflow_di.coverage.suite import CoverageSuite
    from mlflow_di.data import load_images

    train, test = load_images("digits[0:320]"), load_images("digits[1500:1660]")

    def fitted_and_scored(passes):
        suite = CoverageSuite(layers="all", top_m=3, batch_size=16, progress=False)
        suite.fit(_slow_cnn(0.0 if passes is None else 0.05), train, passes=passes)
        return suite, suite.score_all([test], passes=passes)

    local_suite, local_results = fitted_and_scored(None)
    lost, rows = {}, threading.Event()
    counting = progress.progress_bar

    def counted(iterable, **kwargs):  # the driver's view of the batches coming back
        for row in counting(iterable, **kwargs):
            rows.set()
            yield row

    def lose_a_node():
        rows.wait()
        cluster.remove_node(nodes.pop(_busy_node(nodes)))

    progress.progress_bar = counted
    threading.Thread(target=lose_a_node, daemon=True).start()
    try:
        passes = RayPasses(workers=2, address="auto", cpus_per_worker=1, progress=True)
        suite, results = fitted_and_scored(passes)
    finally:
        progress.progress_bar = counting
    lost["batches_on_restarted_workers"] = sum(one["batches_on_restarted_workers"] for one in passes.stats)
    return {"idc_equal": suite.idc_.to_json() == local_suite.idc_.to_json(),
            "results_equal": [json.dumps(r.summary()) for r in results] == [json.dumps(r.summary())
                                                                             for r in local_results],
            "criteria_equal": [r.criteria.to_json() for r in results] == [r.criteria.to_json() for r in local_results],
            "lost": lost, "passes": passes.stats}


def lose_the_driver(address: str) -> dict:
    """A campaign's driver (a process of its own) killed once its first chunk is saved; ``resume`` from this process
    completes the campaign, each seed once, with the records of an uninterrupted run."""
    import signal
    import subprocess

    from mlflow_di.fuzz import load_campaign
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.distributed import RayExecutor
    from mlflow_di.fuzz.results import comparable_records

    seeds, folder = _seeds(), tempfile.mkdtemp(prefix="mlflow-di-driver-loss-")
    local = run_campaign(Waiting(0.45, 0.0), Waiting(0.47, 0.0), seeds, out_dir=f"{folder}/local", **SETTINGS)
    records = pathlib.Path(folder, "ray", "records.jsonl")
    driver = subprocess.Popen([sys.executable, "-m", "tests.ray_node_loss", "--driver", address, f"{folder}/ray"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (records.exists() and records.read_text().count("\n") >= 4) and time.monotonic() < deadline:
        if driver.poll() is not None:
            break
        time.sleep(0.05)
    saved = records.read_text().count("\n") if records.exists() else 0
    driver.send_signal(signal.SIGKILL)
    driver.wait(30)
    resume_began = time.perf_counter()
    resumed = run_campaign(Waiting(0.45, 0.05), Waiting(0.47, 0.05), seeds, out_dir=f"{folder}/ray", resume=True,
                           executor=RayExecutor(workers=2, address="auto", cpus_per_worker=1, chunk_size=4),
                           **SETTINGS)
    resume_seconds = time.perf_counter() - resume_began
    written = load_campaign(f"{folder}/ray")
    lines = records.read_text().splitlines()
    return {"saved_before_the_kill": saved, "resume_seconds": resume_seconds, "complete": resumed.complete, "seeds": len(seeds),
            "lines": len(lines), "distinct": len({json.loads(line)["index"] for line in lines}),
            "written_equal": comparable_records(written) == comparable_records(local)}


def drive(address: str, folder: str) -> None:
    """The driver :func:`lose_the_driver` kills: the same campaign on the cluster at ``address``."""
    import ray

    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.distributed import RayExecutor

    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    run_campaign(Waiting(0.45, 0.05), Waiting(0.47, 0.05), _seeds(), out_dir=folder,
                 executor=RayExecutor(workers=2, address="auto", cpus_per_worker=1, chunk_size=4), **SETTINGS)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        drive(sys.argv[2], sys.argv[3])
    else:
        main()
