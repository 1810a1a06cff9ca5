"""IDC RQ1 (paper Table 2): are the neurons IDC calls important really the ones that matter?

For each LeNet: fit IDC (top m = 6 neurons of the default subject layer) on the analysis set;
for each U_O input flip its most relevant pixels (top 10% by input-pixel LRP); measure the L2
change of the subject layer's activations over the m important neurons and over m random other
neurons of the same layer (several draws). Important neurons should change more.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.coverage.activations import PreprocessedImages, collect_activations

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.perturb import flip_pixels, relevant_pixel_mask
from benchmarks.reproduce.results import ExperimentResult, Log


def activation_change(model, layer: str, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """(N, neurons) differences (after - before) of ``layer``'s neuron values between two image sets."""
    values = [collect_activations(model.module, PreprocessedImages(images, model.preprocessing), [layer])[layer]
              for images in (before, after)]
    return values[1] - values[0]


def random_draws(width: int, important: np.ndarray, m: int, draws: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``draws`` sets of m neurons among the layer's non-important ones (all of them if fewer than m)."""
    others = np.setdiff1d(np.arange(width), important)
    return [rng.choice(others, size=min(m, len(others)), replace=False) for _ in range(draws)]


def measure_model(config: Config, subjects, name: str, index: int) -> dict:
    model = subjects.idc_models[name]
    idc = subjects.idc(name, config.rq1_top_m, 0)
    images = subjects.test.images[:config.rq1_inputs]
    mask = relevant_pixel_mask(model, images, config.rq1_pixel_fraction)
    change = activation_change(model, idc.layer_, images, flip_pixels(images, mask))
    important = idc.important_neurons_
    rng = np.random.default_rng([1, index])
    draws = random_draws(change.shape[1], important, config.rq1_top_m, config.rq1_random_draws, rng)
    important_l2 = np.linalg.norm(change[:, important], axis=1)
    random_l2 = np.stack([np.linalg.norm(change[:, draw], axis=1) for draw in draws])  # (draws, N)
    draw_means = random_l2.mean(axis=1)
    return {
        "model": name, "layer": idc.layer_, "neurons": int(change.shape[1]), "m": int(len(important)),
        "random_pool": int(change.shape[1] - len(important)),
        "inputs": int(len(images)), "pixels_flipped": float(mask.reshape(len(mask), -1).sum(axis=1).mean()),
        "important_mean": float(important_l2.mean()), "important_std": float(important_l2.std(ddof=1)),
        "random_mean": float(random_l2.mean()), "random_std": float(random_l2.std(ddof=1)),
        "random_draw_means": [float(v) for v in draw_means],
        "ratio": float(important_l2.mean() / random_l2.mean()) if random_l2.mean() > 0 else float("inf"),
        "share_important_larger": float((important_l2[None, :] > random_l2).mean()),
    }


def run(config: Config, subjects, log: Log) -> ExperimentResult:
    rows = []
    for index, name in enumerate(subjects.idc_models):
        log(f"idc_rq1: {name}")
        rows.append(measure_model(config, subjects, name, index))
    meta = {"inputs": f"U_O[:{config.rq1_inputs}]", "perturbation": "pixel flipping (>127.5 -> 0, else 255)",
            "pixels": f"top {config.rq1_pixel_fraction:.0%} by |input LRP| (epsilon rule)",
            "random_draws": config.rq1_random_draws}
    return ExperimentResult("idc_rq1", rows, meta, config.to_dict())
