"""The classic coverage criteria beside IDC: NC, KMNC, NBC, SNAC, TKNC, LSC and DSC.

:class:`ClassicCoverage` is a scikit-learn estimator (see :mod:`mlflow_di.coverage.base`): every
setting is an ``__init__`` argument; ``fit(model, train)`` runs one activation pass over the
training set and keeps what each criterion needs (per-neuron bounds, surprise-adequacy traces);
``score(test)`` runs one pass over a test set and returns a :class:`CriteriaReport` with all
criteria at once. ``save``/``load`` keep the fitted statistics (a JSON file beside an ``.npz``),
so scoring a new test set needs the model but no training data.

A report keeps the *cells* each criterion's inputs covered (neurons, sections, buckets), so
reports of several test sets merge into the report of their union (:meth:`CriteriaReport.merge`):
e.g. the original test set plus its augmented copies.

Defaults follow DeepImportance's ``run.py`` (Gerasimou et al., ICSE 2020) and Kim et al.'s SA
code; the details and every difference from them are in the docstrings of
:mod:`mlflow_di.coverage.criteria_neuron` and :mod:`mlflow_di.coverage.criteria_surprise`.
Differences in *which* neurons are counted:

- Layers: by default the hidden layers with parameters (:func:`activations.hidden_layers`,
  LeNet-5: conv1, conv2, fc1, fc2). DeepImportance counts every Keras layer but the input and
  flatten layers, i.e. also the pooling layers, the logits and the softmax output.
- SA layer: by default the last hidden layer (LeNet-5: fc2), which is the reference's choice
  (``model.layers[-3]``). SA classes are the model's predictions, as in the reference.
- DSC's upper bound is 2 (Kim et al.); DeepImportance's ``run.py`` passes 2000 to both SA criteria.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import pathlib
import time
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator
from torch import nn

from mlflow_di.coverage import activations as act
from mlflow_di.coverage import criteria_device as on_device
from mlflow_di.coverage.base import check_fitted, check_saved, images_of, stamped
from mlflow_di.coverage.criteria_neuron import (
    boundary_cells,
    multisection_cells,
    nc_scaled_means,
    neuron_bounds,
    neuron_coverage_cells,
    top_k_cells,
)
from mlflow_di.coverage.criteria_surprise import (
    BUCKET_RULES,
    VAR_THRESHOLD,
    DistanceSurprise,
    LikelihoodSurprise,
    bucket_cells,
)
from mlflow_di.errors import UserError
from mlflow_di.models.device import module_device
from mlflow_di.registry import Registry
from mlflow_di.settings import OptionSpec

@dataclasses.dataclass(frozen=True)
class Adequacy:
    """How a surprise criterion's per-input values come to be (Kim et al.'s surprise adequacy): its model,
    ``fit(estimator, traces, predictions, nearest_other)`` on the training SA traces, kept in the estimator's
    ``attribute`` and scored per input with ``score_samples(traces, predictions, device)``; the report keeps the
    values as ``values_field``, and the fit's time is reported under ``fit_timer``. ``device`` is a CUDA model's
    device, where the distance work runs (:func:`coverage_device`), or None (the host)."""

    attribute: str
    values_field: str
    fit_timer: str
    fit: Callable


def _fit_likelihood(estimator, traces, predictions, _nearest_other, _device):
    return LikelihoodSurprise(estimator.setting("var_threshold")).fit(traces, predictions)  # cheap: on the host


def _fit_distance(estimator, traces, predictions, nearest_other, device):
    return DistanceSurprise().fit(traces, predictions, nearest_other, estimator.progress, device)


@dataclasses.dataclass(frozen=True)
class Criterion:
    """One classic criterion's record: what a cell is, the :class:`CoveredCells` fields it fills,
    what it needs from the training pass, how a batch of activations becomes its cells, and how the
    cells of several batches (or workers) merge. The estimator (:class:`ClassicCoverage`), the
    streamed passes (:mod:`mlflow_di.coverage.partials`) and the messages all read these records.

    ``score(batch, estimator)`` -> {field: boolean cells} for one batch (:class:`Batch`); None for the
    surprise criteria, whose per-input values (their ``adequacy``) are bucketed once every input is in
    (``merge`` is then ``per-input``; cells of the others are ``or``-ed).
    """

    name: str
    cell: str
    fields: tuple[str, ...]
    needs_bounds: bool = False
    score: Callable | None = None
    merge: str = "or"
    #: the name its scoring time is reported under in ``seconds_`` (NBC and SNAC share one pass)
    timer: str = ""
    #: ``count(cells) -> (covered, total)`` from a :class:`CoveredCells` (default: its one field's cells)
    count: Callable | None = None
    #: its own settings (a registered criterion's), each with its range and default: ``score`` reads one with
    #: ``estimator.setting(field)``; ``ClassicCoverage(criterion_settings={field: value})`` and ``coverage
    #: --criterion-setting FIELD=VALUE`` set it, checked against this table
    settings: tuple[OptionSpec, ...] = ()
    #: a surprise criterion's adequacy model (None for the cell criteria)
    adequacy: Adequacy | None = None
    #: ``score`` for a :class:`Batch` of tensors on the model's device (a GPU): the same cells as bool tensors
    #: there, so a batch's values need not travel to the host (None: the criterion scores on the host only)
    device_score: Callable | None = None

    def __post_init__(self):
        if self.count is None:
            field = self.fields[0]
            object.__setattr__(self, "count", lambda cells: (int(getattr(cells, field).sum()),
                                                             int(getattr(cells, field).size)))

    @property
    def surprise(self) -> bool:
        return self.merge == "per-input"


@dataclasses.dataclass
class Batch:
    """What scoring one batch gives every criterion: the neuron values side by side (N, neurons), NC's
    per-input scaled means (or None), the training bounds (or None) and each layer's neuron count.
    NumPy arrays for ``score``; tensors on the model's device for ``device_score``."""

    values: np.ndarray
    scaled: np.ndarray | None
    low: np.ndarray | None
    high: np.ndarray | None
    layer_sizes: Sequence[int]


