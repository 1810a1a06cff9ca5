"""A repair head: a small classifier on a model's probability vector, and the model it repairs.

:class:`ProbabilityHead` maps a compressed model's probabilities (N, C) to repaired probabilities
(N, C) with a residual MLP: the MLP reads the probabilities, its output corrects the log-probabilities::

    logits = log(max(p, EPS)) + relu(p @ w1 + b1) @ w2 + b2
    repaired = softmax(logits)

With ``w2 = 0, b2 = 0`` the head is the identity (its argmax is the model's own), so it starts from
"change nothing" and learns only corrections. It is trained by :mod:`mlflow_di.repair.training`
and turned into ONNX nodes by :mod:`mlflow_di.repair.onnx_graph`; its forward pass lives here,
in NumPy, so that loading a repaired model (:mod:`mlflow_di.models.loading`) needs no engine.

:class:`RepairedClassifier` is any :class:`Classifier` followed by a head: it is how a repaired
TFLite (or other non-ONNX) model is run, and what the engines query in tests and benchmarks.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from mlflow_di.models.classifier import Classifier

#: Probabilities are clipped to at least this before the logarithm (float32 softmax outputs can be 0).
EPS = 1e-7


@dataclasses.dataclass
class ProbabilityHead:
    """Weights of the residual MLP (float32): ``w1`` (C, H), ``b1`` (H,), ``w2`` (H, C), ``b2`` (C,)."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray

    def __post_init__(self):
        for name in ("w1", "b1", "w2", "b2"):
            setattr(self, name, np.asarray(getattr(self, name), np.float32))

    @property
    def num_classes(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[1]

    @classmethod
    def identity(cls, num_classes: int, hidden: int, rng: np.random.Generator | None = None) -> "ProbabilityHead":
        """A head that changes no label: random first layer (He init), zero second layer."""
        rng = rng or np.random.default_rng(0)
        w1 = rng.normal(0.0, np.sqrt(2.0 / num_classes), (num_classes, hidden))
        return cls(w1, np.zeros(hidden), np.zeros((hidden, num_classes)), np.zeros(num_classes))

    def features(self, probabilities: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(np.asarray(probabilities, np.float32), np.float32(EPS)))

    def logits(self, probabilities: np.ndarray) -> np.ndarray:
        p = np.asarray(probabilities, np.float32)
        hidden = np.maximum(p @ self.w1 + self.b1, 0.0)
        return self.features(p) + hidden @ self.w2 + self.b2

    def __call__(self, probabilities: np.ndarray) -> np.ndarray:
        """Repaired probabilities (N, C), float32."""
        logits = self.logits(probabilities)
        logits = logits - logits.max(axis=1, keepdims=True)
        exp = np.exp(logits)
        return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)

    def predict(self, probabilities: np.ndarray) -> np.ndarray:
        return self.logits(probabilities).argmax(axis=1)

    def save(self, path) -> None:
        np.savez(path, w1=self.w1, b1=self.b1, w2=self.w2, b2=self.b2)

    @classmethod
    def load(cls, path) -> "ProbabilityHead":
        with np.load(pathlib.Path(path)) as archive:
            return cls(archive["w1"], archive["b1"], archive["w2"], archive["b2"])


class RepairedClassifier(Classifier):
    """``base`` followed by ``head``: raw images -> base probabilities -> repaired probabilities."""

    def __init__(self, base: Classifier, head: ProbabilityHead, name: str | None = None):
        self.base = base
        super().__init__(base.preprocessing, name or f"{base.name} + repair head")
        self.head = head
        self.backend = f"{base.backend} + repair head"
        self.provider = base.provider
        self.default_batch_size = base.default_batch_size

    @property
    def preprocessing(self):
        """The base model's (one object: an override given to either applies to both)."""
        return self.base.preprocessing

    @preprocessing.setter
    def preprocessing(self, value) -> None:
        self.base.preprocessing = value

    def predict_proba(self, images, batch_size: int | None = None) -> np.ndarray:
        probabilities = self.head(self.base.predict_proba(images, batch_size))
        self._num_classes = probabilities.shape[1]
        return probabilities
