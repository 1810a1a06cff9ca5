"""Compression API in one import: ``from mlflow_di.compress import compress, export_onnx, ...``.

The implementation lives in :mod:`mlflow_di.compression` (one small module per concept); this
module only re-exports its public names.
"""
from mlflow_di.compression import *  # noqa: F401,F403
from mlflow_di.compression import __all__  # noqa: F401
