"""Training the repair head (:class:`~mlflow_di.models.head.ProbabilityHead`), seeded.

What the paper gives: a small classifier on the compressed model's probability vector, trained
with the original model's label as the target. What it does not give here (our notes hold no
layer sizes or optimiser), so these are this package's choices:

* a residual MLP: one hidden ReLU layer (``hidden`` units, 32 by default) reads the probability
  vector, and its output is added to the log-probabilities; the output layer starts at zero, so
  the untrained head changes no label and training learns corrections only;
* full-batch Adam on the mean cross-entropy with L2 weight decay, ``epochs`` steps;
* deviating examples weighted ``deviation_weight`` times an agreeing one (1 = unweighted).

Full-batch NumPy on a few thousand C-dimensional rows takes well under a second, and the same
settings and seed give the same weights bit for bit.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.models.head import ProbabilityHead
from mlflow_di.results_json import JsonRoundTrip


@dataclasses.dataclass(frozen=True)
class HeadSettings(JsonRoundTrip):
    hidden: int = 32
    epochs: int = 400
    learning_rate: float = 0.01
    weight_decay: float = 1e-4
    deviation_weight: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.hidden < 1 or self.epochs < 0 or self.learning_rate <= 0 or self.weight_decay < 0 \
                or self.deviation_weight <= 0:
            raise UserError(f"invalid repair head settings: {self}")


def train_head(probabilities: np.ndarray, targets: np.ndarray, settings: HeadSettings = HeadSettings(),
               deviating: np.ndarray | None = None) -> ProbabilityHead:
    """A head trained to map ``probabilities`` (N, C) to ``targets`` (N,) (the original model's labels).

    ``deviating``: mask of the examples weighted ``settings.deviation_weight``.
    """
    probabilities = np.asarray(probabilities, np.float32)
    targets = np.asarray(targets, np.int64)
    if len(probabilities) == 0:
        raise UserError("cannot train a repair head on no examples")
    count, classes = probabilities.shape
    rng = np.random.default_rng(settings.seed)
    head = ProbabilityHead.identity(classes, settings.hidden, rng)
    weights = np.ones(count, np.float32)
    if deviating is not None:
        weights[np.asarray(deviating, bool)] = settings.deviation_weight
    weights /= weights.sum()
    onehot = np.zeros((count, classes), np.float32)
    onehot[np.arange(count), targets] = 1.0
    x = head.features(probabilities)  # the skip path; the MLP reads the probabilities themselves
    params = [head.w1, head.b1, head.w2, head.b2]
    moments = [np.zeros_like(p) for p in params]
    squares = [np.zeros_like(p) for p in params]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step in range(1, settings.epochs + 1):
        pre = probabilities @ head.w1 + head.b1
        hidden = np.maximum(pre, 0.0)
        logits = x + hidden @ head.w2 + head.b2
        logits -= logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        grad_logits = (exp / exp.sum(axis=1, keepdims=True) - onehot) * weights[:, None]
        grad_hidden = (grad_logits @ head.w2.T) * (pre > 0)
        grads = [probabilities.T @ grad_hidden, grad_hidden.sum(axis=0), hidden.T @ grad_logits, grad_logits.sum(axis=0)]
        grads[0] += settings.weight_decay * head.w1
        grads[2] += settings.weight_decay * head.w2
        for param, grad, m, v in zip(params, grads, moments, squares):
            m *= beta1
            m += (1 - beta1) * grad
            v *= beta2
            v += (1 - beta2) * grad * grad
            param -= settings.learning_rate * (m / (1 - beta1 ** step)) / (np.sqrt(v / (1 - beta2 ** step)) + eps)
    return head
