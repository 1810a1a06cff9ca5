"""Fuzzing seeds per second against Ray workers: 1, 2, 4 and 8 workers on a local multi-node cluster, with a
stand-in model whose every call waits a fixed time (as a model on a remote accelerator does), and the driver's
ceiling (a model that costs nothing, one query per seed).

The cluster is ``ray.cluster_utils.Cluster`` on the loopback address: a head without CPUs (the driver's) and one
node per worker with one logical CPU. The stand-in's calls sleep, so the 2 real cores of this machine are not
what limits 8 workers: what is measured is how the driver and Ray keep workers busy, the part of a real
cluster's scaling that mlflow-di owns. Efficiency at W workers = (seeds/s with W) / (W x seeds/s with 1).

    .venv/bin/python -m benchmarks.bench_ray_scaling [--workers 1,2,4,8] [--seeds 64] [--delay 0.02] [--write]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback addresses, as mlflow_di._ray.connect

import numpy as np  # noqa: E402

import mlflow_di  # noqa: E402,F401  (torchvision guard first)

BEGIN, END = "<!-- bench_ray_scaling -->", "<!-- /bench_ray_scaling -->"


class Waiting:
    """Class 1 when the mean brightness exceeds ``t``; each call waits ``delay`` s."""

    def __init__(self, t: float, delay: float):
        self.t, self.delay, self.name = t, delay, f"brightness>{t}"

    def predict_proba(self, images):
        if self.delay:
            time.sleep(self.delay)
        p1 = 1 / (1 + np.exp(-40 * (images.reshape(len(images), -1).mean(axis=1) / 255 - self.t)))
        return np.stack([1 - p1, p1], axis=1)


def _seeds(count: int):
    from mlflow_di.data import ImageSet

    images = np.random.default_rng(0).integers(90, 140, (count, 8, 8, 1), dtype=np.uint8)
    return ImageSet(images, np.zeros(count, np.int64), "grey squares")


def measure(workers: list[int], seeds: int, delay: float, queries: int, batch: int, ceiling_seeds: int) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.distributed import RayExecutor
    from mlflow_di.fuzz.results import comparable_records

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(max(workers)):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        seed_set = _seeds(seeds)
        settings = dict(strategy="dflare", max_queries=queries, batch=batch, seed=0, timeout=1e9, progress=False)
        folder = tempfile.mkdtemp(prefix="bench-ray-scaling-")
        # two equal models: no seed ever deviates, so every seed spends its whole budget (a campaign's worst case)
        local = run_campaign(Waiting(0.45, 0.0), Waiting(0.45, 0.0), seed_set, out_dir=f"{folder}/local", **settings)
        rows = []
        for count in workers:
            executor = RayExecutor(workers=count, address="auto", cpus_per_worker=1, chunk_size=batch)
            began = time.perf_counter()
            result = run_campaign(Waiting(0.45, delay), Waiting(0.45, delay), seed_set, out_dir=f"{folder}/w{count}",
                                  executor=executor, **settings)
            seconds = time.perf_counter() - began
            returned = sorted(executor.stats["returned_seconds"])
            first_wave = returned[min(count, len(returned)) - 1]  # every worker started and one chunk back from each
            after = len(returned) - count
            rows.append({"workers": count, "seconds": seconds, "seeds_per_s": seeds / seconds,
                         "equal": comparable_records(result) == comparable_records(local),
                         "calls": sum(r.queries for r in result.records), "first_wave": first_wave,
                         "steady_seeds_per_s": after * batch / (returned[-1] - first_wave) if after > 0 else None})
        executor = RayExecutor(workers=2, address="auto", cpus_per_worker=1, chunk_size=batch)
        began = time.perf_counter()
        run_campaign(Waiting(0.45, 0.0), Waiting(0.47, 0.0), _seeds(ceiling_seeds), out_dir=f"{folder}/ceiling",
                     executor=executor, **{**settings, "max_queries": 1})
        ceiling = ceiling_seeds / (time.perf_counter() - began)
    finally:
        ray.shutdown()
        cluster.shutdown()
    one = rows[0]["seeds_per_s"] / rows[0]["workers"]
    steady_one = (rows[0]["steady_seeds_per_s"] or 0) / rows[0]["workers"]
    for row in rows:
        row["efficiency"] = row["seeds_per_s"] / (row["workers"] * one)
        row["steady_efficiency"] = (row["steady_seeds_per_s"] / (row["workers"] * steady_one)
                                    if row["steady_seeds_per_s"] and steady_one else None)
    return {"rows": rows, "seeds": seeds, "delay": delay, "queries": queries, "batch": batch, "ceiling": ceiling,
            "ceiling_seeds": ceiling_seeds}


def render(result: dict) -> str:
    per_chunk = result["queries"] * 2 * result["delay"]
    lines = [BEGIN, "## Fuzzing on Ray: seeds per second against workers (bench_ray_scaling)", "",
             f"`.venv/bin/python -m benchmarks.bench_ray_scaling --workers "
             f"{','.join(str(r['workers']) for r in result['rows'])} --seeds {result['seeds']} --delay {result['delay']} "
             f"--write`: DFlare, {result['seeds']} seeds of 8x8 grey squares, two equal models (no seed deviates, so each "
             f"spends its whole `--max-queries {result['queries']}`), chunks "
             f"of {result['batch']} seeds; both models wait {result['delay'] * 1000:g} ms per call (a model on a remote "
             f"accelerator), so a chunk is about {per_chunk:.1f} s of waiting. A local `ray.cluster_utils.Cluster`: a "
             "head without CPUs (the driver) and one 1-CPU node per worker, on this machine's "
             f"{os.cpu_count()} cores ({platform.machine()}); load average {os.getloadavg()[0]:.2f} at the end. Every "
             "run's per-seed records equal the in-process campaign's (checked).", "",
             "| workers | seconds | seeds/s | efficiency | first chunk back from every worker at (s) | seeds/s after "
             "that | efficiency after that | records equal |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        steady = (f"{row['steady_seeds_per_s']:.2f} | {row['steady_efficiency']:.0%}" if row["steady_efficiency"]
                  else "- | -")
        lines.append(f"| {row['workers']} | {row['seconds']:.1f} | {row['seeds_per_s']:.2f} | {row['efficiency']:.0%} | "
                     f"{row['first_wave']:.1f} | {steady} | {'yes' if row['equal'] else 'NO'} |")
    lines += ["", "*Efficiency* counts the whole campaign, the workers' start included (each starts a Python "
              "process, imports mlflow-di and PyTorch and loads both models: CPU work that W workers on this machine's "
              f"{os.cpu_count()} cores do in turn, and nodes of a real cluster each do on their own). *After that*: the "
              "chunks that came back after every worker's first one, over the time they took: how the driver and "
              "Ray keep W busy workers fed."]
    lines += ["", f"The driver's ceiling (a free model, one query per seed, 2 workers, {result['ceiling_seeds']:,} "
              f"seeds): {result['ceiling']:.0f} seeds/s taken in and written to the campaign folder. A real cluster "
              "scales as this table does while the workers' seeds/s stay under that ceiling: W workers each finishing "
              "s seeds/s need W x s below it.", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--seeds", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.02)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ceiling-seeds", type=int, default=4000)
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    from benchmarks.results import publish

    workers = [int(part) for part in args.workers.split(",")]
    publish(render(measure(workers, args.seeds, args.delay, args.queries, args.batch, args.ceiling_seeds)), BEGIN, END,
            write=args.write)


if __name__ == "__main__":
    main()
