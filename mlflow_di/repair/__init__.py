"""Drepair: repair a compressed model's deviations with a small head on its probability vector.

The pieces: :mod:`.dataset` (the training set from fuzz campaigns: seeds, triggers and agreeing
mutants, labelled by both models), :mod:`.head` (training the head, seeded), :mod:`.evaluate`
(repair ratio, inducing ratio, improvement; 5-fold cross-validation split by seed; clean-test
accuracy), :mod:`.drepair` (all of it in one call) and :mod:`.onnx_graph` (the head appended to
an ONNX export, so the repaired model stays one ONNX file). Nothing here knows MLflow.
"""
from mlflow_di.repair.dataset import RepairImages, RepairSet, collect_images, label_images
from mlflow_di.repair.drepair import RepairResult, repair, training_set
from mlflow_di.repair.evaluate import CleanAccuracy, CrossValidation, RepairCounts, cross_validate, seed_folds
from mlflow_di.repair.training import HeadSettings, train_head

__all__ = ["RepairImages", "RepairSet", "collect_images", "label_images", "RepairResult", "repair", "training_set",
           "CleanAccuracy", "CrossValidation", "RepairCounts", "cross_validate", "seed_folds", "HeadSettings", "train_head"]
