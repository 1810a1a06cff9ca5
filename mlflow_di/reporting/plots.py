"""Plots for reports (matplotlib, Agg canvas only: no window, no pyplot global state).

Each function returns an RGB uint8 array like the image grids in :mod:`mlflow_di.reporting.images`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

FIGURE_SIZE = (7.6, 3.8)  # inches; at DPI this is 836×418 px, readable on a 900 px page
DPI = 110
_STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 9.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e3e6ea",
    "grid.linewidth": 0.8,
    "axes.edgecolor": "#868e96",
    "axes.titleweight": "bold",
    "axes.titlesize": 11,
    "axes.titlelocation": "left",
    "legend.frameon": False,
}


@contextlib.contextmanager
def _figure(size: tuple[float, float] = FIGURE_SIZE) -> Iterator[Figure]:
    with matplotlib.rc_context(_STYLE):
        figure = Figure(figsize=size, dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        yield figure


def figure_to_rgb(figure: Figure) -> np.ndarray:
    """RGB uint8 pixels of a matplotlib figure drawn on an Agg canvas."""
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _as_fractions(values, percent: bool) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    return array * 100.0 if percent else array


def coverage_growth_plot(
    curves: Mapping[str, Sequence[float]],
    title: str = "Coverage growth over the test set",
    ylabel: str = "coverage (%)",
    xlabel: str = "inputs seen",
    percent: bool = True,
) -> np.ndarray:
    """Line plot of coverage after each input, one line per curve (e.g. "original", "original + augmented").

    ``curves`` maps a name to the covered fraction after the 1st, 2nd, … input (0..1; plotted as %
    unless ``percent`` is False). Curves may differ in length; each is labelled with its final value.
    """
    if not curves:
        raise ValueError("no coverage curves to plot")
    with _figure() as figure:
        axes = figure.add_subplot()
        top = 0.0
        for order, (name, values) in enumerate(curves.items()):
            y = _as_fractions(values, percent)
            if y.size == 0:
                raise ValueError(f"coverage curve '{name}' is empty")
            x = np.arange(1, y.size + 1)
            final = f"{y[-1]:.1f} %" if percent else f"{y[-1]:.3g}"
            # Curves often share a prefix ("original" is the start of "original + augmented"): later
            # curves are drawn thicker and underneath, so every curve stays visible where they overlap.
            (line,) = axes.plot(x, y, linewidth=1.8 + 1.8 * order, zorder=10 - order, solid_capstyle="butt",
                                label=f"{name}  ({final} after {y.size:,})",
                                drawstyle="steps-post" if y.size <= 60 else "default")
            axes.plot([x[-1]], [y[-1]], "o", color=line.get_color(), markersize=4 + 2 * order, zorder=10 - order)
            top = max(top, float(np.nanmax(y)))
        axes.set_xlim(left=0)
        axes.set_ylim(0, 100 if percent and top <= 100 else top * 1.05 or 1)
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        axes.legend(loc="lower right")
        return figure_to_rgb(figure)


def bar_plot(
    values: Mapping[str, float],
    title: str,
    percent: bool = True,
    ylabel: str | None = None,
    reference: float | None = None,
    reference_label: str = "mean",
) -> np.ndarray:
    """Bar chart of named values (e.g. the criteria fractions or per-layer IDC), each bar labelled with its value.

    Fractions 0..1 are shown as % unless ``percent`` is False. Many or long names turn the chart
    horizontal so that the names stay readable. A NaN value (e.g. a class that was skipped) gets
    no bar and the label "n/a". ``reference`` (e.g. the mean of the bars) is drawn as a dashed
    line named ``reference_label``, so the bars below it stand out.
    """
    if not values:
        raise ValueError("no values to plot")
    names = [str(name) for name in values]
    heights = _as_fractions(list(values.values()), percent)
    horizontal = len(names) > 8 or max(len(name) for name in names) > 12
    label = ylabel or ("%" if percent else "")
    size = (FIGURE_SIZE[0], max(2.4, 0.9 + 0.32 * len(names))) if horizontal else FIGURE_SIZE
    with _figure(size) as figure:
        axes = figure.add_subplot()
        positions = np.arange(len(names))
        colours = [matplotlib.colormaps["tab10"](i % 10) for i in range(len(names))]
        texts = [(f"{h:.1f} %" if percent else f"{h:.3g}") if np.isfinite(h) else "n/a" for h in heights]
        finite = np.nan_to_num(heights)
        limit = 100.0 if percent and finite.max(initial=0) <= 100 else max(finite.max(initial=0) * 1.1, 1e-9)
        if horizontal:
            bars = axes.barh(positions, finite, color=colours, height=0.65)
            axes.set_yticks(positions, names)
            axes.invert_yaxis()
            axes.set_xlim(0, limit * 1.08)
            axes.set_xlabel(label)
            axes.grid(axis="y", visible=False)
        else:
            bars = axes.bar(positions, finite, color=colours, width=0.65)
            axes.set_xticks(positions, names)
            axes.set_ylim(0, limit * 1.08)
            axes.set_ylabel(label)
            axes.grid(axis="x", visible=False)
        axes.bar_label(bars, labels=texts, padding=3, fontsize=9)
        if reference is not None and np.isfinite(reference):
            line = float(_as_fractions([reference], percent)[0])
            text = f"{reference_label} {line:.1f} %" if percent else f"{reference_label} {line:.3g}"
            (axes.axvline if horizontal else axes.axhline)(line, color="#495057", linestyle="--", linewidth=1.2,
                                                          label=text)
            axes.legend(loc="best")
        axes.set_title(title)
        return figure_to_rgb(figure)


def heatmap(values: np.ndarray, row_names: Sequence[str], column_names: Sequence[str], title: str,
            symmetric: bool = True, colorbar_label: str = "", annotate: str | None = None) -> np.ndarray:
    """Rows x columns matrix of scores as a coloured grid (NaN cells grey), e.g. units x hypotheses.

    ``symmetric``: a diverging map centred at 0 with limits +-max|v| (correlations); otherwise a
    sequential map from 0 (mutual information, probe scores). ``annotate``: a format (e.g.
    ``".1%"``) to write each finite value in its cell, for small grids where nearby colours hide
    differences.
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2 or values.shape != (len(row_names), len(column_names)) or values.size == 0:
        raise ValueError(f"heatmap needs a non-empty {len(row_names)}x{len(column_names)} matrix, got {values.shape}")
    finite = values[np.isfinite(values)]
    limit = float(np.abs(finite).max()) if finite.size else 1.0
    limit = limit or 1.0
    height = min(max(2.6, 0.9 + 0.17 * len(row_names)), 30.0)
    width = max(FIGURE_SIZE[0], 1.6 + 0.32 * len(column_names))
    with _figure((width, height)) as figure:
        axes = figure.add_subplot()
        cmap = matplotlib.colormaps["RdBu_r" if symmetric else "viridis"].with_extremes(bad="#ced4da")
        image = axes.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap, interpolation="nearest",
                            vmin=-limit if symmetric else min(0.0, float(finite.min(initial=0.0))), vmax=limit)
        axes.set_xticks(np.arange(len(column_names)), column_names, rotation=60, ha="right")
        step = max(1, len(row_names) // 60)  # at most ~60 row labels stay readable
        axes.set_yticks(np.arange(0, len(row_names), step), list(row_names)[::step])
        axes.grid(False)
        axes.set_title(title)
        if annotate:
            for (row, column), value in np.ndenumerate(values):
                if np.isfinite(value):
                    dark = sum(image.cmap(image.norm(value))[:3]) < 1.5
                    axes.text(column, row, format(value, annotate), ha="center", va="center", fontsize=8,
                              color="white" if dark else "black")
        figure.colorbar(image, ax=axes, label=colorbar_label, shrink=0.8)
        return figure_to_rgb(figure)
