"""What losing a Ray node, or a campaign's driver, costs: tests/ray_node_loss.py run once, its figures as a section.

The script (also what tests/test_ray_node_loss.py runs) builds a local multi-node cluster (a head without CPUs,
three 1-CPU nodes) and loses, in turn: a node in the middle of a fuzz campaign (48 seeds, chunks of 4, stand-in
models waiting 50 ms per call), a node in the middle of a coverage fit (digits-cnn waiting 50 ms per call, 2
workers), and the campaign's driver (SIGKILL after its first chunk is saved, then ``resume``). Each is checked
against an in-process run; this section reports what ran again and what it took.

    .venv/bin/python -m benchmarks.bench_ray_loss [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

from benchmarks.results import publish

BEGIN, END = "<!-- bench_ray_loss -->", "<!-- /bench_ray_loss -->"
REPO = pathlib.Path(__file__).resolve().parents[1]


def measure() -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-m", "tests.ray_node_loss"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900, check=True)
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))


def render(found: dict) -> str:
    fuzz, coverage, driver = found["fuzz"], found["coverage"], found["driver"]
    fit, score = coverage["passes"]
    same = "equal" if fuzz["equal"] and fuzz["written_equal"] else "**NOT equal**"
    lines = [BEGIN, "## Ray: what a lost node or a lost driver costs (bench_ray_loss)", "",
             "`.venv/bin/python -m benchmarks.bench_ray_loss --write` (runs tests/ray_node_loss.py once): a local "
             "`ray.cluster_utils.Cluster` of a head without CPUs and three 1-CPU nodes on this machine's "
             f"{os.cpu_count()} cores (started in {found['cluster_seconds']:.1f} s); each loss checked against an "
             "in-process run.", "",
             f"- **A node lost mid fuzz campaign** (2 workers, {fuzz['stats']['chunks']} chunks of 4 seeds, chunks of "
             f"{fuzz['lost']['mean_chunk_seconds']:.1f} s on average): removed after chunk {fuzz['lost']['after_chunks']}"
             f"; its worker restarted on the idle node and **{fuzz['stats']['chunks_on_restarted_workers']} chunks ran "
             f"on the restarted worker**; the campaign took {fuzz['lost']['campaign_seconds']:.1f} s, its "
             f"{fuzz['records']} records {same} to the in-process campaign's, each seed written once.",
             f"- **A node lost mid coverage fit** (2 workers, {fit['batches']} fit batches and {score['batches']} "
             f"scoring batches): **{coverage['lost']['batches_on_restarted_workers']} batches ran on the restarted "
             f"worker**; the fit pass took {fit['seconds']:.1f} s (pool start {fit['pool_seconds']:.1f} s), the "
             f"scoring pass {score['seconds']:.1f} s on the same pool; fitted suite and results "
             + ("equal to the local path's." if coverage["idc_equal"] and coverage["results_equal"]
                and coverage["criteria_equal"] else "**NOT equal** to the local path's."),
             f"- **The driver killed** after {driver['saved_before_the_kill']} of {driver['seeds']} seeds were saved: "
             f"`resume` searched the rest in {driver['resume_seconds']:.1f} s (workers started again included); "
             f"{driver['lines']} record lines for {driver['distinct']} distinct seeds, records "
             + ("equal to an uninterrupted run's." if driver["written_equal"] else "**NOT equal** to an uninterrupted "
                "run's."), "",
             "What a loss costs is the work of the chunks (or batches) the lost worker held, run again, plus its "
             "restart; finished chunks are never run again, and a killed driver loses only the chunks in flight.",
             END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = parser.parse_args()
    publish(render(measure()), BEGIN, END, write=args.write)


if __name__ == "__main__":
    main()
