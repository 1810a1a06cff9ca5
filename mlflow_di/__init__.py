"""mlflow-di: importance-driven coverage and differential fuzzing for MLflow-registered classifiers.

Public API (stable): :func:`load_images` gives an :class:`ImageSet`; :func:`load_classifier`
gives a black-box classifier with ``predict_proba(images)`` on raw uint8 NHWC images;
:func:`load_torch_model` gives white-box access to a PyTorch model. They are imported on first
use, so ``import mlflow_di`` (and the command line's ``--help``) stays fast.
"""
import os

from mlflow_di import _compat
from mlflow_di.lazy_names import lazy_names

_compat.install_torchvision_guard()  # before anything can import torchvision (zennit does)
# OpenMP's worker threads spin while they wait by default; on a busy machine that spinning is charged to
# every model call, so a seed's CPU seconds would depend on the load (measured with and without it:
# benchmarks/RESULTS.md, bench_load). Read once, when torch first loads OpenMP:
# setting it here, before anything imports torch, is what lets the time safety net mean the same on any load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

_PUBLIC = {"ImageSet": "mlflow_di.data", "load_images": "mlflow_di.data", "UserError": "mlflow_di.errors",
           "load_classifier": "mlflow_di.models.loading", "load_torch_model": "mlflow_di.models.loading"}
__all__ = [*_PUBLIC, "__version__"]

__getattr__ = lazy_names(__name__, _PUBLIC)
