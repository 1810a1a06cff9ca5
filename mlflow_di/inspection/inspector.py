"""Deep neural inspection (DeepBase): the affinity of a layer's units to hypotheses, in one streamed pass.

DeepBase (Sellam et al., SIGMOD 2019) scores every (unit group, hypothesis) pair with affinity
measures. Its two optimisations are what this module does:

* **shared computation**: one forward pass per batch serves every hypothesis and every measure
  (the hypotheses are computed once per batch, the measures are vectorised over units x
  hypotheses), instead of one pass per hypothesis;
* **early stopping**: the data is read in a seeded random order (a sorted set, e.g. one folder
  per class, would otherwise bias the first inputs) and, at checkpoints growing by half each
  time, every measure's confidence intervals are computed; reading stops once every defined
  interval is narrower than ``tolerance``. The result says how many inputs it needed.

Units and groups: single units (all of the layer, or only IDC's important neurons) for the
per-unit measures (Pearson, Spearman, mutual information); unit groups (the whole layer, IDC's
important neurons together) for the probe. A conv layer's unit is a channel: its value for one
input is the spatial mean of its feature map (as for coverage); against a mask hypothesis it is
compared position by position, the mask averaged down to the feature map's size, for Pearson and
mutual information (the intervals then count images, not positions, since neighbouring positions
are not independent). Spearman and the probe use the mask's mean per input.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import torch

from mlflow_di.coverage.activations import LayerRecorder, eval_mode, neuron_values
from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.inspection.hypotheses import Hypothesis, check_unique
from mlflow_di.inspection.measures import MEASURES, make_measure
from mlflow_di.models.torch_model import TorchModel
from mlflow_di.progress import progress_bar

#: Measures that may compare a conv channel with a mask position by position.
POSITIONAL_MEASURES = ("pearson", "mi")
CHECK_GROWTH = 1.5


@dataclasses.dataclass
class InspectionResult:
    """Scores of every (unit or group, hypothesis) pair per measure, with intervals and what was read.

    ``scores[measure]`` is (rows, H): rows are ``units`` for a per-unit measure and ``groups`` (in
    order) for the probe. ``top_inputs`` (U, k) are the positions, in the data, of the inputs
    that activated each unit most (highest first). ``history`` lists (inputs read, widest interval)
    at each checkpoint (only the end without early stopping).
    """

    layer: str
    units: list[int]
    groups: dict[str, list[int]]
    hypotheses: list[str]
    descriptions: list[str]
    measures: list[str]
    scores: dict[str, np.ndarray]
    lower: dict[str, np.ndarray]
    upper: dict[str, np.ndarray]
    n_inputs: int
    n_available: int
    converged: bool
    tolerance: float
    confidence: float
    history: list[tuple[int, float]]
    top_inputs: np.ndarray
    top_values: np.ndarray
    data: str = ""

    def rows_of(self, measure: str) -> list[str]:
        """Row names of ``measure``'s score matrix: ``unit 3`` or ``group important``."""
        if measure == "probe":
            return [f"group {name}" for name in self.groups]
        return [f"unit {u}" for u in self.units]

    def table(self) -> list[dict]:
        """Long format: one row per (measure, unit or group, hypothesis). ``unit`` is the unit's index
        in the layer (an integer; None on a group's row), ``group`` the group's name (None on a
        unit's row) and ``name`` the row as the report shows it (``unit 3``, ``group important``)."""
        rows = []
        for measure in self.measures:
            groups = list(self.groups) if measure == "probe" else [None] * len(self.units)
            units = [None] * len(groups) if measure == "probe" else list(self.units)
            for r, row_name in enumerate(self.rows_of(measure)):
                for h, hypothesis in enumerate(self.hypotheses):
                    rows.append({"measure": measure, "unit": None if units[r] is None else int(units[r]),
                                 "group": groups[r], "name": row_name, "hypothesis": hypothesis,
                                 "score": _num(self.scores[measure][r, h]),
                                 "ci_low": _num(self.lower[measure][r, h]), "ci_high": _num(self.upper[measure][r, h])})
        return rows

    @property
    def unit_measure(self) -> str | None:
        """The per-unit measure used to rank units and label them (the first one asked for)."""
        return next((m for m in self.measures if m != "probe"), None)

    def top_units(self, hypothesis: str, k: int = 3, measure: str | None = None) -> list[tuple[int, float]]:
        """The ``k`` units with the strongest |score| for ``hypothesis``: [(unit, score)], strongest first."""
        measure = measure or self.unit_measure
        if measure is None:
            return []
        column = self.scores[measure][:, self.hypotheses.index(hypothesis)]
        strength = np.where(np.isfinite(column), np.abs(column), -1.0)
        order = np.argsort(-strength, kind="stable")[:k]
        return [(self.units[i], float(column[i])) for i in order if strength[i] >= 0]

    def strongest_hypotheses(self, unit: int, k: int = 2, measure: str | None = None) -> list[tuple[str, float]]:
        """The ``k`` hypotheses ``unit`` has the strongest |score| with: [(hypothesis, score)]."""
        measure = measure or self.unit_measure
        if measure is None or unit not in self.units:
            return []
        row = self.scores[measure][self.units.index(unit)]
        strength = np.where(np.isfinite(row), np.abs(row), -1.0)
        order = np.argsort(-strength, kind="stable")[:k]
        return [(self.hypotheses[i], float(row[i])) for i in order if strength[i] >= 0]

    def unit_labels(self, units: Sequence[int], k: int = 2) -> list[dict]:
        """Each of ``units`` with its strongest hypotheses, e.g. for IDC's important neurons."""
        measure = self.unit_measure
        return [{"layer": self.layer, "neuron": int(u),
                 "strongest": ", ".join(f"{h} ({measure} {s:+.2f})" for h, s in self.strongest_hypotheses(u, k))}
                for u in units]

    def summary(self) -> dict:
        return {"layer": self.layer, "data": self.data, "units": len(self.units), "groups": list(self.groups),
                "hypotheses": self.hypotheses, "measures": self.measures, "n_inputs": self.n_inputs,
                "n_available": self.n_available, "converged": self.converged, "tolerance": self.tolerance,
                "confidence": self.confidence}

    def to_dict(self) -> dict:
        def matrices(values):
            return {m: [[_num(v) for v in row] for row in a] for m, a in values.items()}

        return {**self.summary(), "unit_indices": self.units, "group_units": self.groups,
                "descriptions": self.descriptions, "scores": matrices(self.scores), "lower": matrices(self.lower),
                "upper": matrices(self.upper), "history": [list(h) for h in self.history],
                "top_inputs": self.top_inputs.tolist(), "top_values": self.top_values.tolist()}


