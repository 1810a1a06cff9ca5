"""What every campaign runner checks and computes about its seeds: the arguments, the seed set's
fingerprint, the models' probabilities on seeds (with a one-line error when a model cannot take
them), and the top-1 probabilities a record keeps.

Shared by the lockstep runner (:mod:`mlflow_di.fuzz.campaign`) and DeepXplore
(:mod:`mlflow_di.fuzz.deepxplore`); it imports neither, nor the strategy registry, so the
white-box strategy can use it without importing the black-box campaign back.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.data import ImageSet, fingerprint
from mlflow_di.errors import UserError


def check_arguments(seeds: ImageSet, timeout, max_queries, batch, out_dirs, resume, strategy=None) -> None:
    if not isinstance(seeds, ImageSet):
        raise UserError(f"seeds must be an ImageSet (see mlflow_di.data.load_images), got {type(seeds).__name__}")
    if len(seeds) == 0:
        raise UserError("no seed images given")
    constraint = getattr(strategy, "constraint", None)
    if constraint is not None:  # before any file is written: SSIM needs images of at least its window
        constraint.check_seed(seeds.images[0])
    if not timeout or timeout <= 0:
        raise UserError(f"timeout must be a positive number of seconds, got {timeout}")
    if max_queries is not None and max_queries < 1:
        raise UserError(f"max_queries must be at least 1, got {max_queries}")
    if batch < 1:
        raise UserError(f"batch must be at least 1, got {batch}")
    if resume and out_dirs is None:
        raise UserError("resume needs the output directory of the campaign to continue "
                        "(out_dir=..., or --out-dir on the command line)")


def model_name(model, fallback: str) -> str:
    return str(getattr(model, "name", None) or fallback)


#: Seeds read per batch when the seed set is walked (fingerprint, first predictions): a lazy set
#: (folder:, npz:) is decoded this many images at a time, never whole.
SEED_BATCH = 256


def seed_fingerprint(seeds: ImageSet, progress: bool = False) -> str:
    """SHA-256 of every seed's pixels, then the labels (the same digest whether the seeds are lazy or not)."""
    return fingerprint(seeds, SEED_BATCH, progress, desc="seed fingerprint")


def predict_checked(model, images: np.ndarray, role: str) -> np.ndarray:
    """Probabilities, with a one-line UserError when the model cannot take these images."""
    try:
        probabilities = np.asarray(model.predict_proba(images))
    except UserError:
        raise
    except Exception as exc:  # any backend's shape/type complaint becomes one actionable line
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UserError(f"the {role} model '{model_name(model, role)}' cannot classify the seeds "
                        f"(images {'x'.join(map(str, images.shape[1:]))} HxWxC): {first_line}") from None
    if probabilities.ndim != 2 or len(probabilities) != len(images):
        raise UserError(f"the {role} model's predict_proba must return (N, classes) probabilities; "
                        f"got shape {probabilities.shape} for {len(images)} images")
    return probabilities


def top1(p_original: np.ndarray, p_compressed: np.ndarray) -> tuple[float, float]:
    return float(np.max(p_original)), float(np.max(p_compressed))


def refuse_raw_resize(model, seeds: ImageSet, who: str) -> None:
    """A one-line UserError when a white-box search would need ``model``'s raw-image resize step,
    which has no gradient."""
    if model.preprocessing.has_raw_step and model.preprocessing.needs_raw_step(*seeds.image_shape[:2]):
        raise UserError(f"{model.name}: {who} needs seeds of the model's input size (its raw-image resize step has "
                        "no gradient); prepare the seeds with the model's raw-image step first")


def campaign_config(strategy, seeds: ImageSet, timeout, max_queries, seed: int, original: str, compressed: str,
                    progress: bool = False):
    """The :class:`~mlflow_di.fuzz.results.CampaignConfig` of a campaign of ``strategy`` on ``seeds``
    (its fingerprint read here: a lazy set is walked once)."""
    from mlflow_di.fuzz.results import CampaignConfig

    return CampaignConfig(
        strategy=strategy.name, strategy_options=strategy.options(), timeout=float(timeout), max_queries=max_queries,
        seed=int(seed), data=seeds.name, seed_count=len(seeds), seeds_sha256=seed_fingerprint(seeds, progress),
        image_shape=tuple(seeds.image_shape), original=original, compressed=compressed)
