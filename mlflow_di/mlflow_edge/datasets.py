"""Data specs as MLflow datasets: what a run read, shown under the UI's "Datasets used".

A command hands each :class:`~mlflow_di.data.ImageSet` it read to ``RunLog.input`` as a
:class:`SpecDataset`: its name is the data spec, its digest the first characters of the SHA-256
of the images (read in batches, as the spec loads them: before any model's resize) and labels
(:func:`mlflow_di.data.fingerprint`), its profile the number of images, their shape, the label
counts, the full SHA-256 and, for ``folder:`` sets, the class folder each label stands for. Its
source is a :class:`SpecSource` (source type ``mlflow_di``), which MLflow finds through the
``mlflow.dataset_source`` entry point of this package (:mod:`~mlflow_di.mlflow_edge.spec_source`), so
``mlflow.data.get_source(run.inputs.dataset_inputs[0]).load()`` loads the same spec again.
"""
from __future__ import annotations

import json
from collections import Counter

from mlflow.data.dataset import Dataset

from mlflow_di.mlflow_edge.spec_source import PREFIX, SpecSource  # noqa: F401 - PREFIX: part of this module's API

#: Characters of the SHA-256 kept as the dataset's digest (MLflow's own digests are 8 characters).
DIGEST_CHARS = 8


class SpecDataset(Dataset):
    """An image set as MLflow records it: name (the spec), digest, source, profile and schema."""

    def __init__(self, source: SpecSource, sha256: str, profile: dict, name: str | None = None):
        self.sha256 = sha256
        self._profile = {**profile, "sha256": sha256}
        super().__init__(source=source, name=name or source.spec, digest=sha256[:DIGEST_CHARS])

    def _compute_digest(self) -> str:  # (the digest is always given)
        return self.sha256[:DIGEST_CHARS]

    @property
    def profile(self) -> dict:
        return self._profile

    @property
    def schema(self) -> dict:
        shape = self._profile.get("image_shape") or []
        return {"images": {"dtype": "uint8", "shape": [-1, *shape], "layout": "NHWC"},
                "labels": {"dtype": "int64", "shape": [-1]}}

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "profile": json.dumps(self.profile), "schema": json.dumps(self.schema)}


def spec_dataset(data, spec: str | None = None, first: int | None = None, sha256: str | None = None) -> SpecDataset:
    """The :class:`SpecDataset` of ``data`` as loaded from ``spec`` (default: ``data.name``, which
    :func:`~mlflow_di.data.load_images` sets to the spec), of which ``first`` images were used.

    ``data`` must be the set as the spec loads it (not a model's resized view of it), cut to its
    first ``first`` images; ``sha256``: its :func:`~mlflow_di.data.fingerprint` when already known
    (then nothing is read), else the set is read once, in batches.
    """
    from mlflow_di.data import class_names, fingerprint

    spec = spec or data.name
    labels = Counter(int(label) for label in data.labels)
    profile = {"num_images": len(data), "image_shape": [int(n) for n in data.image_shape],
               "label_counts": {str(label): labels[label] for label in sorted(labels)}}
    classes = class_names(spec)
    if classes:  # which class folder each label stands for (data.folder_labels)
        profile["classes"] = {str(label): name for label, name in classes.items()}
    name = spec if first is None else f"{spec} (first {len(data)})"
    return SpecDataset(SpecSource(spec, first), sha256 or fingerprint(data), profile, name=name[:500])


def ensure_registered() -> None:
    """Make :class:`SpecSource` known to MLflow in this process (the entry point does so once the
    package is installed; a checkout used through ``PYTHONPATH`` has none)."""
    from mlflow.data.dataset_source_registry import get_registered_sources, register_dataset_source

    if not any(source.__name__ == SpecSource.__name__ and source._get_source_type() == "mlflow_di"
               for source in get_registered_sources()):
        register_dataset_source(SpecSource)
