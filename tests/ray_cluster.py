"""A local multi-node Ray cluster for a test that needs one outside its own process (run as a script).

``python -m tests.ray_cluster CPUS [CPUS ...]`` starts ``ray.cluster_utils.Cluster`` on the loopback
address: a head with no CPUs (as a cluster's head usually is) and one worker node per argument with
that many CPUs. It prints one JSON line with the cluster's address, then waits; when its standard
input closes (the test ends, or dies) it shuts the cluster down, so every Ray process it started
stops with it.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every node's address the loopback one


def main(cpus: list[float]) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for count in cpus:
            cluster.add_node(num_cpus=count)
        cluster.wait_for_nodes()
        print(json.dumps({"address": cluster.address}), flush=True)
        sys.stdin.read()  # until the test closes it
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main([float(value) for value in sys.argv[1:]] or [2.0])
