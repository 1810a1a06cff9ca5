"""Does a seeded campaign write the same records idle and beside processes that keep every core busy?

A seed's budget is work (``--max-queries``), time only a safety net (CPU seconds per seed). Each
campaign runs twice in one fresh process: idle with the default safety net, which shows what each
seed needs; then beside N CPU-burning processes with the net at ``--net`` times what the slowest
seed needed idle. The table says whether the loaded run wrote the same records (seconds aside),
how many seeds the net stopped, and how much the load inflated each seed's charged CPU seconds.

The cost of counting the budget in work: DFlare's CPU seconds per query with its default 2,000-query
budget beside the same campaign with no query cap and a time budget (every seed stopped by the
clock, as the paper's budget is), over the seeds' queries.

Subject: the DFlare LeNet-5 reference pair (``lenet5.h5`` as ``lenet5-same`` vs ``lenet5-quan.lite``),
MNIST test seeds [9000:9020], the product's defaults otherwise (2,000 queries per seed).

    .venv/bin/python -m benchmarks.bench_load [--shared ../shared] [--burners 8] [--net 1.5] [--threads 1,2] [--no-write]

``--threads``: the models' intra-op threads (MLFLOW_DI_THREADS), each setting its own rows; the product's
default is one per core, whose idle threads spin and so charge more CPU seconds on a loaded machine.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

BEGIN, END = "<!-- bench_load -->", "<!-- /bench_load -->"
KINDS = ("boundary L-inf 32", "boundary SSIM 0.9", "dflare")


def campaign(kind: str, shared: pathlib.Path, timeout: float, max_queries: int | None = 2000):
    """One campaign of ``kind`` on the reference pair; returns its result."""
    import mlflow_di
    from mlflow_di.fuzz.boundary import BoundaryWalk, run_boundary
    from mlflow_di.fuzz.campaign import run_campaign
    from mlflow_di.fuzz.realism import Constraint

    models = shared / "models" / "dflare"
    original = mlflow_di.load_torch_model(f"keras:lenet5-same:{models / 'lenet5.h5'}")
    compressed = mlflow_di.load_classifier(str(models / "lenet5-quan.lite"))
    seeds = mlflow_di.load_images(f"mnist-test:{shared / 'data' / 'mnist'}[9000:9020]")
    if kind == "dflare":
        return run_campaign(original.classifier(), compressed, seeds, "dflare", timeout=timeout,
                            max_queries=max_queries, seed=0, progress=False)
    constraint = Constraint(max_linf=32) if "L-inf" in kind else Constraint(min_ssim=0.9)
    return run_boundary(original, compressed, seeds, BoundaryWalk(constraint=constraint), timeout=timeout,
                        max_queries=max_queries, seed=0, progress=False)


def one(kind: str, shared: pathlib.Path, burners: int, net: float) -> dict:
    """Idle, then loaded with the net at ``net`` x the slowest idle seed: the figures of one campaign."""
    from mlflow_di.fuzz.contract import DEFAULT_TIMEOUT
    from mlflow_di.fuzz.results import comparable_records

    idle = campaign(kind, shared, DEFAULT_TIMEOUT)
    slowest = max(r.seconds for r in idle.records)
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        time.sleep(0.5)
        wall = time.perf_counter()
        loaded = campaign(kind, shared, net * slowest)
        wall = time.perf_counter() - wall
        load = os.getloadavg()[0]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    # seeds of a few milliseconds are all clock resolution: their ratios say nothing
    ratios = sorted(b.seconds / a.seconds for a, b in zip(idle.records, loaded.records) if a.seconds > 0.02) or [0.0]
    return {"kind": kind, "seeds": len(idle.records), "triggers": idle.summary.triggers,
            "identical": comparable_records(idle) == comparable_records(loaded),
            "timed_out": sum(r.stop.value == "timeout" for r in loaded.records),
            "slowest_idle_s": slowest, "net_s": net * slowest, "slowest_loaded_s": max(r.seconds for r in loaded.records),
            "inflation_max": ratios[-1], "inflation_median": ratios[len(ratios) // 2],
            "idle_wall_s": sum(r.seconds for r in idle.records), "loaded_wall_s": wall, "load": load}


def per_query_cost(shared: pathlib.Path) -> dict:
    """CPU seconds per query: DFlare under its query budget vs with none (a time budget per seed)."""
    budgeted = campaign("dflare", shared, 600.0)
    seconds = sorted(r.seconds for r in budgeted.records if r.stop.value == "max_queries")
    timed = campaign("dflare", shared, seconds[len(seconds) // 2] if seconds else 1.0, max_queries=None)

    def cost(result):
        searched = [r for r in result.records if not r.already_deviating]
        return sum(r.seconds for r in searched) / max(1, sum(r.queries for r in searched))
    return {"budgeted_ms": 1000 * cost(budgeted), "timed_ms": 1000 * cost(timed)}


def render(rows: list[dict], cost: dict, args) -> str:
    lines = [BEGIN, "## A seeded campaign idle and under load (bench_load)", "",
             f"`python -m benchmarks.bench_load --burners {args.burners} --net {args.net:g} --threads {args.threads}` "
             f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores; each campaign in a fresh process). DFlare LeNet-5 "
             "pair, MNIST test [9000:9020], 2,000 queries per seed. Idle with the default safety net (600 CPU s), "
             f"then beside {args.burners} CPU-burning processes with the net at {args.net:g}x the slowest idle seed.", "",
             "| campaign | model threads | triggers | records identical | stopped by the net | slowest seed idle / loaded "
             "(CPU s) | net (CPU s) | CPU inflation per seed, median / max | wall idle / loaded (s) | load |",
             "|---|---:|---:|---|---:|---|---:|---|---|---:|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['threads']} | {r['triggers']}/{r['seeds']} | {'yes' if r['identical'] else '**no**'} | "
                     f"{r['timed_out']} | {r['slowest_idle_s']:.2f} / {r['slowest_loaded_s']:.2f} | {r['net_s']:.2f} | "
                     f"{r['inflation_median']:.2f}x / {r['inflation_max']:.2f}x | {r['idle_wall_s']:.1f} / "
                     f"{r['loaded_wall_s']:.1f} | {r['load']:.1f} |")
    lines += ["", f"Counting the budget in queries costs nothing measurable per query: DFlare under its 2,000-query "
              f"budget spent {cost['budgeted_ms']:.3f} ms of CPU per query, the same campaign with no query cap and "
              f"a time budget {cost['timed_ms']:.3f} ms (idle, one process).", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(pathlib.Path(__file__).resolve().parents[2] / "shared"))
    parser.add_argument("--burners", type=int, default=8)
    parser.add_argument("--net", type=float, default=1.5, help="the safety net under load, x the slowest idle seed")
    parser.add_argument("--threads", default="1", help="MLFLOW_DI_THREADS for the models (comma-separated: each)")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: run one campaign, print JSON
    args = parser.parse_args()
    shared = pathlib.Path(args.shared)
    if args.one is not None:
        import mlflow_di  # noqa: F401  (first, as a user's program: its settings apply before torch loads)
        import torch

        torch.set_num_threads(int(args.threads))
        figures = per_query_cost(shared) if args.one == "cost" else one(args.one, shared, args.burners, args.net)
        print(json.dumps({**figures, "threads": int(args.threads)}))
        return

    def child(what: str, threads: str) -> dict:
        env = {**os.environ, "MLFLOW_DI_THREADS": threads, "OMP_NUM_THREADS": threads}
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_load", "--one", what, "--shared", str(shared),
                              "--burners", str(args.burners), "--net", str(args.net), "--threads", threads],
                             env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    settings = args.threads.split(",")
    rows = [child(kind, threads) for threads in settings for kind in KINDS]
    section = render(rows, child("cost", settings[0]), args)
    print(section)
    if not args.no_write:
        from benchmarks.results import write_section

        write_section(section, BEGIN, END)


if __name__ == "__main__":
    main()
