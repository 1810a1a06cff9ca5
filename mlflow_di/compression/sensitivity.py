"""Which layers an int8 export is sensitive to, split the ways AIMET's QuantAnalyzer splits it.

Per layer (a Conv/Gemm/MatMul with constant weights, named by its PyTorch module):

- **weight-only / activation-only**: the model in PyTorch with only that layer's weights (symmetric
  int8 per output channel) or only its input activation (asymmetric int8 per tensor, MinMax range
  on the calibration images) rounded onto the int8 grid
  (:func:`~mlflow_di.compression.fake_quant.fake_quantize` with ``only``), everything else float.
  Reported as the SQNR of the logits against the float model's (dB, higher is better) and the
  images whose top-1 changes. A simulation of the recipe, not the ONNX Runtime export: it says
  which half of a layer's quantization hurts;
- **alone / all but this one**: real ONNX Runtime int8-static exports with only this layer
  quantized (every other layer in float), and with every layer quantized but this one, scored by
  their top-1 disagreements with the original on the evaluation images. "Alone" is the error this
  layer brings by itself; "all but" is what leaving it in float buys.

Costs two exports per layer (the float model is exported once) and two PyTorch passes over at most
:data:`SIMULATION_IMAGES` images per layer.
"""
from __future__ import annotations

import dataclasses
import itertools
import pathlib

import numpy as np
import torch

from mlflow_di.compression.quant_debug import sqnr_db
from mlflow_di.results_json import JsonRoundTrip

SIMULATION_IMAGES = 1000
SIMULATION_BATCH = 256


@dataclasses.dataclass
class LayerSensitivity(JsonRoundTrip):
    """One layer's row (see the module docstring); disagreements are counts of images."""

    layer: str
    weight_only_sqnr_db: float
    activation_only_sqnr_db: float
    weight_only_flips: int
    activation_only_flips: int
    alone_disagreements: int | None  # None in a one-layer model: nothing else to keep in float
    all_but_disagreements: int | None


@dataclasses.dataclass
class Sensitivity(JsonRoundTrip):
    """The split for every layer: simulated on ``simulated_images``, exports scored on ``images``;
    ``all_int8_disagreements``: the fully quantized export's, for scale."""

    images: int
    simulated_images: int
    all_int8_disagreements: int
    layers: list[LayerSensitivity]

    JSON_DUMPS = {"indent": 2}

    def rows(self) -> list[dict]:
        return [{"layer": row.layer, "weight-only SQNR dB": round(row.weight_only_sqnr_db, 1),
                 "activation-only SQNR dB": round(row.activation_only_sqnr_db, 1),
                 "weight-only flips": row.weight_only_flips, "activation-only flips": row.activation_only_flips,
                 "quantized alone: disagreements": row.alone_disagreements,
                 "all but this one: disagreements": row.all_but_disagreements} for row in self.layers]


def _logits(module, inputs: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return np.concatenate([module(torch.from_numpy(np.ascontiguousarray(inputs[start:start + SIMULATION_BATCH],
                                                                            dtype=np.float32))).double().numpy()
                               for start in range(0, len(inputs), SIMULATION_BATCH)])


def simulated_split(module, calibration: np.ndarray, inputs: np.ndarray, layers: list[str]) -> dict[str, tuple]:
    """Layer -> (weight-only logits SQNR dB, activation-only SQNR dB, weight-only flips, activation-only flips),
    on preprocessed float ``inputs``; ``calibration``: preprocessed inputs that set the activation ranges."""
    from mlflow_di.compression.fake_quant import fake_quantize

    module = module.eval()
    reference = _logits(module, inputs)
    labels = reference.argmax(axis=1)
    calibration = torch.from_numpy(np.ascontiguousarray(calibration, dtype=np.float32))
    split = {}
    for layer in layers:
        figures = []
        for part in ("weights", "activations"):
            quantized = fake_quantize(module, calibration, only=[layer], weights=part == "weights",
                                      activations=part == "activations")
            logits = _logits(quantized, inputs)
            figures.append((sqnr_db(float(np.sum(reference ** 2)), float(np.sum((reference - logits) ** 2))),
                            int(np.sum(logits.argmax(axis=1) != labels))))
        split[layer] = (figures[0][0], figures[1][0], figures[0][1], figures[1][1])
    return split


def sensitivity(module, preprocessing, calib_inputs, split, layers: list[str], out_dir, graph=None,
                all_int8=None, device=None) -> Sensitivity:
    """The sensitivity split of ``layers`` (PyTorch module names) for an int8-static export of ``module``.

    ``calib_inputs``: raw calibration images (as :func:`~mlflow_di.compression.methods.compress`
    takes them); ``split``: a :class:`~mlflow_di.compression.bounded.LabelledSplit` of evaluation
    images; ``all_int8``: the fully quantized export when made already.
    """
    from mlflow_di.compression.methods import calibration_inputs, compress, float_export
    from mlflow_di.progress import progress_bar

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32 = float_export(module, preprocessing, out_dir / "fp32.onnx", graph=graph)
    numbers = itertools.count()

    def disagreements(keep_float) -> int:
        result = compress(module, preprocessing, "int8-static", out_dir / f"export-{next(numbers)}",
                          calib_inputs=calib_inputs, keep_float=list(keep_float), exported=fp32)
        return split.score(result.path, preprocessing, device).disagreements

    count = min(len(split.images), SIMULATION_IMAGES)
    inputs = np.asarray(calibration_inputs(split.images, preprocessing)[0:count], dtype=np.float32)
    calibration = np.asarray(calibration_inputs(calib_inputs, preprocessing)[0:SIMULATION_IMAGES], dtype=np.float32)
    simulated = simulated_split(module, calibration, inputs, layers)
    rows = []
    with progress_bar(layers, desc="sensitivity", unit="layer", leave=False) as bar:
        for layer in bar:
            others = [name for name in layers if name != layer]
            alone = disagreements(others) if others else None
            rows.append(LayerSensitivity(layer, *simulated[layer], alone_disagreements=alone,
                                         all_but_disagreements=disagreements([layer]) if others else None))
    full = disagreements([]) if all_int8 is None else split.score(all_int8.path, preprocessing, device).disagreements
    return Sensitivity(len(split.images), count, full, rows)
