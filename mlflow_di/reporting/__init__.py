"""Reviewable artifacts: self-contained HTML reports, image grids and plots (rendering only).

Everything here takes plain inputs (numpy arrays, lists, dicts, numbers), never engine objects,
and knows nothing of MLflow. Pictures are RGB uint8 arrays (see :mod:`mlflow_di.reporting.png`).
"""
from mlflow_di.reporting.html import HtmlReport, format_value, insert_sections, operator_summary
from mlflow_di.reporting.images import (
    Perturbation,
    TriggerGridLayout,
    amplified_difference,
    labelled_image_rows,
    perturbation_sizes,
    relevance_heatmaps,
    trigger_grid,
    trigger_grid_layout,
    trigger_grid_pages,
)
from mlflow_di.reporting.plots import bar_plot, coverage_growth_plot, heatmap
from mlflow_di.reporting.png import png_data_uri, save_png, to_png

__all__ = [
    "HtmlReport", "Perturbation", "TriggerGridLayout", "amplified_difference", "bar_plot", "coverage_growth_plot", "heatmap",
    "labelled_image_rows",
    "format_value", "insert_sections", "operator_summary", "perturbation_sizes", "png_data_uri", "relevance_heatmaps", "save_png",
    "to_png", "trigger_grid", "trigger_grid_layout", "trigger_grid_pages",
]
