"""Preprocessing read from what MLflow already knows about a model: its signature and input example.

A model logged with plain ``mlflow.pytorch.log_model(model, name=..., input_example=x)`` carries no
``mlflow_di`` block, but its signature gives the input tensor's shape and dtype, and the saved
input example gives the value range:

* shape ``[-1, C, H, W]`` with C in 1, 3 or 4 -> layout NCHW, input H x W x C; ``[-1, H, W, C]`` ->
  NHWC (NCHW wins when both read as channels, as in PyTorch);
* example values within 0..1 -> ``scale = 1/255``; within 0..255 (some above 1.5) -> ``scale = 1``;
  negative values -> the inputs were normalised with a mean and std the model does not record:
  that choice is left to the user (:attr:`Inferred.problem` says which command records it once).
  Without an example, 0..1 is assumed and said so in :attr:`Inferred.assumed`.

Nothing here needs MLflow: the edge passes the signature's shape and dtype and the example array.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.models.preprocessing import Preprocessing

CHANNELS = (1, 3, 4)


@dataclasses.dataclass(frozen=True)
class Inferred:
    """The preprocessing a signature implies; ``problem``: why it cannot be trusted as it is (one
    line naming the fix), ``assumed``: what was assumed for want of an example."""

    preprocessing: Preprocessing
    problem: str | None = None
    assumed: str | None = None


def from_signature(shape, dtype: str | None, example, record_hint: str) -> Inferred | None:
    """The preprocessing implied by a tensor input ``shape`` (``-1`` for any), its ``dtype`` name and
    ``example`` (an array or None); None when the shape is not an image batch.

    ``record_hint`` is the command that records preprocessing for this model, named in problems.
    """
    if shape is None or len(shape) != 4:
        return None
    dims = [int(value) for value in shape]
    if dims[1] in CHANNELS and dims[2] > 0 and dims[3] > 0:
        layout, input_shape = "NCHW", (dims[2], dims[3], dims[1])
    elif dims[3] in CHANNELS and dims[1] > 0 and dims[2] > 0:
        layout, input_shape = "NHWC", (dims[1], dims[2], dims[3])
    else:
        return None
    base = Preprocessing(layout=layout, input_shape=input_shape)
    if dtype is not None and not str(dtype).startswith("float"):
        return Inferred(base, problem=f"the model's signature takes {dtype} inputs; mlflow-di feeds float32 "
                                      "(log the model with a float32 input example)")
    if example is None:
        return Inferred(base, assumed="no input example: inputs assumed to be pixels / 255 (0..1)")
    values = np.asarray(example, dtype=np.float64)
    if values.size == 0 or not np.isfinite(values).all():
        return Inferred(base, problem=f"the model's input example is empty or not finite; {record_hint}")
    low, high = float(values.min()), float(values.max())
    if low < -1e-6:
        return Inferred(base, problem=f"the model's input example holds values from {low:.3g} to {high:.3g}, so its "
                                      f"inputs were normalised with a mean and std the model does not record; "
                                      f"{record_hint}")
    if high <= 1.0 + 1e-6:
        return Inferred(base)
    if high <= 255.0 + 1e-6:
        return Inferred(dataclasses.replace(base, scale=1.0))
    return Inferred(base, problem=f"the model's input example reaches {high:.3g}, beyond 8-bit pixels (0..255); "
                                  f"{record_hint}")
