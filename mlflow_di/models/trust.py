"""Which pickled models work that no person chose may load: loading a pickle runs its code.

A person who names a pickled model on the command line chose it. A pipeline policy or the service
loads whatever version it is handed, so it runs inside :func:`only_trusted_pickles`: a pickle then
loads only when its registered model is named there. pt2, ONNX, TFLite and Keras weights run no
code when loaded and need no trust (:data:`mlflow_di.models.formats.FORMATS` says which formats do).

A pt2 archive is read weights-only (:mod:`mlflow_di.models.weights_only`). One whose members need
more (a pickle that a weights-only load refuses) would run code while looking like data, so it is
trusted more narrowly than a pickle: only where a policy names its model, or, for a command a
person runs, where they set MLflow's own switch for such models, ``MLFLOW_ALLOW_PICKLE_DESERIALIZATION``
(:func:`may_run_hidden_code`).
"""
from __future__ import annotations

import contextlib
import contextvars
import os

from mlflow_di.errors import UserError

__all__ = ["check_trusted", "hidden_code_hint", "may_run_hidden_code", "only_trusted_pickles", "pickle_allowed"]

#: (registered model names or exact URIs whose pickles may load, who said so); None: any pickle
#: loads (a person named the model on the command line).
_TRUSTED_PICKLES: contextvars.ContextVar[tuple[frozenset, str] | None] = contextvars.ContextVar(
    "trusted_pickles", default=None)


@contextlib.contextmanager
def only_trusted_pickles(names, where: str = "the policy"):
    """Within this block a pickled PyTorch model loads only when its registered model name (or its
    URI) is in ``names``; any other pickle is a one-line :class:`UserError` saying ``where`` to list it."""
    token = _TRUSTED_PICKLES.set((frozenset(names), where))
    try:
        yield
    finally:
        _TRUSTED_PICKLES.reset(token)


def check_trusted(name: str | None, uri: str) -> None:
    """Refuse the pickle at ``uri`` (registered as ``name``, if it is) unless it may load here."""
    trust = _TRUSTED_PICKLES.get()
    if trust is None or name in trust[0] or uri in trust[0]:
        return
    raise UserError(f"'{uri}' is a pickled PyTorch model and loading it runs its code; {trust[1]} does not "
                    f"trust it: add '{name or uri}' to trust.pickled_models if you trust its authors (pt2, ONNX "
                    "and TFLite models need no trust: log it with mlflow.pytorch.log_model's default pt2 format)")


def may_run_hidden_code(name: str | None, uri: str) -> bool:
    """Whether the model at ``uri`` may run code from a file that does not look like code (a pt2
    archive whose members need more than a weights-only load): where a policy or the service
    decides, only when it names the model; elsewhere only when ``MLFLOW_ALLOW_PICKLE_DESERIALIZATION``
    is true (naming a pt2 on the command line does not say its author may run code)."""
    trust = _TRUSTED_PICKLES.get()
    if trust is not None:
        return name in trust[0] or uri in trust[0]
    return os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "").strip().lower() in ("1", "true", "yes")


def hidden_code_hint(name: str | None, uri: str) -> str:
    """How to trust the model at ``uri`` where :func:`may_run_hidden_code` said no (a clause for one line)."""
    trust = _TRUSTED_PICKLES.get()
    if trust is not None:
        return f"; {trust[1]} does not trust it: add '{name or uri}' to trust.pickled_models if you trust its authors"
    return ("; if you trust its authors, set MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true (MLflow's switch for models "
            "that run code when loaded) for this command")


@contextlib.contextmanager
def pickle_allowed():
    """MLflow refuses pickled models unless this is set; mlflow-di needs the real module."""
    previous = os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION")
    os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", None)
        else:
            os.environ["MLFLOW_ALLOW_PICKLE_DESERIALIZATION"] = previous
