"""The training recipes: Keras' default initialisation and the optimizers by name."""
import pytest
import torch
from torch import nn

from mlflow_di.errors import UserError
from mlflow_di.models.training import keras_initialise, train_classifier


def test_keras_initialisation_is_glorot_uniform_with_zero_biases_and_seeded():
    model = nn.Sequential(nn.Conv2d(1, 6, 5), nn.Flatten(), nn.Linear(6 * 24 * 24, 10))
    keras_initialise(model, seed=3)
    conv_bound = (6 / (1 * 25 + 6 * 25)) ** 0.5
    dense_bound = (6 / (6 * 24 * 24 + 10)) ** 0.5
    assert model[0].weight.abs().max() <= conv_bound and model[0].weight.abs().max() > 0.9 * conv_bound
    assert model[2].weight.abs().max() <= dense_bound and model[2].weight.abs().max() > 0.9 * dense_bound
    assert not model[0].bias.any() and not model[2].bias.any()
    again = keras_initialise(nn.Sequential(nn.Conv2d(1, 6, 5), nn.Flatten(), nn.Linear(6 * 24 * 24, 10)), seed=3)
    torch.testing.assert_close(again[2].weight, model[2].weight)


def test_adadelta_trains_and_an_unknown_optimizer_is_named():
    torch.manual_seed(0)
    inputs = torch.rand(64, 1, 4, 4)
    labels = (inputs.mean(dim=(1, 2, 3)) > 0.5).long()
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 2))
    losses = train_classifier(model, inputs, labels, epochs=5, lr=1.0, batch_size=16, optimizer="adadelta",
                              progress=False)
    assert losses[-1] < losses[0]
    with pytest.raises(UserError, match="unknown optimizer 'sgd'; choose one of adam, adadelta"):
        train_classifier(model, inputs, labels, epochs=1, optimizer="sgd", progress=False)


def test_an_interrupt_goes_on_to_the_caller_with_the_module_in_eval_mode(monkeypatch):
    """Ctrl-C/SIGTERM during training is not swallowed: a caller (the demo, the reproduction
    harness) must stop, not register or score a half-trained model."""
    from mlflow_di.models import training

    calls = []

    def one_epoch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return 1.0

    monkeypatch.setattr(training, "_train_one_epoch", one_epoch)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 2))
    with pytest.raises(KeyboardInterrupt):
        train_classifier(model, torch.rand(8, 1, 4, 4), torch.zeros(8, dtype=torch.long), epochs=5, progress=False)
    assert len(calls) == 2 and not model.training and torch.get_num_threads() >= 1