def _boundary(batch: Batch, _estimator) -> dict:
    below, above = boundary_cells(batch.values, batch.low, batch.high)
    return {"below": below, "above": above}


def _boundary_on_device(batch: Batch, _estimator) -> dict:
    below, above = on_device.boundary_cells(batch.values, batch.low, batch.high)
    return {"below": below, "above": above}


def _buckets(name: str, upper: float) -> tuple[OptionSpec, ...]:
    """A surprise criterion's buckets and their range (SA values from ``lower`` to ``upper``)."""
    label = name.upper()
    return (OptionSpec(f"{name}_buckets", f"{label}'s buckets.", "int", low=1, default=1000),
            OptionSpec(f"{name}_lower", f"{label}'s lowest bucket edge.", "float", default=0.0),
            OptionSpec(f"{name}_upper", f"{label}'s top bucket edge.", "float", default=upper))


#: how SA values map to LSC's and DSC's buckets (both declare it; one value serves both)
_BUCKET_RULE = OptionSpec("surprise_bucket_rule", "How SA values map to LSC's and DSC's buckets: fixed (the ranges) "
                          "or sadl (Kim et al.'s rule).", "choice", choices=BUCKET_RULES, default="fixed")

#: Every classic criterion, in the order reports list them (a live registry: :func:`register_criterion` adds one).
#: Each declares its own settings (defaults as in DeepImportance's ``run.py`` / Kim et al.), read by ``score``
#: with ``estimator.setting(field)``, exactly as a registered criterion's are.
CRITERION = Registry("coverage criterion", Criterion, builtins=(
    Criterion("nc", "a neuron whose scaled output exceeds nc_threshold", ("nc",),
              score=lambda batch, e: {"nc": neuron_coverage_cells(batch.scaled, e.setting("nc_threshold"))},
              device_score=lambda batch, e: {"nc": on_device.neuron_coverage_cells(batch.scaled,
                                                                                   e.setting("nc_threshold"))},
              settings=(OptionSpec("nc_threshold", "NC's threshold on per-input min-max scaled outputs.", "float",
                                   low=0, high=1, default=0.75),)),
    Criterion("kmnc", "one of kmnc_sections sections of a neuron's training range", ("kmnc",), needs_bounds=True,
              score=lambda batch, e: {"kmnc": multisection_cells(batch.values, batch.low, batch.high,
                                                                 e.setting("kmnc_sections"))},
              device_score=lambda batch, e: {"kmnc": on_device.multisection_cells(batch.values, batch.low, batch.high,
                                                                                  e.setting("kmnc_sections"))},
              settings=(OptionSpec("kmnc_sections", "KMNC's sections per neuron.", "int", low=1, default=1000),)),
    Criterion("nbc", "a neuron's region below or above its training range", ("below", "above"), needs_bounds=True,
              score=_boundary, device_score=_boundary_on_device, timer="nbc_snac",
              count=lambda cells: (int(cells.below.sum() + cells.above.sum()), 2 * int(cells.above.size))),
    Criterion("snac", "a neuron's region above its training range", ("below", "above"), needs_bounds=True,
              score=_boundary, device_score=_boundary_on_device, timer="nbc_snac",
              count=lambda cells: (int(cells.above.sum()), int(cells.above.size))),
    Criterion("tknc", "a neuron among the tknc_k most active of its layer", ("tknc",),
              score=lambda batch, e: {"tknc": top_k_cells(batch.values, batch.layer_sizes, e.setting("tknc_k"))},
              device_score=lambda batch, e: {"tknc": on_device.top_k_cells(batch.values, batch.layer_sizes,
                                                                           e.setting("tknc_k"))},
              settings=(OptionSpec("tknc_k", "TKNC's top neurons per layer.", "int", low=1, default=3),)),
    Criterion("lsc", "one of lsc_buckets buckets of likelihood surprise", ("lsc",), merge="per-input",
              adequacy=Adequacy("likelihood_", "lsa", "lsa_fit", _fit_likelihood),
              settings=(*_buckets("lsc", 2000.0), _BUCKET_RULE,
                        OptionSpec("var_threshold", "LSA drops neurons with a lower in-class variance.", "float", low=0,
                                   default=VAR_THRESHOLD))),
    Criterion("dsc", "one of dsc_buckets buckets of distance surprise", ("dsc",), merge="per-input",
              adequacy=Adequacy("distance_", "dsa", "dsa_fit", _fit_distance),
              settings=(*_buckets("dsc", 2.0), _BUCKET_RULE)),
))
#: The built-in criteria (the default of :class:`ClassicCoverage`); :func:`register_criterion` adds others.
CRITERIA = CRITERION.builtins
_SURPRISE = {c.name for c in CRITERION.values() if c.surprise}
#: ``{field: OptionSpec}`` of the built-in criteria's settings: reported by every ClassicCoverage (its settings format)
_BUILT_IN_SETTINGS = {spec.field: spec for name in CRITERIA for spec in CRITERION[name].settings}
_BATCH_SIZE = OptionSpec("batch_size", "Images per pass.", "int", low=1)


def register_criterion(criterion: Criterion) -> Criterion:
    """Add a cell criterion: ``ClassicCoverage(criteria=[..., name])``, the streamed passes, reports and
    ``mlflow-di coverage --criteria`` know it from now on (one record; see :class:`Criterion`)."""
    if not isinstance(criterion, Criterion) or criterion.score is None:
        raise UserError("register_criterion takes a Criterion whose score(batch, estimator) gives its cells")
    return CRITERION.register(criterion)


