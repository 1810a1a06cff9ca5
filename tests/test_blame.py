"""Blame per trigger (compression/blame.py): the first tensor beyond its usual error, on a hand-made case
where the trigger overflows one layer's calibrated range and on hand-made error tables."""
import numpy as np
import pytest
import torch
from torch import nn

import mlflow_di  # noqa: F401  (torchvision guard before anything imports it)
from mlflow_di.compression import compress
from mlflow_di.compression.blame import WITHIN_USUAL, Blame, blame, first_exceeding
from mlflow_di.models.preprocessing import Preprocessing

PREPROCESSING = Preprocessing(input_shape=(1, 2, 1), layout="NCHW", scale=1 / 255)


class Sum(nn.Module):
    """hidden = relu(x1 + x2) -> logits (hidden, 1.5 - hidden)."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.first = nn.Linear(2, 1)
        self.head = nn.Linear(1, 2)
        with torch.no_grad():
            self.first.weight[:] = torch.tensor([[1.0, 1.0]])
            self.first.bias.zero_()
            self.head.weight[:] = torch.tensor([[1.0], [-1.0]])
            self.head.bias[:] = torch.tensor([0.0, 1.5])

    def forward(self, x):
        return self.head(torch.relu(self.first(self.flatten(x))))


def test_a_trigger_that_overflows_the_first_layers_calibrated_range_is_blamed_on_that_layer(tmp_path):
    values = np.arange(256, dtype=np.uint8)
    usual = np.stack([values, 255 - values], axis=1).reshape(-1, 1, 2, 1)  # x1 + x2 = 1 after scaling: hidden is 1
    result = compress(Sum().eval(), PREPROCESSING, "int8-static", tmp_path, calib_inputs=usual)
    triggers = np.array([[255, 255], [200, 200], [10, 245]], dtype=np.uint8).reshape(-1, 1, 2, 1)
    found = blame(result.float_path, result.path, PREPROCESSING.apply(usual), PREPROCESSING.apply(triggers))
    # hidden = 2.0 and 1.57 are clipped to the calibrated 1.0: the first layer's output parts from the float model
    assert [row.layer for row in found.triggers] == ["first", "first", WITHIN_USUAL]
    assert found.triggers[0].error == pytest.approx(0.5, abs=0.01)  # |2 - 1| / 2
    assert found.triggers[1].error == pytest.approx(1 - 255 / 400, abs=0.01)
    assert found.counts() == {"first": 2, WITHIN_USUAL: 1} and found.usual_images == 256
    assert found.false_alarm_rate <= 0.05


def test_first_exceeding_takes_the_earliest_tensor_above_its_usual_error():
    errors = np.array([[0.1, 0.9, 0.9], [0.3, 0.1, 0.9], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0]])
    usual = np.array([0.2, 0.5, 0.5])
    assert first_exceeding(errors, usual).tolist() == [1, 0, -1, -1]
    assert first_exceeding(np.full((1, 2), 5e-6), np.zeros(2)).tolist() == [-1]  # float rounding is no finding


def test_the_blame_table_counts_and_round_trips():
    from mlflow_di.compression.blame import TriggerBlame

    found = Blame(0.99, 10, 0.1, [TriggerBlame(0, "b", "t", 0.5, 0.1), TriggerBlame(1, "a", "u", 0.4, 0.1),
                                   TriggerBlame(2, "b", "t", 0.6, 0.1), TriggerBlame(3, WITHIN_USUAL, "", None, None)])
    assert [row["layer"] for row in found.rows()] == ["b", WITHIN_USUAL, "a"]  # most first, ties by name
    assert found.rows()[0] == {"layer": "b", "triggers": 2, "share": "50.0%"}
    assert Blame.from_json(found.to_json()) == found
