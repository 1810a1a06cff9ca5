"""Drepair in one call: campaigns and both models in, a trained head and its measurements out."""
from __future__ import annotations

import dataclasses

from mlflow_di.errors import UserError
from mlflow_di.models.head import ProbabilityHead
from mlflow_di.repair.dataset import RepairSet, collect_images, label_images
from mlflow_di.repair.evaluate import CleanAccuracy, CrossValidation, clean_accuracy, cross_validate
from mlflow_di.repair.training import HeadSettings, train_head
from mlflow_di.results_json import JsonRoundTrip


@dataclasses.dataclass
class RepairResult(JsonRoundTrip):
    """The settings, what the training set held, the cross-validation and the clean-test accuracy
    (None without test data) of one repair."""

    settings: HeadSettings
    folds: int
    mutants_per_seed: int
    seed: int
    training_set: dict
    cross_validation: CrossValidation
    clean: CleanAccuracy | None = None

    JSON_DUMPS = {"indent": 2}


def training_set(campaigns, original, compressed, mutants_per_seed: int = 8, seed: int = 0,
                 batch_size: int | None = None) -> RepairSet:
    """The examples of ``campaigns`` labelled by both models; a one-line :class:`UserError` when
    none of them deviates (nothing to repair: campaigns of another model pair, most likely)."""
    images = collect_images(campaigns, mutants_per_seed=mutants_per_seed, seed=seed)
    data = label_images(images, original, compressed, batch_size)
    if not data.deviating.any():
        raise UserError(f"the two models agree on all {len(data)} examples from the campaigns (seeds, triggers, "
                        "mutants): nothing to repair; were the campaigns fuzzed with these models?")
    return data


def repair(campaigns, original, compressed, settings: HeadSettings = HeadSettings(), folds: int = 5,
           mutants_per_seed: int = 8, seed: int = 0, test_data=None, batch_size: int | None = None,
           data: RepairSet | None = None) -> tuple[RepairResult, ProbabilityHead, RepairSet]:
    """Build the training set from ``campaigns`` (or take ``data``, made by :func:`training_set`
    with the same arguments), cross-validate, train the final head on all of it and (with
    ``test_data``, an ImageSet with labels) measure clean-test accuracy.

    Returns the measurements, the head trained on every example, and the training set."""
    if data is None:
        data = training_set(campaigns, original, compressed, mutants_per_seed, seed, batch_size)
    validation = cross_validate(data, settings, folds, seed)
    head = train_head(data.probabilities, data.original_labels, settings, data.deviating)
    clean = clean_accuracy(original, compressed, head, test_data, batch_size) if test_data is not None else None
    return RepairResult(settings, folds, mutants_per_seed, seed=seed, training_set=data.counts(),
                        cross_validation=validation, clean=clean), head, data
