"""How much reachable IDC moves between trainings, against the paper's IDC, and what its interval costs.

The demo's digits CNN trained with seeds 1..6 on ``digits[0:1300]`` (the demo's 40 epochs), IDC of its
default layer (m = 6, k in {2, 3, 4}) fitted on the same data and scored on ``digits[1300:]``. For each
training: the paper's IDC (covered / all combinations), the combinations, the analysis data's own IDC,
reachable IDC (covered / the combinations the analysis data realise: what the gate judges) with its 95%
interval over 50 analysis-data resamples (the default) and over 200, and the seconds the resamples add to
the fit. The spread of each figure over the six trainings is the table's last row.

Also, per training, how often the important neurons themselves change on a resample: the share of 50
bootstrap resamples whose summed relevance picks a different top-6 set (why the interval refits importance too,
not only the clusters).

    .venv/bin/python -m benchmarks.bench_idc_interval [--seeds 1,2,3,4,5,6] [--no-write]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results import publish  # noqa: E402  (after the path insert)
import mlflow_di  # noqa: E402,F401  (torchvision guard first)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from mlflow_di.coverage.activations import PreprocessedImages  # noqa: E402
from mlflow_di.coverage.idc import ImportanceDrivenCoverage  # noqa: E402
from mlflow_di.coverage.relevance import layer_relevance  # noqa: E402
from mlflow_di.data import load_images  # noqa: E402
from mlflow_di.models import zoo  # noqa: E402
from mlflow_di.models.torch_model import TorchModel  # noqa: E402
from mlflow_di.models.training import train_classifier  # noqa: E402

BEGIN, END = "<!-- bench_idc_interval -->", "<!-- /bench_idc_interval -->"
TRAIN, TEST = "digits[0:1300]", "digits[1300:]"


def trained(seed: int, train) -> TorchModel:
    """The demo's digits CNN as ``mlflow-di demo --seed SEED`` trains it."""
    spec = zoo.architecture("digits-cnn")
    model = TorchModel(zoo.build("digits-cnn", seed=seed), spec.preprocessing, name="digits-cnn")
    train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels), epochs=40, seed=seed)
    model.module.eval()
    return model


def importance_changes(model, train, layer: str, resamples: int = 50, top_m: int = 6) -> float:
    """The share of bootstrap resamples of the analysis inputs whose summed relevance picks another top-m set."""
    attribution = layer_relevance(model.module, PreprocessedImages(train.images, model.preprocessing), [layer],
                                  progress=False)
    relevance = attribution.relevance[layer][attribution.predictions == train.labels].astype(np.float64)
    chosen = set(np.argsort(-relevance.sum(axis=0), kind="stable")[:top_m])
    rng = np.random.default_rng(0)
    changed = 0
    for _ in range(resamples):
        rows = rng.integers(0, len(relevance), len(relevance))
        changed += set(np.argsort(-relevance[rows].sum(axis=0), kind="stable")[:top_m]) != chosen
    return changed / resamples


def measure(seed: int, train, test) -> dict:
    model = trained(seed, train)
    start = time.perf_counter()
    ImportanceDrivenCoverage(seed=0, resamples=0, progress=False).fit(model, train)
    plain_seconds = time.perf_counter() - start
    start = time.perf_counter()
    idc = ImportanceDrivenCoverage(seed=0, resamples=50, progress=False).fit(model, train)
    resampled_seconds = time.perf_counter() - start
    wide = ImportanceDrivenCoverage(seed=0, resamples=200, progress=False).fit(model, train)
    report, report200 = idc.score(test), wide.score(test)
    spread, spread200 = report.reachable_interval(idc.n_analysis_), report200.reachable_interval(wide.n_analysis_)
    return {"seed": seed, "idc": report.idc, "covered": report.covered, "total": report.total,
            "clusters": report.clusters_per_neuron, "analysis": report.analysis_idc, "reachable": report.reachable,
            "idc_reachable": report.idc_reachable, "low": spread.low, "high": spread.high,
            "low200": spread200.low, "high200": spread200.high, "fit_s": plain_seconds,
            "added_s": resampled_seconds - plain_seconds, "neurons_change": importance_changes(model, train, idc.layer_)}


def render(rows: list[dict]) -> str:
    lines = [BEGIN, "## Reachable IDC across trainings (bench_idc_interval)", "",
             "`.venv/bin/python -m benchmarks.bench_idc_interval` (the demo's digits CNN, trained with seeds "
             f"{rows[0]['seed']}..{rows[-1]['seed']} on {TRAIN}, IDC of its default layer fitted on the same data, "
             f"m = 6, k in {{2, 3, 4}}, scored on {TEST}). Reachable IDC = covered / the combinations the analysis "
             "data realise; its interval: percentiles over analysis-data resamples with importance and clusters "
             "refitted.", "",
             "| training seed | paper IDC (covered/all) | clusters | analysis data's own IDC | reachable IDC "
             "(covered/reachable) | 95% interval, 50 resamples | 200 resamples | top-6 changes on a resample | "
             "fit s | + resamples s |",
             "|---:|---:|---|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['idc']:.3f} ({r['covered']}/{r['total']}) | {r['clusters']} | "
                     f"{r['analysis']:.3f} | {r['idc_reachable']:.3f} ({round(r['idc_reachable'] * r['reachable'])}/"
                     f"{r['reachable']}) | {r['low']:.3f}-{r['high']:.3f} | {r['low200']:.3f}-{r['high200']:.3f} | "
                     f"{r['neurons_change']:.0%} | {r['fit_s']:.2f} | {r['added_s']:.2f} |")
    paper = [r["idc"] for r in rows]
    reach = [r["idc_reachable"] for r in rows]
    lines += ["", f"Spread over the {len(rows)} trainings: paper IDC {min(paper):.3f}-{max(paper):.3f} "
              f"(range {max(paper) - min(paper):.3f}); reachable IDC {min(reach):.3f}-{max(reach):.3f} "
              f"(range {max(reach) - min(reach):.3f}); lowest interval end {min(r['low'] for r in rows):.3f}.", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3,4,5,6")
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, test = load_images(TRAIN), load_images(TEST)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.append(measure(seed, train, test))
        print(rows[-1], flush=True)
    section = render(rows)
    publish(section, BEGIN, END, write=not args.no_write)


if __name__ == "__main__":
    main()
