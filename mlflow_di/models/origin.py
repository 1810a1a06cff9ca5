"""Where a loaded model came from: enough for another process to load the same model again.

:func:`mlflow_di.models.loading.load_classifier` and ``load_torch_model`` set a model's ``origin``;
:mod:`mlflow_di.models.shipping` packs the files it names for a Ray worker.
"""
from __future__ import annotations

import dataclasses
import pathlib

from mlflow_di.errors import UserError


@dataclasses.dataclass(frozen=True)
class Origin:
    """What :func:`~mlflow_di.models.loading.load_classifier` was given and found: enough to load the model again.

    ``path``: the local model file; ``in_mlflow_folder``: it came from MLflow, so the whole model
    folder around it (the one with the ``MLmodel`` file) travels; ``reference``: how to name the
    model inside the copy (``{root}`` is replaced by the copy's path); ``device``: the device asked
    for (``auto`` is resolved again where the model is loaded).
    """

    path: pathlib.Path
    in_mlflow_folder: bool
    reference: str
    device: str | None
    runtime: str | None = None  # the runtime it ran on (``NAME[:PRECISION]``; None: its format's own)

    @property
    def root(self) -> pathlib.Path:
        """What travels: the MLflow model folder around :attr:`path`, or the file itself (looked up
        when a model is shipped, so loading a model never depends on it)."""
        if not self.in_mlflow_folder:
            return self.path
        root = next((parent for parent in (self.path, *self.path.parents) if (parent / "MLmodel").is_file()), None)
        if root is None:
            raise UserError(f"cannot find the MLflow model folder (with an MLmodel file) around '{self.path}'")
        return root


def origin_of(source, device, runtime: str | None = None) -> Origin:
    """The :class:`Origin` of a model :func:`~mlflow_di.models.loading.resolve` found at ``source``."""
    path = pathlib.Path(source.path)
    device = None if device is None else str(device)
    if source.ref.is_mlflow:  # the whole MLflow model folder travels: MLmodel, data, metadata
        return Origin(path, True, "{root}", device, runtime)
    reference = "{root}/" + path.name
    if source.format.needs_architecture:
        reference = f"keras:{source.ref.arch}:{reference}"
    return Origin(path, False, reference, device, runtime)
