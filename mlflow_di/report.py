"""HTML reports, image grids and plots for the mlflow-di commands (see :mod:`mlflow_di.reporting`).

This module is the stable import point named in DESIGN.md; the code lives in small modules of
:mod:`mlflow_di.reporting` (``html``, ``images``, ``plots``, ``png``).
"""
from mlflow_di.reporting import *  # noqa: F401,F403
from mlflow_di.reporting import __all__  # noqa: F401
