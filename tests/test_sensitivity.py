"""The sensitivity split's simulation (compression/sensitivity.py) against int8 rounding done by hand."""
import numpy as np
import torch
from torch import nn

from mlflow_di.compression.quant_debug import sqnr_db
from mlflow_di.compression.sensitivity import simulated_split


def _sqnr(reference, other) -> float:
    return sqnr_db(float(np.sum(reference ** 2)), float(np.sum((reference - other) ** 2)))


def test_weight_only_and_activation_only_are_the_hand_rounded_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double().float().eval()
    rng = np.random.default_rng(0)
    calibration = rng.normal(size=(64, 6)).astype(np.float32)
    inputs = rng.normal(size=(200, 6)).astype(np.float32)
    split = simulated_split(model, calibration, inputs, ["0", "2"])

    weight, bias = model[0].weight.detach().double().numpy(), model[0].bias.detach().double().numpy()
    head_w, head_b = model[2].weight.detach().double().numpy(), model[2].bias.detach().double().numpy()

    def forward(x, first_weight=weight, first_input=None):
        hidden = np.maximum((first_input if first_input is not None else x) @ first_weight.T + bias, 0)
        return hidden @ head_w.T + head_b

    x = inputs.astype(np.float64)
    reference = forward(x)
    scale = np.abs(weight).max(axis=1, keepdims=True) / 127  # symmetric int8 per output row
    rounded_weight = np.clip(np.round(weight / scale), -127, 127) * scale
    weight_only = forward(x, first_weight=rounded_weight)
    low, high = min(calibration.min(), 0.0), max(calibration.max(), 0.0)  # asymmetric int8, range holds 0
    step = (high - low) / 255
    zero = np.round(-128 - low / step)
    rounded_input = (np.clip(np.round(x / step) + zero, -128, 127) - zero) * step
    activation_only = forward(x, first_input=rounded_input)

    w_sqnr, a_sqnr, w_flips, a_flips = split["0"]
    assert abs(w_sqnr - _sqnr(reference, weight_only)) < 0.05 and abs(a_sqnr - _sqnr(reference, activation_only)) < 0.05
    assert w_flips == int(np.sum(weight_only.argmax(1) != reference.argmax(1)))
    assert a_flips == int(np.sum(activation_only.argmax(1) != reference.argmax(1)))
    assert 20 < w_sqnr < 80 and 20 < a_sqnr < 80  # int8: about 6 dB a bit, less the ranges' slack