def unregister_criterion(name: str) -> None:
    """Forget a registered criterion (tests add toy ones); the built-ins stay."""
    CRITERION.unregister(name)


def criterion_settings(criteria=None) -> dict[str, OptionSpec]:
    """``{field: OptionSpec}`` of the settings the registered ``criteria`` (default: every one) declare."""
    chosen = CRITERION.values() if criteria is None else (CRITERION[name] for name in criteria if name in CRITERION)
    return {spec.field: spec for criterion in chosen for spec in criterion.settings}


def _owner(field: str, criteria) -> str:
    """The name of the criterion among ``criteria`` that declares ``field``."""
    return next(name for name in criteria if any(spec.field == field for spec in CRITERION[name].settings))


def _adequacies(criteria) -> list[tuple[str, Adequacy]]:
    """(name, adequacy model) of the surprise criteria among ``criteria``, in the records' order."""
    return [(name, CRITERION[name].adequacy) for name in CRITERION if name in criteria and CRITERION[name].adequacy]


def _bounded(criteria) -> bool:
    """Whether any of ``criteria`` needs the training bounds (per-neuron min/max)."""
    return any(CRITERION[name].needs_bounds for name in criteria)


def batch_cells(criteria: Sequence[str], batch: Batch, estimator, timed=None, on_device: bool = False
                ) -> dict[str, np.ndarray]:
    """The cells one batch covers, for every cell criterion of ``criteria`` (each field computed once:
    NBC and SNAC share theirs); ``timed(name)`` a context manager timing each (optional). ``on_device``:
    a batch of tensors scored with each record's ``device_score`` (bool tensors where they are)."""
    cells: dict[str, np.ndarray] = {}
    for name in criteria:
        record = CRITERION[name]
        if record.score is None or set(record.fields) <= set(cells):
            continue
        with (timed(record.timer or name) if timed is not None else contextlib.nullcontext()):
            cells.update((record.device_score if on_device else record.score)(batch, estimator))
    return cells


def cells_on_device(device) -> bool:
    """Whether the cell criteria of a model on ``device`` are scored there (:class:`DeviceCells`): on a
    CUDA GPU. On the CPU the NumPy functions are the path (no copy to save), and MPS lacks float64."""
    return device.type == "cuda"


def coverage_device(model):
    """Where ``model``'s coverage work runs (a TorchModel, or None): its device when :func:`cells_on_device`
    says so (a CUDA GPU: the cell criteria batch by batch, LSA's and DSA's distances), else None (NumPy on
    the host)."""
    if model is None:
        return None
    device = module_device(model.module)
    return device if cells_on_device(device) else None


class DeviceCells:
    """The cells of a scoring pass accumulated on the model's device, batch by batch: what
    :func:`collect_activations` hands each batch to (``on_batch``), so that only the cells, not every
    layer's values, travel to the host. The same cells as scoring the whole set on the host."""

    def __init__(self, estimator: "ClassicCoverage"):
        self.estimator = estimator
        self.criteria = estimator._criteria()
        self._cells: dict[str, torch.Tensor] = {}
        self._bounds: tuple | None = None

    @staticmethod
    def usable(criteria: Sequence[str]) -> bool:
        """Whether every cell criterion among ``criteria`` can score on the device."""
        return all(CRITERION[name].device_score is not None for name in criteria if CRITERION[name].score)

    def add(self, values: Mapping[str, torch.Tensor]) -> None:
        """One batch's reduced values, keyed as :meth:`ClassicCoverage.collect` records them."""
        estimator = self.estimator
        side_by_side = torch.cat([values[f"{_TAPPED}{layer}"] for layer in estimator.layers_], dim=1)
        scaled = torch.cat([values[f"{_TAPPED}{layer}:{_NC_KEY}"] for layer in estimator.layers_], dim=1) \
            if "nc" in self.criteria else None
        if self._bounds is None:
            self._bounds = tuple(None if bound is None else torch.as_tensor(bound, dtype=torch.float64,
                                                                             device=side_by_side.device)
                                 for bound in (estimator.low_, estimator.high_))
        batch = Batch(side_by_side, scaled, *self._bounds, estimator.layer_sizes_)
        for field, covered in batch_cells(self.criteria, batch, estimator, on_device=True).items():
            self._cells[field] = covered if field not in self._cells else self._cells[field] | covered

    def cells(self) -> dict[str, np.ndarray]:
        """{field: boolean cells} of every batch added, on the host."""
        return {field: covered.cpu().numpy() for field, covered in self._cells.items()}


_NC_KEY = "nc"  # reduction name: collect_activations returns f"{layer}:nc"
_OUTPUT = "output"  # name of the tap on the model's output (see _OutputTap)
_TAPPED = "model."  # prefix of the model's layers under the tap
FILE_STEM = "classic_criteria"
KIND = "classic-criteria"


