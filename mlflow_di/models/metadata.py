"""The ``mlflow_di`` metadata block that travels with a model: its preprocessing and facts.

It is written and read here only. Three carriers hold it:

* an MLflow model's ``metadata`` (``{"mlflow_di": {"preprocessing": {...}, "arch": ..., ...}}``),
* an ONNX file's ``metadata_props`` (``mlflow_di.preprocessing`` = the preprocessing as JSON),
* a pickled PyTorch file saved as ``{"module": nn.Module, "mlflow_di": {...}}``.
"""
from __future__ import annotations

import dataclasses
import json

from mlflow_di.models.preprocessing import Preprocessing

KEY = "mlflow_di"
ONNX_PREPROCESSING_KEY = f"{KEY}.preprocessing"


@dataclasses.dataclass(frozen=True)
class ModelMetadata:
    """``preprocessing`` (None when the carrier has none) and free-form ``facts`` (arch, lineage, version)."""

    preprocessing: Preprocessing | None = None
    facts: dict = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ MLflow model metadata
    def to_mlflow(self) -> dict:
        block = dict(self.facts)
        if self.preprocessing is not None:
            block["preprocessing"] = self.preprocessing.to_dict()
        return {KEY: block}

    @classmethod
    def from_mlflow(cls, metadata: dict | None) -> "ModelMetadata":
        return cls.from_block((metadata or {}).get(KEY) or {})

    # ------------------------------------------------------------------ the bare block (pickle files)
    @classmethod
    def from_block(cls, block: dict) -> "ModelMetadata":
        facts = {key: value for key, value in block.items() if key != "preprocessing"}
        stored = block.get("preprocessing")
        return cls(Preprocessing.from_dict(stored) if stored else None, facts)

    # ------------------------------------------------------------------ ONNX metadata_props
    def to_onnx_props(self) -> dict[str, str]:
        return {ONNX_PREPROCESSING_KEY: self.preprocessing.to_json()} if self.preprocessing is not None else {}

    @classmethod
    def from_onnx_props(cls, props: dict[str, str]) -> "ModelMetadata":
        stored = props.get(ONNX_PREPROCESSING_KEY)
        facts = {key.removeprefix(f"{KEY}."): _maybe_json(value) for key, value in props.items()
                 if key.startswith(f"{KEY}.") and key != ONNX_PREPROCESSING_KEY}
        return cls(Preprocessing.from_json(stored) if stored else None, facts)

    def merged(self, other: "ModelMetadata") -> "ModelMetadata":
        """This block with ``other``'s facts added and its preprocessing taking precedence where set."""
        return ModelMetadata(other.preprocessing or self.preprocessing, {**self.facts, **other.facts})


def _maybe_json(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value
