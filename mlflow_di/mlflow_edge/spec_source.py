"""The ``mlflow_di`` dataset source: a data spec MLflow can record and load again.

Why this module defines :class:`SpecSource` only when it is first asked for: MLflow loads the
``mlflow.dataset_source`` entry points while ``mlflow.data`` itself is being imported, and the
entry point names this module. A module that imported ``mlflow.data`` at its top to subclass
``DatasetSource`` would be half-initialised when MLflow asks it for the class (MLflow then warns
"circular import" and drops the source). Here nothing from MLflow is imported until the class is
needed, and by then ``mlflow.data.dataset_source`` is loaded, whoever started the import.
"""
from __future__ import annotations

from typing import Any

#: How a string names a data spec to :func:`mlflow.data.dataset_source_registry.resolve_dataset_source`.
PREFIX = "mlflow-di:"


def _define_spec_source():
    from mlflow.data.dataset_source import DatasetSource

    class SpecSource(DatasetSource):
        """An mlflow-di data spec (``digits``, ``mnist-test:DIR[0:500]``, ``folder:DIR`` ...), optionally
        only its first ``first`` images (the fuzz command's ``--num-seeds``)."""

        def __init__(self, spec: str, first: int | None = None):
            self.spec = spec
            self.first = first

        @staticmethod
        def _get_source_type() -> str:
            return "mlflow_di"

        def load(self):
            """The :class:`~mlflow_di.data.ImageSet` the spec names (lazy for ``folder:``/``npz:``)."""
            from mlflow_di.data import load_images

            data = load_images(self.spec)
            return data if self.first is None else data.subset(slice(0, self.first))

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            if isinstance(raw_source, dict):
                return isinstance(raw_source.get("spec"), str)
            return isinstance(raw_source, str) and raw_source.startswith(PREFIX) and len(raw_source) > len(PREFIX)

        @classmethod
        def _resolve(cls, raw_source: Any) -> "SpecSource":
            if isinstance(raw_source, dict):
                return cls.from_dict(raw_source)
            return cls(raw_source[len(PREFIX):])

        def to_dict(self) -> dict[str, Any]:
            return {"spec": self.spec, **({"first": self.first} if self.first is not None else {})}

        @classmethod
        def from_dict(cls, source_dict: dict) -> "SpecSource":
            first = source_dict.get("first")
            return cls(source_dict["spec"], None if first is None else int(first))

    return SpecSource


def __getattr__(name: str):
    if name == "SpecSource":
        source = globals()["SpecSource"] = _define_spec_source()
        source.__module__, source.__qualname__ = __name__, "SpecSource"
        return source
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