class CoveredCells:
    """Which cells of each criterion a set of inputs covers, by field (a criterion's ``fields``:
    ``nc``, ``kmnc``, ``below``/``above``, ``tknc``, ``lsc``, ``dsc``, or a registered criterion's);
    an attribute is ``None`` for a criterion not measured. ``below``/``above`` are NBC's two corner
    regions per neuron; ``above`` alone is SNAC."""

    def __init__(self, **cells):
        known = _fields()
        unknown = set(cells) - known
        if unknown:
            raise UserError(f"no criterion has the cells {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        self.__dict__["cells"] = {name: value for name, value in cells.items() if value is not None}

    def __getattr__(self, name: str):
        if name in _fields():
            return self.__dict__["cells"].get(name)
        raise AttributeError(f"'CoveredCells' object has no attribute '{name}'")

    def __setattr__(self, name: str, value) -> None:
        if name not in _fields():
            raise AttributeError(f"no criterion has the cells '{name}'")
        self.__dict__["cells"][name] = value

    def __eq__(self, other) -> bool:
        return isinstance(other, CoveredCells) and self.cells.keys() == other.cells.keys() and all(
            np.array_equal(value, other.cells[name]) for name, value in self.cells.items())

    def union(self, other: "CoveredCells") -> "CoveredCells":
        """Cells covered by either set (the cells of the two input sets together)."""
        merged = {}
        for name in sorted(self.cells.keys() | other.cells.keys()):
            mine, theirs = self.cells.get(name), other.cells.get(name)
            if (mine is None) != (theirs is None) or mine.shape != theirs.shape:
                raise UserError(
                    f"cannot merge criteria reports measured differently ({name} cells differ); "
                    "score both test sets with the same fitted ClassicCoverage"
                )
            merged[name] = mine | theirs
        return CoveredCells(**merged)

    def counts(self, criterion: str) -> tuple[int, int]:
        """(covered, total) cells of one criterion (its record's ``count``)."""
        return CRITERION[criterion].count(self)

    def to_dict(self) -> dict:
        return {name: _pack_bits(value) for name, value in self.cells.items()}

    @classmethod
    def from_dict(cls, values: dict) -> "CoveredCells":
        return cls(**{name: _unpack_bits(packed) for name, packed in values.items()})


def _fields() -> set[str]:
    return {field for criterion in CRITERION.values() for field in criterion.fields}


@dataclasses.dataclass
class CriteriaReport:
    """The classic criteria of one test set (or a union of several).

    ``coverage`` maps each measured criterion (nc, kmnc, nbc, snac, tknc, lsc, dsc) to a fraction
    in [0, 1]; ``lsa``/``dsa`` hold per-input surprise adequacy (NaN where undefined: the input's
    predicted class has no training density / no training input).
    """

    data_name: str
    num_inputs: int
    criteria: tuple[str, ...]
    cells: CoveredCells
    lsa: np.ndarray | None = None
    dsa: np.ndarray | None = None
    settings: dict = dataclasses.field(default_factory=dict)

    @property
    def coverage(self) -> dict[str, float]:
        out = {}
        for criterion in self.criteria:
            covered, total = self.cells.counts(criterion)
            out[criterion] = covered / total if total else 0.0
        return out

    @property
    def covered(self) -> dict[str, tuple[int, int]]:
        """(covered, total) cells per criterion."""
        return {criterion: self.cells.counts(criterion) for criterion in self.criteria}

    def merge(self, other: "CriteriaReport", name: str | None = None) -> "CriteriaReport":
        """The report of both input sets together: cells united, per-input SA values concatenated.

        Under SADL's bucket rule the surprise buckets start at the set's smallest value, so LSC's
        and DSC's cells are recomputed from the concatenated values instead of united.
        """
        if self.criteria != other.criteria or self.settings != other.settings:
            raise UserError("cannot merge criteria reports with different criteria or settings; "
                            "score both test sets with the same fitted ClassicCoverage")
        cells = self.cells.union(other.cells)
        lsa, dsa = _concat(self.lsa, other.lsa), _concat(self.dsa, other.dsa)
        if self.settings.get("surprise_bucket_rule", "fixed") != "fixed":
            merged = {"lsa": lsa, "dsa": dsa}
            for criterion, adequacy in _adequacies(self.criteria):
                values = merged[adequacy.values_field]
                if getattr(cells, criterion) is not None and values is not None:
                    setattr(cells, criterion, _surprise_cells(values, self.settings, criterion))
        return CriteriaReport(
            data_name=name or f"{self.data_name} + {other.data_name}",
            num_inputs=self.num_inputs + other.num_inputs,
            criteria=self.criteria,
            cells=cells,
            lsa=lsa,
            dsa=dsa,
            settings=dict(self.settings),
        )

    @classmethod
    def combine(cls, reports: Sequence["CriteriaReport"], name: str | None = None) -> "CriteriaReport":
        """The report of several input sets together (see :meth:`merge`)."""
        if not reports:
            raise UserError("no criteria reports to combine")
        combined = reports[0]
        for report in reports[1:]:
            combined = combined.merge(report)
        if name:
            combined.data_name = name
        return combined

    def to_dict(self) -> dict:
        covered = self.covered
        return {
            "data_name": self.data_name,
            "num_inputs": self.num_inputs,
            "criteria": list(self.criteria),
            "coverage": self.coverage,  # derived from cells; for readers of the JSON
            "covered_cells": {k: covered[k][0] for k in self.criteria},
            "total_cells": {k: covered[k][1] for k in self.criteria},
            "settings": self.settings,
            "lsa": _floats_to_list(self.lsa),
            "dsa": _floats_to_list(self.dsa),
            "cells": self.cells.to_dict(),
        }

    @classmethod
    def from_dict(cls, values: dict) -> "CriteriaReport":
        return cls(
            data_name=values["data_name"],
            num_inputs=int(values["num_inputs"]),
            criteria=tuple(values["criteria"]),
            cells=CoveredCells.from_dict(values["cells"]),
            lsa=_floats_from_list(values.get("lsa")),
            dsa=_floats_from_list(values.get("dsa")),
            settings=dict(values.get("settings", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CriteriaReport":
        return cls.from_dict(json.loads(text))


class ClassicCoverage(BaseEstimator):
    """NC, KMNC, NBC, SNAC, TKNC, LSC and DSC from one activation pass per data set.

    Parameters: ``criteria`` any subset of :data:`CRITERION` (default: the built-in ones); ``layers``
    the layers whose neurons NC, KMNC, NBC, SNAC and TKNC count (None: all hidden layers); ``sa_layers``
    the layers whose neurons, side by side, form the SA trace (None: the last hidden layer);
    ``criterion_settings`` ``{field: value}`` of the criteria's own settings, each declared once in its
    criterion's record (:data:`CRITERION`) with its range and default, built-in and registered criteria
    alike: ``nc_threshold`` 0.75 on per-input min-max scaled outputs; ``kmnc_sections`` 1000;
    ``tknc_k`` 3; ``lsc_buckets``/``lsc_lower``/``lsc_upper`` 1000 over [0, 2000];
    ``dsc_buckets``/``dsc_lower``/``dsc_upper`` 1000 over [0, 2] (defaults as in DeepImportance's
    ``run.py`` / Kim et al.); ``surprise_bucket_rule`` how SA values map to LSC's and DSC's buckets:
    ``"fixed"`` (default: the ranges above; a value below the lower bound, e.g. a negative LSA, counts
    in the first bucket) or ``"sadl"`` (Kim et al.'s rule, to reproduce their numbers: buckets from
    the test set's smallest value up to the upper bound, the lower bounds unused; coverage can then
    fall as inputs are added), see :mod:`mlflow_di.coverage.criteria_surprise`; ``var_threshold``
    1e-5 (LSA drops neurons with lower in-class variance). The built-in criteria's settings are
    reported whichever criteria are chosen; a registered criterion's only when it is chosen.
    ``batch_size``: images per pass; ``progress``: a progress bar.

    Fitted attributes: ``layers_``, ``layer_sizes_``, ``low_``/``high_`` (per-neuron training
    bounds), ``sa_layers_``, ``sa_traces_``/``sa_classes_`` (training SA traces and predicted
    classes), ``likelihood_`` (:class:`LikelihoodSurprise`), ``distance_``
    (:class:`DistanceSurprise`), ``train_name_``, ``num_train_``, ``model_`` (the TorchModel
    scored with; None when fitted from activations or loaded without one), and ``seconds_``
    (time per stage of the last fit/score, for benchmarks).
    """

    def __init__(self, criteria: Sequence[str] = CRITERIA, layers: Sequence[str] | None = None,
                 sa_layers: Sequence[str] | None = None, criterion_settings: Mapping | None = None,
                 batch_size: int = 256, progress: bool = True):
        self.criteria = criteria
        self.layers = layers
        self.sa_layers = sa_layers
        self.criterion_settings = criterion_settings
        self.batch_size = batch_size
        self.progress = progress

    # ----------------------------------------------------------------- settings
    def settings(self) -> dict:
        """The settings that decide the numbers (what a report must share to be merged)."""
        criteria = self._criteria()
        value = self._settings_of(criteria)
        return {
            "criteria": list(criteria),
            "nc_threshold": float(value["nc_threshold"]),
            "kmnc_sections": int(value["kmnc_sections"]),
            "tknc_k": int(value["tknc_k"]),
            "lsc_buckets": int(value["lsc_buckets"]),
            "lsc_range": [float(value["lsc_lower"]), float(value["lsc_upper"])],
            "dsc_buckets": int(value["dsc_buckets"]),
            "dsc_range": [float(value["dsc_lower"]), float(value["dsc_upper"])],
            "surprise_bucket_rule": str(value["surprise_bucket_rule"]),
            "var_threshold": float(value["var_threshold"]),
            "criterion_settings": {field: v for field, v in value.items() if field not in _BUILT_IN_SETTINGS},
            "layers": list(getattr(self, "layers_", self.layers or [])),
            "sa_layers": list(getattr(self, "sa_layers_", self.sa_layers or [])),
        }

    def setting(self, field: str):
        """One of the criteria's own settings: the value given in ``criterion_settings``, else its default."""
        return self._settings_of(self._criteria())[field]

    def _settings_of(self, criteria) -> dict:
        """``{field: value}`` of every built-in criterion's setting and of those the chosen registered ``criteria``
        declare, checked (defaults filled in); a one-line UserError for a setting none of them declares."""
        declared = {**_BUILT_IN_SETTINGS, **criterion_settings(criteria)}
        given = dict(self.criterion_settings or {})
        unknown = sorted(set(given) - set(declared))
        if unknown:
            raise UserError(f"no chosen criterion has the setting {unknown[0]}; theirs: {', '.join(declared)}")
        return {field: spec.check(given[field], f"criterion {_owner(field, CRITERION)}") if field in given
                else spec.default for field, spec in declared.items()}

    def _criteria(self) -> tuple[str, ...]:
        criteria = (self.criteria,) if isinstance(self.criteria, str) else tuple(self.criteria)
        unknown = [c for c in criteria if c not in CRITERION]
        if unknown or not criteria:
            raise UserError(f"unknown criteria {unknown or '(none given)'}; choose from {', '.join(CRITERION)}")
        return tuple(c for c in CRITERION if c in criteria)  # canonical order, no duplicates

    def _check_settings(self) -> None:
        _BATCH_SIZE.check(self.batch_size, "ClassicCoverage")
        value = self._settings_of(self._criteria())
        for name in ("lsc", "dsc"):
            lower, upper = value[f"{name}_lower"], value[f"{name}_upper"]
            if not upper > lower:
                raise UserError(f"{name}_upper must be greater than {name}_lower, got [{lower}, {upper}]")

    @property
    def reductions(self) -> dict:
        """The extra reductions :func:`collect_activations` must apply for these criteria."""
        return {_NC_KEY: nc_scaled_means} if "nc" in self._criteria() else {}

    def required_layers(self) -> list[str]:
        """Layers whose activations fitting and scoring need (after :meth:`resolve_layers` or a fit)."""
        if not hasattr(self, "layers_"):
            raise UserError("ClassicCoverage is not fitted yet; call fit(model, train) or ClassicCoverage.load(dir)")
        return list(dict.fromkeys([*self.layers_, *self.sa_layers_]))

    def resolve_layers(self, module: nn.Module | None = None) -> "ClassicCoverage":
        """Fix ``layers_``/``sa_layers_``: the given ones, or the defaults of ``module``.

        Callers who collect activations themselves (e.g. one pass shared with IDC) call this, then
        record :meth:`required_layers` with :attr:`reductions`, then :meth:`fit_activations`.
        """
        needs_sa = bool(_SURPRISE & set(self._criteria()))
        if module is None and (not self.layers or (needs_sa and not self.sa_layers)):
            raise UserError("give layers (and sa_layers for lsc/dsc) or the model to take the default layers from")
        self.layers_ = list(self.layers) if self.layers else act.hidden_layers(module)
        self.sa_layers_ = (list(self.sa_layers) if self.sa_layers else [act.default_layer(module)]) if needs_sa else []
        if module is not None:
            act.check_layers(module, self.required_layers())
        return self

    def collect(self, model, data, on_batch=None, keep: Sequence[str] | None = None
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """One forward pass over ``data`` (ImageSet or raw uint8 images): ({layer: (N, neurons)} for the required layers
        plus NC's ``f"{layer}:nc"`` scaled means, predicted classes (N,)) -- what
        :meth:`fit_activations` and :meth:`score_activations` take. ``on_batch`` and ``keep``: see
        :func:`~mlflow_di.coverage.activations.collect_activations` (``keep`` names layers; the predictions are
        always kept)."""
        tap = _OutputTap(model.module)
        layers = [f"{_TAPPED}{layer}" for layer in self.required_layers()] + [_OUTPUT]
        kept = None if keep is None else [*(f"{_TAPPED}{key}" for key in keep), _OUTPUT]
        images, _ = images_of(data)
        values = act.collect_activations(tap, act.PreprocessedImages(images, model.preprocessing), layers, self.batch_size,
                                         self.reductions, self.progress, on_batch=on_batch, keep=kept)
        outputs = values.pop(_OUTPUT)
        values.pop(f"{_OUTPUT}:{_NC_KEY}", None)
        values = {key.removeprefix(_TAPPED): array for key, array in values.items()}
        return values, outputs.argmax(axis=1)

    # ---------------------------------------------------------------------- fit
    def fit(self, model, images) -> "ClassicCoverage":
        """One activation pass over ``images`` (ImageSet or raw uint8 images) through ``model`` (a TorchModel)."""
        self._check_settings()
        self.resolve_layers(model.module)
        started = time.perf_counter()
        values, predictions = self.collect(model, images)
        seconds = time.perf_counter() - started
        self.fit_activations(values, predictions, train_name=images_of(images)[1], device=coverage_device(model))
        self.seconds_["activations"] = seconds
        self.model_ = model
        return self

    def fit_activations(self, activations: Mapping[str, np.ndarray], predictions: np.ndarray,
                        train_name: str = "train", nearest_other: np.ndarray | None = None,
                        device=None) -> "ClassicCoverage":
        """Fit from activations already collected: ``activations[layer]`` (N, neurons) for every
        layer of :meth:`required_layers`, ``predictions`` (N,) the model's predicted classes.
        The layers are those of :meth:`resolve_layers` (called by :meth:`fit`), or else the given
        ``layers``/``sa_layers``. ``nearest_other`` (from a saved fit) skips DSA's quadratic step;
        ``device`` (a GPU, :func:`coverage_device`) is where it runs otherwise (None: NumPy).
        """
        if not hasattr(self, "layers_"):
            self.resolve_layers(None)
        predictions = np.asarray(predictions).reshape(-1)
        layer_sizes = [int(_layer_values(activations, layer).shape[1]) for layer in self.layers_]
        neuron_values = _side_by_side(activations, self.layers_)
        if len(neuron_values) != len(predictions):
            raise UserError(f"{len(neuron_values)} activation rows but {len(predictions)} predictions")
        low, high = neuron_bounds(neuron_values) if _bounded(self._criteria()) else (None, None)
        traces = _side_by_side(activations, self.sa_layers_) if self.sa_layers_ else None
        return self.fit_statistics(layer_sizes, low, high, traces=traces, predictions=predictions,
                                   num_train=len(predictions), train_name=train_name, nearest_other=nearest_other,
                                   device=device)

    def fit_statistics(self, layer_sizes: Sequence[int], low: np.ndarray | None, high: np.ndarray | None,
                       traces: np.ndarray | None, predictions: np.ndarray | None, num_train: int,
                       train_name: str = "train", nearest_other: np.ndarray | None = None,
                       device=None) -> "ClassicCoverage":
        """Fit from the statistics of a training pass (what :meth:`fit_activations` derives from the
        activations, or a pass spread over workers merges, see :mod:`mlflow_di.coverage.partials`):
        each layer's neuron count, the per-neuron min/max over the training inputs (None when no
        criterion needs them), the SA traces (n, neurons of the SA layers side by side) and the
        predicted classes (None without LSC/DSC): LSA's KDE and DSA's nearest neighbours need every
        training trace, so those stay per input. ``resolve_layers`` must have run. ``device``: see
        :meth:`fit_activations`.
        """
        self._check_settings()
        criteria = self._criteria()
        self.seconds_ = {}
        self.layer_sizes_ = [int(size) for size in layer_sizes]
        self.train_name_, self.num_train_ = train_name, int(num_train)
        self.model_ = None
        self.low_, self.high_ = (low, high) if _bounded(criteria) else (None, None)
        self._forget_adequacies()
        self.sa_traces_, self.sa_classes_ = None, None
        if self.sa_layers_:
            predictions = np.asarray(predictions).reshape(-1)
            self.sa_traces_, self.sa_classes_ = traces, predictions.astype(np.int64)
            for _, adequacy in _adequacies(criteria):
                with self._timed(adequacy.fit_timer):
                    setattr(self, adequacy.attribute, adequacy.fit(self, traces, predictions, nearest_other, device))
        return self

    def _forget_adequacies(self) -> None:
        """Every surprise criterion's model unset (None), whether or not it is chosen."""
        for _, adequacy in _adequacies(CRITERION):
            setattr(self, adequacy.attribute, None)

    # -------------------------------------------------------------------- score
    def score(self, images) -> CriteriaReport:
        """One activation pass over ``images`` (ImageSet or raw uint8 images); all criteria in one
        :class:`CriteriaReport`, through the model given to :meth:`fit` or :meth:`load`."""
        return self.score_pass(images)[0]

    def score_pass(self, images, keep_layers: Sequence[str] = ()) -> tuple[CriteriaReport, dict[str, np.ndarray]]:
        """:meth:`score`, and the pass's activations of ``keep_layers`` (and the SA layers) for another
        estimator to reuse (:class:`~mlflow_di.coverage.suite.CoverageSuite` gives IDC its layers this way).

        On a CUDA model the cell criteria score each batch where it is (:class:`DeviceCells`) and only
        the kept layers' values come to the host; elsewhere every layer's values do, and the criteria
        score them there. The report is the same.
        """
        self._check_fitted()
        if self.model_ is None:
            raise UserError("scoring needs the model: fit(model, images), or load(directory, model=...)")
        _, name = images_of(images)
        started = time.perf_counter()
        if coverage_device(self.model_) is not None and DeviceCells.usable(self._criteria()):
            cells = DeviceCells(self)
            values, predictions = self.collect(self.model_, images, on_batch=cells.add,
                                               keep=[*self.sa_layers_, *keep_layers])
            report = self.score_cells(cells.cells(), _side_by_side(values, self.sa_layers_) if self.sa_layers_ else None,
                                      predictions, len(predictions), data_name=name)
            self.seconds_["activations_and_cells"] = time.perf_counter() - started
            return report, values
        values, predictions = self.collect(self.model_, images)
        seconds = time.perf_counter() - started
        report = self.score_activations(values, predictions, data_name=name)
        self.seconds_["activations"] = seconds
        return report, values

    def score_activations(self, activations: Mapping[str, np.ndarray], predictions: np.ndarray,
                          data_name: str = "test") -> CriteriaReport:
        """Score activations already collected (same keys as :meth:`fit_activations`, plus
        ``f"{layer}:nc"`` from :attr:`reductions` when NC is measured)."""
        self._check_fitted()
        criteria = self._criteria()
        self.seconds_ = {}
        predictions = np.asarray(predictions).reshape(-1)
        values = _side_by_side(activations, self.layers_)
        if len(values) != len(predictions):
            raise UserError(f"{len(values)} activation rows but {len(predictions)} predictions")
        scaled = _side_by_side(activations, [f"{layer}:{_NC_KEY}" for layer in self.layers_]) if "nc" in criteria \
            else None
        cells = CoveredCells(**batch_cells(criteria, Batch(values, scaled, self.low_, self.high_, self.layer_sizes_),
                                           self, self._timed))
        traces = _side_by_side(activations, self.sa_layers_) if self.sa_layers_ else None
        return self._finish(cells, traces, predictions, data_name)

    def score_cells(self, cells: Mapping[str, np.ndarray], traces: np.ndarray | None, predictions: np.ndarray | None,
                    num_inputs: int, data_name: str = "test") -> CriteriaReport:
        """The report of a scoring pass spread over workers (see :mod:`mlflow_di.coverage.partials`):
        the united cells of NC/KMNC/NBC/SNAC/TKNC (``nc``, ``kmnc``, ``below``, ``above``, ``tknc``),
        and every input's SA trace and predicted class (None without LSC/DSC), which LSA and DSA need
        input by input."""
        self._check_fitted()
        self.seconds_ = {}
        covered = CoveredCells(**{name: np.asarray(value, dtype=bool) for name, value in cells.items()})
        if predictions is None:
            predictions = np.zeros(num_inputs, dtype=np.int64)  # unused: only SA reads the classes
        return self._finish(covered, traces, np.asarray(predictions).reshape(-1), data_name)

    def _finish(self, cells: CoveredCells, traces, predictions: np.ndarray, data_name: str) -> CriteriaReport:
        """LSC and DSC from the SA traces added to ``cells``: the report."""
        criteria = self._criteria()
        values: dict[str, np.ndarray] = {}
        settings = self.settings()
        device = coverage_device(self.model_)
        if self.sa_layers_:
            for criterion, adequacy in _adequacies(criteria):
                with self._timed(criterion):
                    values[adequacy.values_field] = getattr(self, adequacy.attribute).score_samples(traces, predictions,
                                                                                                    device)
                    setattr(cells, criterion, _surprise_cells(values[adequacy.values_field], settings, criterion))
        return CriteriaReport(data_name, len(predictions), criteria, cells=cells, lsa=values.get("lsa"), dsa=values.get("dsa"),
                              settings=settings)

    # --------------------------------------------------------------- save/load
    def save(self, directory) -> pathlib.Path:
        """Write the fitted statistics: ``classic_criteria.json`` (settings, layers) and
        ``classic_criteria.npz`` (bounds, SA traces and classes, DSA reference distances)."""
        self._check_fitted()
        folder = pathlib.Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {**self.settings(), "batch_size": int(self.batch_size), "layer_sizes": self.layer_sizes_,
                "train_name": self.train_name_, "num_train": self.num_train_}
        (folder / f"{FILE_STEM}.json").write_text(json.dumps(stamped(KIND, meta), indent=1))
        arrays = {"low": self.low_, "high": self.high_, "sa_traces": self.sa_traces_,
                  "sa_classes": self.sa_classes_,
                  "nearest_other": None if self.distance_ is None else self.distance_.nearest_other_}
        np.savez_compressed(folder / f"{FILE_STEM}.npz", **{k: v for k, v in arrays.items() if v is not None})
        return folder

    @classmethod
    def load(cls, directory, model=None, progress: bool = True) -> "ClassicCoverage":
        """A fitted :class:`ClassicCoverage` from :meth:`save`'s files; ``model`` for :meth:`score`."""
        folder = pathlib.Path(directory)
        paths = folder / f"{FILE_STEM}.json", folder / f"{FILE_STEM}.npz"
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise UserError(f"no saved classic criteria: missing {', '.join(missing)}")
        try:
            meta = json.loads(paths[0].read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"'{paths[0]}' is not valid JSON ({exc}); it holds no saved {KIND}") from None
        check_saved(meta, KIND, f"'{paths[0]}'")
        with np.load(paths[1]) as archive:
            arrays = {name: archive[name] for name in archive.files}
        built_in = {"nc_threshold": meta["nc_threshold"], "kmnc_sections": meta["kmnc_sections"],
                    "tknc_k": meta["tknc_k"], "lsc_buckets": meta["lsc_buckets"], "lsc_lower": meta["lsc_range"][0],
                    "lsc_upper": meta["lsc_range"][1], "dsc_buckets": meta["dsc_buckets"],
                    "dsc_lower": meta["dsc_range"][0], "dsc_upper": meta["dsc_range"][1],
                    "surprise_bucket_rule": meta.get("surprise_bucket_rule", "fixed"),  # saved before the rule existed
                    "var_threshold": meta["var_threshold"]}
        coverage = cls(criteria=meta["criteria"], layers=meta["layers"], sa_layers=meta["sa_layers"] or None,
                       criterion_settings={**built_in, **(meta.get("criterion_settings") or {})},
                       batch_size=meta.get("batch_size", 256), progress=progress)
        coverage.layers_, coverage.sa_layers_ = list(meta["layers"]), list(meta["sa_layers"])
        coverage.layer_sizes_ = [int(v) for v in meta["layer_sizes"]]
        coverage.train_name_, coverage.num_train_ = meta["train_name"], int(meta["num_train"])
        coverage.low_, coverage.high_ = arrays.get("low"), arrays.get("high")
        coverage._restore_surprise(arrays, coverage_device(model))
        coverage.model_ = model
        return coverage

    def _restore_surprise(self, arrays: dict, device=None) -> None:
        """LSA's and DSA's models fitted again from the saved traces (DSA's distances too when none were saved,
        on ``device``)."""
        self._forget_adequacies()
        self.sa_traces_, self.sa_classes_ = arrays.get("sa_traces"), arrays.get("sa_classes")
        if self.sa_traces_ is None:
            return
        for _, adequacy in _adequacies(self._criteria()):  # the saved traces fit them again, exactly
            setattr(self, adequacy.attribute, adequacy.fit(self, self.sa_traces_, self.sa_classes_,
                                                           arrays.get("nearest_other"), device))

    # ------------------------------------------------------------------ helpers
    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "layer_sizes_")

    def _check_fitted(self) -> None:
        check_fitted(self, "fit(model, images) or ClassicCoverage.load(directory)")

    def _timed(self, stage: str):
        return _Stopwatch(self.seconds_, stage)


class _OutputTap(nn.Module):
    """Wraps a model so its final output can be recorded like a layer (``output``) in the same pass.

    The criteria need the model's predicted classes (SA groups inputs by them); tapping the
    output avoids a second forward pass and works for any module, not only nn.Sequential.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.output = nn.Identity()
        # A new module starts in training mode; eval_mode() restores the mode it found, which would
        # switch the wrapped model to training mode (batch norms then drift on every later pass).
        self.train(model.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.model(x))


class _Stopwatch:
    def __init__(self, record: dict, stage: str):
        self.record, self.stage = record, stage

    def __enter__(self):
        self.started = time.perf_counter()

    def __exit__(self, *exc_info):
        self.record[self.stage] = self.record.get(self.stage, 0.0) + time.perf_counter() - self.started
        return False


def _layer_values(activations: Mapping[str, np.ndarray], layer: str) -> np.ndarray:
    if layer not in activations:
        raise UserError(f"no activations for layer '{layer}' (have: {', '.join(sorted(activations))})")
    values = np.asarray(activations[layer])
    return values.reshape(len(values), -1)


def _side_by_side(activations: Mapping[str, np.ndarray], layers: Sequence[str]) -> np.ndarray:
    """The layers' (N, neurons) arrays as one (N, total neurons) array, in ``layers`` order."""
    return np.concatenate([_layer_values(activations, layer) for layer in layers], axis=1)


def _surprise_cells(values: np.ndarray, settings: dict, criterion: str) -> np.ndarray:
    """LSC's or DSC's (``criterion``) cells of SA ``values`` under the bucket rule and range in ``settings``."""
    lower, upper = settings[f"{criterion}_range"]
    return bucket_cells(values, settings.get("surprise_bucket_rule", "fixed"), lower, upper,
                        settings[f"{criterion}_buckets"])


def _pack_bits(cells: np.ndarray) -> dict:
    return {"shape": list(cells.shape),
            "bits": base64.b64encode(np.packbits(cells.astype(bool).reshape(-1)).tobytes()).decode("ascii")}


def _unpack_bits(packed: dict) -> np.ndarray:
    shape = tuple(packed["shape"])
    raw = np.frombuffer(base64.b64decode(packed["bits"]), dtype=np.uint8)
    return np.unpackbits(raw, count=int(np.prod(shape))).astype(bool).reshape(shape)


def _floats_to_list(values: np.ndarray | None) -> list | None:
    """Floats for strict JSON, which has no NaN/inf: those become the strings "nan", "inf", "-inf"."""
    if values is None:
        return None
    return [float(v) if np.isfinite(v) else str(float(v)) for v in values]


def _floats_from_list(values: list | None) -> np.ndarray | None:
    if values is None:
        return None
    return np.array([float(v) for v in values], dtype=np.float64)


def _concat(first: np.ndarray | None, second: np.ndarray | None) -> np.ndarray | None:
    if first is None or second is None:
        return None
    return np.concatenate([first, second])