def _num(value) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None


@dataclasses.dataclass
class Inspection:
    """What to inspect and how (the query): hypotheses, measures, stopping rule.

    ``tolerance``: stop once every defined confidence interval (at ``confidence``) is at most this
    wide; ``early_stop=False`` reads all the data (intervals are still reported). ``min_inputs``:
    the first checkpoint. ``top_k``: inputs kept per unit as its strongest examples.
    """

    hypotheses: Sequence[Hypothesis]
    measures: Sequence[str] = ("pearson", "mi")
    tolerance: float = 0.1
    confidence: float = 0.95
    early_stop: bool = True
    min_inputs: int = 500
    batch_size: int = 256
    top_k: int = 6
    seed: int = 0
    progress: bool = False

    def check(self) -> None:
        if not self.hypotheses:
            raise UserError("no hypotheses to inspect; give --hypotheses or use the built-in ones")
        check_unique(self.hypotheses)
        unknown = [m for m in self.measures if m not in MEASURES]
        if unknown or not self.measures:
            raise UserError(f"unknown measure '{unknown[0] if unknown else ''}'; choose from {', '.join(MEASURES)}")
        if not 0 < self.tolerance:
            raise UserError(f"tolerance must be above 0, got {self.tolerance}")
        if not 0 < self.confidence < 1:
            raise UserError(f"confidence must be between 0 and 1, got {self.confidence}")
        if self.batch_size < 1 or self.min_inputs < 1 or self.top_k < 1:
            raise UserError("batch size, min inputs and top-k must each be at least 1")

    def run(self, model: TorchModel, data: ImageSet, layer: str, units: Sequence[int] | None = None,
            groups: Mapping[str, Sequence[int]] | None = None) -> InspectionResult:
        """Inspect ``units`` of ``layer`` (default: all) on ``data``; the probe reads the whole layer and ``groups``."""
        self.check()
        if len(data) == 0:
            raise UserError(f"data '{data.name}' is empty; nothing to inspect")
        width = _layer_width(model, layer, data)
        units = list(range(width)) if units is None else [int(u) for u in units]
        bad = [u for u in units if not 0 <= u < width]
        if bad or not units:
            raise UserError(f"unit {bad[0] if bad else '(none)'} is not in layer '{layer}' (it has {width} units)")
        groups = {"layer": list(range(width)), **{k: [int(u) for u in v] for k, v in (groups or {}).items()}}
        state = _Stream(self, model, data, layer, units, groups)
        return state.run()


