"""A model reference as the user wrote it, parsed once into a typed :class:`ModelRef`.

Accepted forms:

* MLflow: ``models:/NAME/VERSION``, ``models:/NAME@ALIAS``, ``runs:/RUN_ID/PATH``,
  ``mlflow-artifacts:/...``, or a local MLflow model folder (one with an ``MLmodel`` file);
* files: whatever suffix a model format declares (:data:`mlflow_di.models.formats.FORMATS`): ``.onnx``
  (ONNX Runtime), ``.tflite`` / ``.lite`` (LiteRT), ``.pt`` / ``.pth`` / ``.pkl`` (a pickled ``nn.Module``);
* ``keras:ARCH:FILE.h5``: a Keras HDF5 reference model ported to PyTorch on load.

Parsing needs no MLflow and no framework; :mod:`mlflow_di.models.loading` turns a reference
into a model.
"""
from __future__ import annotations

import dataclasses
import enum
import pathlib
import re

from mlflow_di.errors import UserError

#: URI schemes that are loaded through MLflow.
MLFLOW_PREFIXES = ("models:/", "runs:/", "mlflow-artifacts:/")
_REGISTRY = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/]+))/?$")


def uri_help() -> str:
    """Every form a model reference may take, the file suffixes from the model formats' declarations."""
    from mlflow_di.models.formats import file_suffixes

    return ("models:/NAME/VERSION, models:/NAME@ALIAS, runs:/RUN_ID/PATH, an MLflow model folder, "
            f"a {'/'.join(file_suffixes())} file or keras:ARCH:FILE.h5")


class RefKind(str, enum.Enum):
    """What a reference points to, before anything is loaded."""

    REGISTRY = "registry"  # models:/NAME/VERSION or models:/NAME@ALIAS
    MLFLOW = "mlflow"  # runs:/..., mlflow-artifacts:/..., models:/ forms other than the two above, a model folder
    FILE = "file"  # a model file; its ``format`` is the one its suffix names
    KERAS = "keras"


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A parsed model reference. ``name``/``version``/``alias`` for registry versions; ``path`` for
    files and Keras weights; ``arch`` for Keras; ``format`` the name of the model format of a file or a
    Keras reference (MLflow references learn theirs when downloaded)."""

    uri: str
    kind: RefKind
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    path: pathlib.Path | None = None
    arch: str | None = None
    format: str | None = None

    @classmethod
    def parse(cls, uri: str) -> "ModelRef":
        """Parse ``uri``; a one-line :class:`UserError` when it names nothing mlflow-di can load."""
        if isinstance(uri, ModelRef):
            return uri
        if not isinstance(uri, str) or not uri.strip():
            raise UserError(f"no model given; pass one of: {uri_help()}")
        uri = uri.strip()
        if uri.startswith("keras:"):
            _, arch, file = (uri.split(":", 2) + ["", ""])[:3]
            if not arch or not file:
                raise UserError(f"bad keras reference '{uri}'; write keras:ARCH:FILE.h5, e.g. keras:lenet5:LeNet5.h5")
            return cls(uri, RefKind.KERAS, path=_existing_file(file), arch=arch, format="keras")
        registry = _REGISTRY.match(uri)
        if registry:
            return cls(uri, RefKind.REGISTRY, name=registry["name"], version=registry["version"],
                       alias=registry["alias"])
        if uri.startswith(MLFLOW_PREFIXES) or (pathlib.Path(uri) / "MLmodel").is_file():
            return cls(uri, RefKind.MLFLOW)
        from mlflow_di.models.formats import format_of_file

        path = _existing_file(uri)
        found = format_of_file(path)
        if found is None:
            raise UserError(f"cannot tell what kind of model '{uri}' is from its suffix; give {uri_help()}")
        return cls(uri, RefKind.FILE, path=path, format=found.name)

    @property
    def is_mlflow(self) -> bool:
        """True when loading goes through MLflow (registry, runs, artifacts, model folders)."""
        return self.kind in (RefKind.REGISTRY, RefKind.MLFLOW)

    @property
    def display_name(self) -> str:
        """How reports name the model: the URI for MLflow references, the file name otherwise."""
        return self.uri if self.is_mlflow or self.kind is RefKind.KERAS else self.path.name

    @property
    def base_name(self) -> str:
        """A readable base for derived names (exports): the registered name, the Keras arch or the file stem."""
        if self.kind is RefKind.REGISTRY:
            return self.name
        if self.kind is RefKind.KERAS:
            return self.arch
        if self.path is not None:
            return self.path.stem
        return re.sub(r"[^A-Za-z0-9._-]+", "-", self.uri.split(":/", 1)[-1]).strip("-") or "model"

    @property
    def short(self) -> str:
        """A compact label for run names: ``lenet5/1``, ``lenet5@champion`` or the file name."""
        if self.kind is RefKind.REGISTRY:
            return f"{self.name}/{self.version}" if self.version else f"{self.name}@{self.alias}"
        return self.path.name if self.path is not None else self.uri


def _existing_file(path: str) -> pathlib.Path:
    resolved = pathlib.Path(path).expanduser()
    if not resolved.exists():
        raise UserError(f"model file '{path}' does not exist; give {uri_help()}")
    return resolved
