"""A fuzz campaign on a local multi-node Ray cluster that loses a node mid-work (run as a script by
tests/test_ray_node_loss.py, in its own process: one process joins one Ray cluster).

The cluster (``ray.cluster_utils.Cluster``, every node on the loopback address): a head with no CPUs and three
worker nodes of one CPU, so each of the campaign's two workers sits on its own node and one node is idle. Once
the first chunk is back, a node that holds a worker (no CPU left) is removed: its worker is restarted on the
idle node and runs the chunks it held again. Prints one JSON line: whether the records equal the same campaign run in this
process, whether it completed, the executor's stats and the seconds each part took.
"""
from __future__ import annotations

import json
import os
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

    from mlflow_di.data import ImageSet
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.distributed import RayExecutor
    from mlflow_di.fuzz.results import comparable_records

    began = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {node.node_id: node for node in (cluster.add_node(num_cpus=1) for _ in range(3))}
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        started = time.perf_counter() - began
        images = np.random.default_rng(0).integers(90, 140, (48, 8, 8, 1), dtype=np.uint8)
        seeds = ImageSet(images, np.zeros(len(images), np.int64), "grey squares")
        settings = dict(strategy="dflare", max_queries=30, batch=4, seed=0, timeout=600, progress=False)
        folder = tempfile.mkdtemp(prefix="mlflow-di-node-loss-")
        local = run_campaign(Waiting(0.45, 0.0), Waiting(0.47, 0.0), seeds, out_dir=f"{folder}/local", **settings)
        executor = RayExecutor(workers=2, address="auto", cpus_per_worker=1, chunk_size=4)
        lost = {}

        def lose_a_node():
            from ray._private.state import available_resources_per_node

            while not executor.stats.get("chunk_seconds"):
                time.sleep(0.05)
            busy = [node_id for node_id, free in available_resources_per_node().items()
                    if node_id in nodes and free.get("CPU", 0) < 1]
            lost["after_chunks"] = len(executor.stats["chunk_seconds"])
            cluster.remove_node(nodes[busy[0]])
            lost["at"] = time.perf_counter() - began

        threading.Thread(target=lose_a_node, daemon=True).start()
        spread = run_campaign(Waiting(0.45, 0.05), Waiting(0.47, 0.05), seeds, out_dir=f"{folder}/ray",
                              executor=executor, **settings)
        from mlflow_di.fuzz import load_campaign

        written = load_campaign(f"{folder}/ray")
        print(json.dumps({"equal": comparable_records(local) == comparable_records(spread),
                          "written_equal": comparable_records(written) == comparable_records(local),
                          "records": len(written.records), "seeds": len(seeds), "complete": spread.complete,
                          "stats": {k: v for k, v in executor.stats.items() if k != "chunk_seconds"}, "lost": lost,
                          "cluster_seconds": started, "seconds": time.perf_counter() - began}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