def _layer_width(model: TorchModel, layer: str, data: ImageSet) -> int:
    """Number of units of ``layer``, from one forward pass on the first image."""
    with eval_mode(model.module), torch.no_grad(), LayerRecorder(model.module, [layer]) as recorder:
        model.module(model.inputs_on_device(data.images[:1]))
        if layer not in recorder.outputs:
            raise UserError(f"layer '{layer}' was not run by the model's forward pass; choose another layer")
        return int(neuron_values(recorder.outputs[layer]).shape[1])


class _Stream:
    """The one pass: batches in a seeded random order -> unit values, hypothesis values -> every measure."""

    def __init__(self, query: Inspection, model: TorchModel, data: ImageSet, layer: str, units, groups):
        self.query, self.model, self.data, self.layer = query, model, data, layer
        self.units, self.groups = units, groups
        self.values = [h for h in query.hypotheses if h.kind == "value"]
        self.masks = [h for h in query.hypotheses if h.kind == "mask"]
        self.hypotheses = self.values + self.masks  # result order: value hypotheses, then masks
        unit_column = {u: i for i, u in enumerate(units)}
        missing = sorted({u for g in groups.values() for u in g if u not in unit_column})
        self.columns = units + missing  # group members that are not reported singly still feed the probe
        unit_column.update({u: len(units) + i for i, u in enumerate(missing)})
        group_columns = [[unit_column[u] for u in members] for members in groups.values()]
        self.per_input = {m: make_measure(m, group_columns, query.confidence, query.seed)
                          for m in query.measures}
        self.positional = {}  # set on the first batch, once we know whether the layer has positions
        self.top_values = np.full((len(units), query.top_k), -np.inf)
        self.top_inputs = np.full((len(units), query.top_k), -1, dtype=np.int64)
        self.history: list[tuple[int, float]] = []

    def run(self) -> InspectionResult:
        query, n_all = self.query, len(self.data)
        order = np.random.default_rng(query.seed).permutation(n_all)
        seen, next_check, converged = 0, query.min_inputs, False
        bar = progress_bar(total=n_all, desc="inspect", disable=not query.progress, leave=False)
        with eval_mode(self.model.module), torch.no_grad(), LayerRecorder(self.model.module, [self.layer]) as recorder:
            for start in range(0, n_all, query.batch_size):
                positions = np.sort(order[start:start + query.batch_size])
                self._batch(recorder, positions)
                seen += len(positions)
                bar.update(len(positions))
                if seen == n_all or (query.early_stop and seen >= next_check):  # no checkpoints without early stop
                    converged = self._converged(seen)
                    next_check = max(next_check + 1, int(seen * CHECK_GROWTH))
                    if converged and query.early_stop:
                        break
        bar.close()
        return self._result(seen, converged)

    def _batch(self, recorder: LayerRecorder, positions: np.ndarray) -> None:
        images, labels = self.data.images[positions], self.data.labels[positions]
        self.model.module(self.model.inputs_on_device(images))
        output = recorder.outputs.pop(self.layer).float()
        per_input = neuron_values(output).cpu().numpy().astype(np.float64)[:, self.columns]
        masks = [h(images, labels) for h in self.masks]
        values = [h(images, labels) for h in self.values] + [m.mean(axis=(1, 2)) for m in masks]
        y = np.stack(values, axis=1)
        for measure in self.per_input.values():
            measure.update(per_input, y)
        if masks and output.ndim == 4:
            self._update_positional(output, np.stack(masks, axis=1))
        self._keep_top(per_input[:, :len(self.units)], positions)

    def _update_positional(self, output: torch.Tensor, masks: np.ndarray) -> None:
        """Conv channels against masks, one sample per feature-map position."""
        if not self.positional:
            positions = output.shape[2] * output.shape[3]
            self.positional = {m: make_measure(m, confidence=self.query.confidence)
                               for m in self.query.measures if m in POSITIONAL_MEASURES}
            for measure in self.positional.values():
                measure.samples_per_input = positions
        pooled = torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(masks).float(), output.shape[2:])
        x = output[:, self.columns[:len(self.units)]].permute(0, 2, 3, 1).reshape(-1, len(self.units))
        y = pooled.permute(0, 2, 3, 1).reshape(-1, masks.shape[1])
        for measure in self.positional.values():
            measure.update(x.cpu().numpy().astype(np.float64), y.numpy().astype(np.float64))

    def _keep_top(self, values: np.ndarray, positions: np.ndarray) -> None:
        k = self.query.top_k
        merged_values = np.concatenate([self.top_values, values.T], axis=1)
        merged_inputs = np.concatenate([self.top_inputs, np.broadcast_to(positions, (len(self.units), len(positions)))],
                                       axis=1)
        best = np.argsort(-merged_values, axis=1, kind="stable")[:, :k]
        self.top_values = np.take_along_axis(merged_values, best, axis=1)
        self.top_inputs = np.take_along_axis(merged_inputs, best, axis=1)

    def _estimates(self) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each measure's (scores, lower, upper): units (or groups) x hypotheses in result order."""
        n_values, n_masks = len(self.values), len(self.masks)
        out = {}
        for name, measure in self.per_input.items():
            estimate = [a if measure.group else a[:len(self.units)] for a in measure.estimate()]
            if name in self.positional:  # masks position by position replace their per-input means
                positional = self.positional[name].estimate()
                estimate = [np.concatenate([a[:, :n_values], p], axis=1) for a, p in zip(estimate, positional)]
            out[name] = tuple(estimate)
            assert out[name][0].shape[1] == n_values + n_masks
        return out

    def _converged(self, seen: int) -> bool:
        """Whether every defined interval is within the tolerance; keeps the estimates for the result
        (the pass always ends on a checkpoint: the last batch is one)."""
        self.latest = self._estimates()
        widths = [hi - lo for _, lo, hi in self.latest.values()]
        finite = np.concatenate([w[np.isfinite(w)].ravel() for w in widths])
        widest = float(finite.max()) if finite.size else float("nan")
        self.history.append((seen, widest))
        return bool(finite.size) and widest <= self.query.tolerance

    def _result(self, seen: int, converged: bool) -> InspectionResult:
        estimates = self.latest  # from the checkpoint the pass ended on: ranking and probe fits are not redone
        order = np.argsort(-self.top_values, axis=1, kind="stable")
        return InspectionResult(
            layer=self.layer, units=self.units, groups=self.groups,
            hypotheses=[h.name for h in self.hypotheses], descriptions=[h.description for h in self.hypotheses],
            measures=list(self.query.measures),
            scores={m: e[0] for m, e in estimates.items()}, lower={m: e[1] for m, e in estimates.items()},
            upper={m: e[2] for m, e in estimates.items()}, n_inputs=seen, n_available=len(self.data),
            converged=converged, tolerance=self.query.tolerance, confidence=self.query.confidence,
            history=self.history, top_inputs=np.take_along_axis(self.top_inputs, order, axis=1),
            top_values=np.take_along_axis(self.top_values, order, axis=1), data=self.data.name)
