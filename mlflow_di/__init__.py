"""mlflow-di: importance-driven coverage and differential fuzzing for MLflow-registered classifiers.

Public API (stable): :func:`load_images` gives an :class:`ImageSet`; :func:`load_classifier`
gives a black-box classifier with ``predict_proba(images)`` on raw uint8 NHWC images;
:func:`load_torch_model` gives white-box access to a PyTorch model.
"""
from mlflow_di import _compat

_compat.ensure_torchvision()  # before anything can import torchvision (zennit does)

__version__ = "0.1.0"

from mlflow_di.data import ImageSet, load_images  # noqa: E402
from mlflow_di.errors import UserError  # noqa: E402
from mlflow_di.models.loading import load_classifier, load_torch_model  # noqa: E402

__all__ = ["ImageSet", "UserError", "load_classifier", "load_images", "load_torch_model", "__version__"]
