"""Check the paper-era re-implementation against what the DeepImportance authors stored.

The repository DeepImportance/deepimportance_code_release kept, in its history (commit
91cb0a2, "Add experiment files"), the relevance sums of its LRP (``experiments/*_totalR_<class>_relevances.h5``)
and the per-class centroids of its Table 3 runs (``experiments/<model>_<class>_<layer>_<m>_silhouette_quantization.h5``).
This script compares them with :mod:`benchmarks.reproduce.reference_lrp` and the reference
clustering (:func:`mlflow_di.coverage.clustering.choose_clusters` with ``reference_quirks``) on the
same models and the MNIST training split, and writes a section of REPRODUCTION.md:

    python -m benchmarks.reproduce.check_reference --repo PATH_TO_A_CLONE [--shared ../shared] [--write]

Needs git and h5py; the clone is read with ``git show`` only.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import re
import subprocess

import h5py
import mlflow_di  # noqa: F401  (torchvision guard)
import numpy as np
import torch

from mlflow_di.data import load_images
from mlflow_di.models.keras_import import import_keras

from benchmarks.reproduce.config import default_shared
from benchmarks.reproduce.idc_paper_era import ReferenceTraces
from benchmarks.reproduce.reference_lrp import summed_relevance
from benchmarks.results import write_section

COMMIT = "91cb0a2"
BEGIN, END = "<!-- check_reference -->", "<!-- /check_reference -->"
REPRODUCTION = pathlib.Path(__file__).resolve().parents[1] / "REPRODUCTION.md"
#: Subject layer per model: our block name and the Keras layer index in the stored file names.
SUBJECT = {"LeNet1": ("conv2", 3), "LeNet4": ("fc1", 6), "LeNet5": ("fc2", 7)}
CENTROID_TOLERANCE = 0.011  # the stored centroids are rounded to 2 decimals


def stored_files(repo: pathlib.Path, pattern: str) -> list[str]:
    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", COMMIT, "experiments/"],
                           check=True, capture_output=True, text=True).stdout.split()
    return sorted(n for n in names if re.fullmatch(pattern, n))


def read_h5(repo: pathlib.Path, name: str) -> dict[str, np.ndarray]:
    blob = subprocess.run(["git", "-C", str(repo), "show", f"{COMMIT}:{name}"], check=True, capture_output=True).stdout
    with h5py.File(io.BytesIO(blob), "r") as handle:
        group = handle["group0"]
        return {key: group[key][()] for key in group}


def _channels_first(stored: np.ndarray) -> np.ndarray:
    stored = stored[0]
    return np.moveaxis(stored, -1, 0) if stored.ndim == 3 else stored


def check_relevance(repo, traces: ReferenceTraces, name, train) -> list[dict]:
    """Stored totalR vs our summed reference relevance, per stored class file and layer."""
    rows = []
    for path in stored_files(repo, rf"experiments/{name}_totalR_(-?\d)_relevances\.h5"):
        label = int(re.search(r"totalR_(-?\d)_", path).group(1))
        chosen = traces.correct if label < 0 else (train.labels == label) & traces.correct
        x = torch.as_tensor(np.asarray(traces.model.preprocessing.apply(train.images[chosen])))
        ours = summed_relevance(traces.model.module, x)
        stored = read_h5(repo, path)
        neuron_errors, element_errors = [], []
        for index in range(len(stored)):
            theirs = _channels_first(stored[f"totalR_{index}"])
            flattened_map = ours[index].ndim == 1 and index > 0 and ours[index - 1].ndim == 3
            if theirs.shape != ours[index].shape or flattened_map:
                continue  # Keras flattens channels last: the flatten's own output is in another order
            element_errors.append(_relative_error(ours[index], theirs))
            if theirs.ndim == 3:  # a neuron of a map is a channel
                neuron_errors.append(_relative_error(ours[index].sum((1, 2)), theirs.sum((1, 2))))
            else:
                neuron_errors.append(element_errors[-1])
        rows.append({"model": name, "class": label, "inputs": int(chosen.sum()), "layers": len(neuron_errors),
                     "max_relative_error": max(neuron_errors), "max_relative_error_elementwise": max(element_errors)})
    return rows


def _relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def check_centroids(repo, traces: ReferenceTraces, name) -> dict:
    """Stored per-class centroids vs ours (the paper-era experiment's own fits, k-means seed 0),
    neuron by neuron in the stored (ascending) order."""
    keras_index = SUBJECT[name][1]
    counts = {"neurons": 0, "same_k": 0, "same_centroids": 0, "files": 0}
    for path in stored_files(repo, rf"experiments/{name}_\d_{keras_index}_\d+_silhouette_quantization\.h5"):
        label, m = map(int, re.search(rf"{name}_(\d)_{keras_index}_(\d+)_", path).groups())
        order, centroids = traces.fit(label, m, seed=0)
        stored = read_h5(repo, path)
        counts["files"] += 1
        for i, neuron in enumerate(np.sort(order)):
            theirs = np.sort(np.ravel(stored[f"q{i}"]))
            ours = np.sort(centroids[int(neuron)])
            counts["neurons"] += 1
            if len(ours) == len(theirs):
                counts["same_k"] += 1
                counts["same_centroids"] += int(np.abs(ours - theirs).max() <= CENTROID_TOLERANCE)
    return {"model": name, **counts}


def render(relevance_rows: list[dict], centroid_rows: list[dict], command: str) -> str:
    lines = [BEGIN, "## Checking the paper-era re-implementation against the authors' stored files", "",
             f"Made by `{command}`. The DeepImportance repository's history (commit {COMMIT}) holds the relevance sums its "
             "LRP stored (`totalR`, every layer, summed over a class's correctly classified training inputs) and the "
             "per-class centroids of its Table 3 runs. `benchmarks/reproduce/reference_lrp.py` (no conv ReLUs, plain "
             "z-rule) and the reference clustering, run on the same LeNets and the 60,000-image training split, give:", "",
             "| model | class | inputs | layers compared | max relative error per neuron | max relative error per element |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {'all' if r['class'] < 0 else r['class']} | {r['inputs']:,} | {r['layers']} | "
              f"{r['max_relative_error']:.1e} | {r['max_relative_error_elementwise']:.1e} |" for r in relevance_rows]
    lines += ["", "| model | stored centroid files | important neurons | same cluster count | same centroids (within 0.01) |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['files']} | {r['neurons']} | {r['same_k']} ({100 * r['same_k'] / r['neurons']:.0f}%) | "
              f"{r['same_centroids']} ({100 * r['same_centroids'] / r['neurons']:.0f}%) |" for r in centroid_rows]
    lines += ["", "Errors relative to the layer's largest stored value; a neuron of a convolution or pooling map is a "
              "channel (its relevance summed over positions), as for IDC. The per-neuron sums agree to float precision, "
              "so the reference LRP is reproduced; where single elements of a map differ more, relevance has moved "
              "between positions of one channel, not between channels, which is what max-pooling windows whose maxima "
              "tie in one implementation and not in the other would do (blank background gives many positions of a map "
              "the same value up to rounding). The centroid "
              "files agree less: the cluster counts, which decide |INCC|, match for almost every neuron, but the "
              "centroids themselves differ for many, which points to those files having been made from other important "
              "neurons or other analysis inputs than the relevance sums above (a shifted neuron moves every later "
              "position of the ascending list). The paper-era table above therefore rests on the reference LRP and "
              "clustering rules, not on the stored centroids.", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reproduce.check_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=pathlib.Path, required=True, help="a clone of DeepImportance/deepimportance_code_release")
    parser.add_argument("--shared", type=pathlib.Path, default=default_shared())
    parser.add_argument("--write", action="store_true", help="write the section into benchmarks/REPRODUCTION.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    train = load_images(f"mnist-train:{args.shared / 'data' / 'mnist'}")
    relevance_rows, centroid_rows = [], []
    for name in SUBJECT:
        model = import_keras(name.lower(), args.shared / "models" / "deepimportance" / f"{name}.h5")
        traces = ReferenceTraces(model, train, SUBJECT[name][0])
        relevance_rows += check_relevance(args.repo, traces, name, train)
        centroid_rows.append(check_centroids(args.repo, traces, name))
        print(relevance_rows[-1], centroid_rows[-1], flush=True)
    section = render(relevance_rows, centroid_rows, "python -m benchmarks.reproduce.check_reference --repo PATH --write")
    print(section)
    if args.write:
        write_section(section, BEGIN, END, REPRODUCTION)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
