"""mlflow-di: importance-driven coverage and differential fuzzing for MLflow-registered classifiers.

Public API (stable): :func:`load_images` gives an :class:`ImageSet`; :func:`load_classifier`
gives a black-box classifier with ``predict_proba(images)`` on raw uint8 NHWC images;
:func:`load_torch_model` gives white-box access to a PyTorch model.
"""
from mlflow_di import _compat

_compat.ensure_torchvision()  # before anything can import torchvision (zennit does)

__version__ = "0.1.0"
