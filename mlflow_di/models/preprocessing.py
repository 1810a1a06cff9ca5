"""How raw uint8 NHWC images become a model's input, and how its output becomes probabilities.

The spec travels with the model: mlflow-di stores it in the MLflow model's metadata (key
``mlflow_di`` -> ``preprocessing``) and in ONNX metadata, and the CLI can override any field
(``--preprocessing scale=1,mean=125.3/123/113.9``).
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from mlflow_di.errors import UserError

LAYOUTS = ("NCHW", "NHWC")
OUTPUTS = ("logits", "probabilities")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """x = (raw * scale - mean) / std, then transposed to ``layout``; float32.

    ``mean``/``std`` are per channel (or one value for all). ``output`` says what the model
    returns: ``logits`` (softmax is applied to get probabilities) or ``probabilities``.
    ``input_shape`` is (H, W, C) of one raw image, when known, to check data against.
    """

    scale: float = 1.0 / 255.0
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    layout: str = "NCHW"
    output: str = "logits"
    input_shape: tuple[int, int, int] | None = None

    def __post_init__(self):
        object.__setattr__(self, "mean", tuple(float(v) for v in np.atleast_1d(self.mean)))
        object.__setattr__(self, "std", tuple(float(v) for v in np.atleast_1d(self.std)))
        if self.input_shape is not None:
            object.__setattr__(self, "input_shape", tuple(int(v) for v in self.input_shape))
        if self.layout not in LAYOUTS:
            raise UserError(f"preprocessing layout must be one of {LAYOUTS}, got '{self.layout}'")
        if self.output not in OUTPUTS:
            raise UserError(f"preprocessing output must be one of {OUTPUTS}, got '{self.output}'")
        if any(s == 0 for s in self.std):
            raise UserError("preprocessing std must not contain 0")

    def check_images(self, images: np.ndarray) -> None:
        """Raise a one-line :class:`UserError` when images do not fit this model's input."""
        if images.ndim != 4:
            raise UserError(f"expected images of shape (N, H, W, C), got shape {images.shape}")
        if len(images) == 0:
            raise UserError("no images given (empty data)")
        if self.input_shape is not None and tuple(images.shape[1:]) != self.input_shape:
            h, w, c = self.input_shape
            raise UserError(
                f"images are {images.shape[1]}x{images.shape[2]}x{images.shape[3]} (HxWxC) but the model "
                f"expects {h}x{w}x{c}; use data of that size (e.g. mnist for 28x28x1, digits for 8x8x1)"
            )
        channels = images.shape[3]
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise UserError(f"preprocessing {name} has {len(values)} values but images have {channels} channels")

    def shape_mismatch(self, model_name: str, error: Exception) -> UserError:
        """The one-line error for a model that cannot run on this preprocessing's input shape."""
        shape = "x".join(map(str, self.input_shape)) if self.input_shape else "the given"
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return UserError(f"{model_name} cannot run on {shape} (HxWxC) inputs ({detail}); give the model's own input "
                         "shape with --preprocessing input_shape=H/W/C, or leave the stored preprocessing as it is")

    def apply(self, images: np.ndarray) -> np.ndarray:
        """Raw uint8 (N, H, W, C) -> float32 model input in ``layout``."""
        self.check_images(images)
        x = images.astype(np.float32) * np.float32(self.scale)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x)

    def to_probabilities(self, outputs: np.ndarray) -> np.ndarray:
        """Model outputs -> probabilities (softmax over logits; probabilities passed through)."""
        outputs = np.asarray(outputs, dtype=np.float32)
        if self.output == "probabilities":
            return outputs
        shifted = outputs - outputs.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=1, keepdims=True)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "Preprocessing":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise UserError(f"unknown preprocessing fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Preprocessing":
        return cls.from_dict(json.loads(text))

    def override(self, text: str | None) -> "Preprocessing":
        """Apply a command-line override ``key=value,...`` (tuples as ``a/b/c``), e.g. ``scale=1,layout=NHWC``."""
        if not text:
            return self
        changes = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or not value.strip():
                raise UserError(f"bad preprocessing override '{item}'; write key=value, e.g. scale=1,layout=NHWC")
            if key in ("mean", "std", "input_shape"):
                try:
                    changes[key] = tuple(float(v) for v in value.split("/"))
                except ValueError:
                    raise UserError(f"preprocessing {key} must be numbers separated by '/', got '{value}'") from None
                if key == "input_shape":
                    changes[key] = tuple(int(v) for v in changes[key])
            elif key == "scale":
                try:
                    changes[key] = float(value)
                except ValueError:
                    raise UserError(f"preprocessing scale must be a number, got '{value}'") from None
            elif key in ("layout", "output"):
                changes[key] = value.strip()
            else:
                raise UserError(
                    f"unknown preprocessing field '{key}'; known: scale, mean, std, layout, output, input_shape"
                )
        return dataclasses.replace(self, **changes)
