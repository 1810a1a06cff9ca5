"""The repair training set, built from fuzz campaigns.

A campaign folder keeps, for every seed that triggered, the seed image and its triggering input
(:mod:`mlflow_di.fuzz.store`); it keeps no other mutant, and no image of a seed that did not
trigger (or already deviated). So the examples are, per triggering seed:

* the seed (the two models agree on it: a campaign fuzzes only seeds they agree on),
* the trigger (they disagree on it),
* ``mutants_per_seed`` fresh mutants of the seed, made with the project's own mutation operators
  (:mod:`mlflow_di.fuzz.mutations`) from a generator seeded with ``seed``: a random chain of 1 to
  ``max_chain`` operators each. These stand in for the non-triggering mutants the search saw and
  did not keep; most are agreeing examples, which teach the head not to over-correct (a mutant
  that happens to deviate is a deviating example like a trigger).

The paper trains on seeds and triggers; the mutants are this package's addition. Every image is
then run through both models (:func:`label_images`): the compressed model's probability vector
is the head's input and the original model's label its target. Each example keeps its *group*:
the seed image it comes from, keyed by a hash of the image's bytes (:func:`image_key`), so that
cross-validation keeps a seed's images on one side of a split even when two campaigns (the same
data fuzzed twice, or with another ``--seed``) triggered on the same seed image.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.fuzz.mutations import default_operators

KINDS = ("seed", "trigger", "mutant")


@dataclasses.dataclass
class RepairImages:
    """Images (uint8 N, H, W, C) with their group (index into ``group_names``) and kind (index into KINDS)."""

    images: np.ndarray
    groups: np.ndarray
    kinds: np.ndarray
    group_names: list[str]

    def __len__(self) -> int:
        return len(self.images)


@dataclasses.dataclass
class RepairSet:
    """Per example: the compressed model's probabilities (N, C), both models' labels, group and kind."""

    probabilities: np.ndarray
    original_labels: np.ndarray
    compressed_labels: np.ndarray
    groups: np.ndarray
    kinds: np.ndarray
    group_names: list[str] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.probabilities)

    @property
    def num_classes(self) -> int:
        return self.probabilities.shape[1]

    @property
    def deviating(self) -> np.ndarray:
        """Mask of the examples on which the two models disagree."""
        return self.original_labels != self.compressed_labels

    def subset(self, mask: np.ndarray) -> "RepairSet":
        return RepairSet(self.probabilities[mask], self.original_labels[mask], self.compressed_labels[mask],
                         self.groups[mask], self.kinds[mask], self.group_names)

    def counts(self) -> dict:
        """Examples by kind, deviating ones and groups (seeds), for reports."""
        found = {f"{kind}s": int(np.sum(self.kinds == i)) for i, kind in enumerate(KINDS)}
        return {"examples": len(self), **found, "deviating": int(self.deviating.sum()),
                "seeds": int(len(np.unique(self.groups)))}


def image_key(image) -> str:
    """A key for one image: the SHA-256 of its shape and uint8 bytes (equal images, equal keys)."""
    array = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
    return hashlib.sha256(repr(array.shape).encode() + array.tobytes()).hexdigest()


def seed_keys(campaigns) -> set[str]:
    """The :func:`image_key` of every triggering seed image of ``campaigns``: the seeds a repair trains on."""
    return {image_key(seed_image) for campaign in campaigns for seed_image in campaign.trigger_seeds}


def shared_seed_images(images, campaigns, batch: int = 256) -> int:
    """How many of ``images`` (an array or lazy images, N H W C) equal a triggering seed image of
    ``campaigns``: test images the head would have been trained on."""
    keys = seed_keys(campaigns)
    return sum(image_key(image) in keys for start in range(0, len(images), batch)
               for image in np.asarray(images[start:start + batch]))


def collect_images(campaigns, mutants_per_seed: int = 8, max_chain: int = 3, seed: int = 0,
                   operators=None) -> RepairImages:
    """Seeds, triggers and fresh mutants of every triggering seed of ``campaigns``
    (:class:`~mlflow_di.fuzz.results.CampaignResult` objects), in campaign and seed order.

    Examples of equal seed images share one group whatever campaign they come from; a group is
    named ``seed:`` and the first 16 hex digits of the image's key."""
    operators = tuple(operators or default_operators())
    rng = np.random.default_rng(seed)
    images, groups, kinds, names = [], [], [], []
    numbers: dict[str, int] = {}
    for campaign in campaigns:
        for trigger, seed_image in zip(campaign.triggers, campaign.trigger_seeds):
            key = image_key(seed_image)
            if key not in numbers:
                numbers[key] = len(names)
                names.append(f"seed:{key[:16]}")
            group = numbers[key]
            images += [seed_image, trigger]
            kinds += [0, 1]
            for _ in range(mutants_per_seed):
                mutant = seed_image
                for _ in range(int(rng.integers(1, max_chain + 1))):
                    mutant = operators[int(rng.integers(len(operators)))](mutant, rng)
                images.append(mutant)
                kinds.append(2)
            groups += [group] * (2 + mutants_per_seed)
    if not names:
        raise UserError("the campaigns hold no triggering input: nothing to repair (fuzz longer, or with more seeds)")
    shapes = {image.shape for image in images}
    if len(shapes) > 1:
        raise UserError(f"the campaigns' images differ in shape ({sorted(shapes)}); repair campaigns of one model pair")
    return RepairImages(np.stack(images), np.asarray(groups, np.int64), np.asarray(kinds, np.int64), names)


def label_images(data: RepairImages, original, compressed, batch_size: int | None = None) -> RepairSet:
    """Run both black-box classifiers on ``data``: the compressed model's probabilities, both labels."""
    probabilities = compressed.predict_proba(data.images, batch_size)
    original_labels = original.predict(data.images, batch_size)
    if original_labels.max(initial=0) >= probabilities.shape[1]:
        raise UserError(f"the original model predicts class {int(original_labels.max())} but the compressed model "
                        f"has {probabilities.shape[1]} classes; repair needs one label set")
    return RepairSet(probabilities.astype(np.float32), original_labels.astype(np.int64),
                     probabilities.argmax(axis=1).astype(np.int64), data.groups, data.kinds, data.group_names)
