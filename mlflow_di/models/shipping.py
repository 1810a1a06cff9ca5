"""Models packed to travel to another process or machine (a Ray worker) and loaded there again.

A worker should load the model the driver loaded, without access to the tracking server: the
driver resolves a ``models:/`` or ``runs:/`` reference once (:func:`mlflow_di.models.loading.resolve`
downloads it), and :func:`ship` packs the files it got (a whole MLflow model folder, or the one
model file) into a :class:`Shipment` of bytes. :meth:`Shipment.load` unpacks them into a private
temporary folder on the worker and loads that local copy with
:func:`~mlflow_di.models.loading.load_classifier`, with the same preprocessing override and device
request, so the worker needs no credentials and no shared file system.

A model that did not come from :func:`~mlflow_di.models.loading.load_classifier` (a test double,
a classifier built in Python) is pickled as it is, which needs it to be picklable.
"""
from __future__ import annotations

import dataclasses
import pathlib
import tempfile

from mlflow_di.models.preprocessing import Preprocessing


@dataclasses.dataclass(frozen=True)
class Shipment:
    """A model's files as bytes plus how to load them; picklable, small enough for an object store."""

    files: dict[str, bytes]
    reference: str
    preprocessing: Preprocessing
    device: str | None
    name: str
    #: load it as a white-box ``TorchModel`` (coverage passes) instead of a black-box classifier
    white_box: bool = False
    #: the runtime it ran on (``NAME[:PRECISION]``; None: its format's own), the same on the worker
    runtime: str | None = None

    @property
    def size(self) -> int:
        """Bytes shipped."""
        return sum(len(data) for data in self.files.values())

    def load(self, folder=None):
        """The classifier (a ``TorchModel`` when shipped white-box), loaded from a copy of the files in
        ``folder`` (default: a new temporary folder).

        The folder is kept for as long as the process lives: ONNX Runtime and TFLite read the file
        when the session opens, PyTorch unpickles it at once; the copy costs disk, not memory.
        """
        from mlflow_di.models.loading import load_classifier, load_torch_model
        from mlflow_di.models.trust import only_trusted_pickles

        root = pathlib.Path(folder or tempfile.mkdtemp(prefix="mlflow-di-shipped-"))
        for relative, data in self.files.items():
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        reference = self.reference.replace("{root}", str(root))
        with only_trusted_pickles([reference], "the driver"):  # the driver loaded these bytes: its trust travels
            if self.white_box:
                classifier = load_torch_model(reference, self.preprocessing, self.device)
            else:
                classifier = load_classifier(reference, self.preprocessing, self.device, self.runtime)
        classifier.name = self.name
        return classifier


def ship(model):
    """``model`` ready to travel: a :class:`Shipment` when it knows its :class:`Origin`, else itself (pickled as it is)."""
    origin = getattr(model, "origin", None)
    if origin is None:
        return model
    root = origin.root
    if root.is_dir():
        files = {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}
    else:
        files = {root.name: root.read_bytes()}
    from mlflow_di.models.torch_model import TorchModel

    return Shipment(files, origin.reference, model.preprocessing, origin.device, model.name,
                    white_box=isinstance(model, TorchModel), runtime=origin.runtime)


def unship(model):
    """The model a worker uses: a :class:`Shipment` loaded, anything else as it came."""
    return model.load() if isinstance(model, Shipment) else model
