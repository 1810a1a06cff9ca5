"""Blame per trigger: the first layer where an int8 export parts from its float model beyond its usual error.

The layer-wise diagnosis (:mod:`~mlflow_di.compression.quant_debug`) gives each tensor's error summed
over many images. A fuzz trigger is one image on which the export and the original answer
differently; to say *where* that image went wrong, its own error at each tensor is compared with
what that tensor's error usually is:

- per image and tensor, the relative error ``||float - qdq|| / ||float||`` between the float
  model's value and the QDQ model's dequantized value (ONNX Runtime's ``qdq_loss_debug`` pairs
  them, as the diagnosis does);
- a tensor's **usual error** is the ``quantile`` (default 0.99) of that error over evaluation images;
- a trigger is **blamed** on the first tensor, in the float graph's order, whose error exceeds its
  usual error, and on that tensor's layer (the diagnosis's attribution: the nearest weighted
  layer upstream, ``(input)`` for the input's own quantization). A trigger that exceeds nowhere is
  counted as within the usual error: the export parts from the original there through the
  ordinary error of every layer, not through one.

The usual error is exceeded by chance, too: with many tensors at their 99th percentile, some
evaluation images exceed one of them. :attr:`Blame.false_alarm_rate` measures that on the
evaluation images themselves, so a layer's share of the triggers can be read against it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from mlflow_di.compression.quant_debug import DIAGNOSIS_BATCH, FloatGraph, matched_activations
from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip

USUAL_QUANTILE = 0.99
WITHIN_USUAL = "(within usual error)"
EPS = 1e-12
#: Relative errors below this are float32 rounding, not quantization: never "beyond the usual".
ERROR_FLOOR = 1e-5


@dataclasses.dataclass
class TriggerBlame(JsonRoundTrip):
    """Where one trigger (its index in the campaign's trigger list) first exceeded the usual error."""

    trigger: int
    layer: str
    tensor: str
    error: float | None  # the trigger's relative error at that tensor (None: within the usual error)
    usual: float | None  # the tensor's usual error (the quantile over evaluation images)


@dataclasses.dataclass
class Blame(JsonRoundTrip):
    """Blame of every trigger, with what 'usual' was measured on."""

    quantile: float
    usual_images: int
    false_alarm_rate: float  # evaluation images that exceed the usual error of some tensor
    triggers: list[TriggerBlame]

    JSON_DUMPS = {"indent": 2}

    def counts(self) -> dict[str, int]:
        """Layer -> triggers blamed on it, most first."""
        counts: dict[str, int] = {}
        for row in self.triggers:
            counts[row.layer] = counts.get(row.layer, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def rows(self) -> list[dict]:
        total = len(self.triggers)
        return [{"layer": layer, "triggers": count, "share": f"{count / total:.1%}"}
                for layer, count in self.counts().items()]


def per_image_errors(float_path, qdq_path, inputs, max_images: int | None = None,
                     batch_size: int = DIAGNOSIS_BATCH) -> tuple[list[str], np.ndarray]:
    """(activation tensors in the float graph's order, relative errors of shape (images, tensors)) of
    ``qdq_path`` against ``float_path`` on preprocessed ``inputs`` (the first ``max_images``)."""
    count = len(inputs) if max_images is None else min(len(inputs), max_images)
    if count == 0:
        raise UserError("no images to measure the quantization error on")
    float_model = onnx.load(str(float_path))
    order = {name: index for index, node in enumerate(float_model.graph.node) for name in node.output}
    order.update({graph_input.name: -1 for graph_input in float_model.graph.input})
    columns: dict[str, list[np.ndarray]] = {}
    for size, matching in matched_activations(float_path, qdq_path, inputs, count, batch_size):
        for name, match in matching.items():
            if "float" not in match or name not in order:
                continue
            # ORT hands each batch's tensor over flattened; batch-major, so each image is one row again
            reference, quantized = (np.concatenate(match[key]).astype(np.float64).ravel() for key in ("float", "post_qdq"))
            if reference.size % size or reference.shape != quantized.shape:
                continue  # not a per-image tensor (a shape, a constant)
            reference, quantized = reference.reshape(size, -1), quantized.reshape(size, -1)
            error = np.linalg.norm(reference - quantized, axis=1) / np.maximum(np.linalg.norm(reference, axis=1), EPS)
            columns.setdefault(name, []).append(error)
    names = sorted((name for name, parts in columns.items() if sum(len(p) for p in parts) == count),
                   key=lambda name: (order[name], name))
    return names, np.stack([np.concatenate(columns[name]) for name in names], axis=1)


def first_exceeding(errors: np.ndarray, usual: np.ndarray) -> np.ndarray:
    """Per row of ``errors`` (images x tensors in graph order), the first column above ``usual`` and
    :data:`ERROR_FLOOR` (-1: none)."""
    above = errors > np.maximum(usual, ERROR_FLOOR)[None, :]
    return np.where(above.any(axis=1), above.argmax(axis=1), -1)


def blame(float_path, qdq_path, usual_inputs, trigger_inputs, quantile: float = USUAL_QUANTILE,
          max_images: int | None = None) -> Blame:
    """Blame each of ``trigger_inputs`` (preprocessed) on a layer of the QDQ model ``qdq_path``, against
    the usual error measured on ``usual_inputs`` (see the module docstring)."""
    names, usual_errors = per_image_errors(float_path, qdq_path, usual_inputs, max_images)
    trigger_names, trigger_errors = per_image_errors(float_path, qdq_path, trigger_inputs, max_images)
    if trigger_names != names:  # the same graphs give the same tensors; keep only the common ones if not
        common = [name for name in names if name in set(trigger_names)]
        usual_errors = usual_errors[:, [names.index(name) for name in common]]
        trigger_errors = trigger_errors[:, [trigger_names.index(name) for name in common]]
        names = common
    usual = np.quantile(usual_errors, quantile, axis=0)
    graph = FloatGraph(onnx.load(str(float_path)))
    rows = []
    for index, column in enumerate(first_exceeding(trigger_errors, usual)):
        if column < 0:
            rows.append(TriggerBlame(index, WITHIN_USUAL, "", None, None))
        else:
            rows.append(TriggerBlame(index, graph.layer(names[column]), names[column],
                                     float(trigger_errors[index, column]), float(usual[column])))
    false_alarms = float(np.mean(first_exceeding(usual_errors, usual) >= 0))
    return Blame(quantile, len(usual_errors), false_alarms, rows)
