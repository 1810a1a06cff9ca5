"""Robustness suite: severity-graded corruptions (albumentations) and how an original model and its
compressed versions hold up under them (accuracy, top-1 agreement). No MLflow, no click."""
from mlflow_di.robustness.corruptions import CORRUPTIONS, SEVERITIES, Corruption, corrupt, image_seed
from mlflow_di.robustness.suite import Cell, CompressedSummary, RobustnessResult, example_rows, run_suite

__all__ = ["CORRUPTIONS", "SEVERITIES", "Cell", "CompressedSummary", "Corruption", "RobustnessResult", "corrupt",
           "example_rows", "image_seed", "run_suite"]
