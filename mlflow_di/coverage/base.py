"""The contract every coverage estimator here keeps (IDC, the classic criteria, the suite).

They are scikit-learn estimators (:class:`sklearn.base.BaseEstimator`): ``__init__`` stores its
arguments unchanged (``get_params``/``set_params``/``clone`` work), ``fit(model, images)`` checks
them and sets the fitted state in attributes ending in ``_`` (the model among them, as
``model_``), ``score(images)`` measures a test set, and scoring before fitting raises
:class:`NotFittedError`. Fitted estimators save to JSON stamped with a ``format`` name and a
``format_version``; loading a file of another version is a one-line :class:`UserError`.
"""
from __future__ import annotations

import json

import numpy as np
import sklearn.exceptions

from mlflow_di.data import ImageSet, LazyImages
from mlflow_di.errors import UserError

#: Version of every saved coverage file (IDC, classic criteria, suite). Version 1 was IDC's
#: single-layer file, before the three shared one format.
FORMAT_VERSION = 2


class NotFittedError(UserError, sklearn.exceptions.NotFittedError):
    """A coverage estimator was used before ``fit`` (or ``load``): scikit-learn's error and a UserError."""


def check_fitted(estimator, hint: str = "fit(model, images)") -> None:
    """Raise :class:`NotFittedError` unless ``estimator.__sklearn_is_fitted__()``."""
    if not estimator.__sklearn_is_fitted__():
        raise NotFittedError(f"this {type(estimator).__name__} is not fitted yet; call {hint} first")


def images_of(data) -> tuple[np.ndarray, str]:
    """(raw uint8 (N, H, W, C) images, name) of an ImageSet or a raw uint8 array (lazy images stay lazy)."""
    if isinstance(data, ImageSet):
        return data.images, data.name
    if isinstance(data, LazyImages):
        return data, "images"
    images = np.asarray(data)
    if images.dtype != np.uint8:
        raise UserError(f"expected raw uint8 images (N, H, W, C) or an ImageSet, got {images.dtype} {images.shape}")
    return images, "images"


def stamped(kind: str, values: dict) -> dict:
    """``values`` headed by the ``format`` name of ``kind`` and the current ``format_version``."""
    return {"format": f"mlflow-di/{kind}", "format_version": FORMAT_VERSION, **values}


def parse_saved(text: str, kind: str, source: str) -> dict:
    """The values of a file written with :func:`stamped`; a one-line UserError for anything else."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{source} is not valid JSON ({exc}); it holds no saved {kind}") from None
    return check_saved(values, kind, source)


def check_saved(values, kind: str, source: str) -> dict:
    """``values`` if they are a saved ``kind`` of the current format version, else a one-line UserError."""
    expected = f"mlflow-di/{kind}"
    if not isinstance(values, dict) or values.get("format") != expected:
        found = values.get("format") if isinstance(values, dict) else type(values).__name__
        raise UserError(f"{source} holds no saved {kind} (format {found!r}, expected '{expected}')")
    version = values.get("format_version", values.get("version"))
    if version != FORMAT_VERSION:
        raise UserError(f"{source}: saved {kind} format version {version!r} cannot be read by this mlflow-di "
                        f"(it reads version {FORMAT_VERSION}); fit and save it again")
    return values
