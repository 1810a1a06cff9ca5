"""IDC and the classic criteria together: one fit on the training set, one pass per test set.

:class:`CoverageSuite` is what the ``coverage`` command and the evaluator plugin use. Fitting
runs one forward+LRP pass for IDC (all its layers at once) and one activation pass for the
classic criteria; scoring runs a single forward pass that feeds both whenever the IDC layers
are among the criteria's layers (the default), else one extra pass for IDC.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import numpy as np

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.importance.activations import default_layer
from mlflow_di.importance.criteria import CRITERIA, ClassicCoverage, CriteriaReport
from mlflow_di.importance.idc import CoverageReport, ImportanceDrivenCoverage, fit_layers, score_layers

ALL_CRITERIA = ("idc", *CRITERIA)


def parse_criteria(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"idc,nc,dsc"`` (or a list) -> a checked tuple in canonical order."""
    names = [c.strip().lower() for c in (text.split(",") if isinstance(text, str) else text) if c.strip()]
    unknown = sorted(set(names) - set(ALL_CRITERIA))
    if unknown or not names:
        raise UserError(f"unknown criteria {unknown or '(none given)'}; choose from {','.join(ALL_CRITERIA)}")
    return tuple(c for c in ALL_CRITERIA if c in names)


@dataclasses.dataclass
class CoverageResult:
    """IDC per layer (``primary`` is the layer reported as ``idc``) and the classic criteria."""

    idc: dict[str, CoverageReport]
    primary: str | None
    criteria: CriteriaReport | None
    data: str

    def metrics(self) -> dict[str, float]:
        """Flat metrics: ``idc``, ``idc_covered``, ``idc_total``, ``idc.<layer>`` (several layers), ``nc``..."""
        values: dict[str, float] = {}
        if self.primary is not None:
            main = self.idc[self.primary]
            values.update(idc=main.idc, idc_covered=main.covered, idc_total=main.total)
            if len(self.idc) > 1:
                values.update({f"idc.{layer}": report.idc for layer, report in self.idc.items()})
        if self.criteria is not None:
            values.update(self.criteria.coverage)
        return values

    def summary(self) -> dict:
        """What ``--json-out`` holds: the metrics (fractions in [0, 1]) and the IDC facts per layer."""
        summary: dict = dict(self.metrics(), data=self.data)
        if self.primary is not None:
            main = self.idc[self.primary]
            summary.update(covered=main.covered, total=main.total, layer=main.layer,
                           important_neurons=list(main.important_neurons),
                           clusters_per_neuron=list(main.clusters_per_neuron))
            summary["layers"] = {
                layer: {"idc": r.idc, "covered": r.covered, "total": r.total,
                        "important_neurons": list(r.important_neurons),
                        "clusters_per_neuron": list(r.clusters_per_neuron)}
                for layer, r in self.idc.items()
            }
        return summary


class CoverageSuite:
    """Fit IDC (one or more layers) and the classic criteria on a training set; score test sets.

    ``layers``: None (the default subject layer: last hidden layer before the logits), ``"all"``
    (every hidden layer; a layer narrower than ``top_m`` uses all its neurons) or a list of names.
    ``criteria``: any of :data:`ALL_CRITERIA`. Other arguments go to
    :class:`~mlflow_di.importance.idc.ImportanceDrivenCoverage`.
    """

    def __init__(self, criteria: Sequence[str] = ALL_CRITERIA, layers: str | Sequence[str] | None = None,
                 top_m: int = 6, clusters: Sequence[int] = (2, 3, 4), rule: str = "epsilon",
                 only_correct: bool = True, seed: int = 0, reference_quirks: bool = False,
                 batch_size: int = 256, progress: bool = True):
        self.criteria = parse_criteria(criteria)
        self.layers = layers
        self.idc_params = dict(top_m=top_m, clusters=tuple(clusters), rule=rule, only_correct=only_correct, seed=seed,
                               reference_quirks=reference_quirks, batch_size=batch_size, progress=progress)
        self.classic = [c for c in self.criteria if c != "idc"]
        self.batch_size, self.progress = batch_size, progress
        self.idc_models_: dict[str, ImportanceDrivenCoverage] = {}
        self.classic_: ClassicCoverage | None = None
        self.primary_: str | None = None

    def fit(self, model, train: ImageSet) -> "CoverageSuite":
        """Importance analysis + quantisation (IDC) and the criteria's statistics from ``train``."""
        if "idc" in self.criteria:
            self.primary_ = default_layer(model.module)
            if self.layers is None:
                self.idc_models_ = {self.primary_: ImportanceDrivenCoverage(**self.idc_params).fit(model, train)}
            else:
                self.idc_models_ = fit_layers(model, train, self.layers, **self.idc_params)
                if self.primary_ not in self.idc_models_:
                    self.primary_ = next(iter(self.idc_models_))
        if self.classic:
            self.classic_ = ClassicCoverage(self.classic, batch_size=self.batch_size, progress=self.progress)
            self.classic_.fit(model, train)
        return self

    def score(self, model, test: ImageSet, accumulate: CoverageResult | None = None) -> CoverageResult:
        """All criteria on ``test``; with ``accumulate``, coverage of the earlier sets plus this one."""
        criteria_report, activations = None, {}
        if self.classic_ is not None:
            activations, predictions = self.classic_.collect(model, test)
            criteria_report = self.classic_.score_activations(activations, predictions, data_name=test.name)
            if accumulate is not None and accumulate.criteria is not None:
                criteria_report = accumulate.criteria.merge(criteria_report, name=f"{accumulate.data} + {test.name}")
        earlier = accumulate.idc if accumulate is not None else {}
        idc_reports = self._score_idc(test, activations, earlier)
        data = f"{accumulate.data} + {test.name}" if accumulate is not None else test.name
        return CoverageResult(idc_reports, self.primary_, criteria_report, data)

    def _score_idc(self, test: ImageSet, activations: dict, earlier: dict) -> dict[str, CoverageReport]:
        if not self.idc_models_:
            return {}
        if all(model.layer_ in activations for model in self.idc_models_.values()):  # reuse the criteria's pass
            return {layer: model.report(model.combinations_of_activations(activations[model.layer_]),
                                        accumulate=earlier.get(layer), data=test.name)
                    for layer, model in self.idc_models_.items()}
        return score_layers(self.idc_models_, test, accumulate=earlier)

    def important_neurons_table(self) -> list[dict]:
        """One row per important neuron of every IDC layer: rank, index, importance, clusters."""
        rows = []
        for layer, model in self.idc_models_.items():
            for rank, (neuron, centroids, silhouette) in enumerate(
                    zip(model.important_neurons_, model.centroids_, model.silhouettes_), start=1):
                rows.append({"layer": layer, "rank": rank, "neuron": int(neuron),
                             "importance": float(model.importance_[neuron]), "clusters": len(centroids),
                             "silhouette": float(silhouette),
                             "centroids": ", ".join(f"{c:.3g}" for c in centroids)})
        return rows

    def save(self, directory) -> pathlib.Path:
        """``idc_<layer>.json`` per layer, the criteria's statistics and ``suite.json``, in ``directory``."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = {}
        for layer, model in self.idc_models_.items():
            files[layer] = f"idc_{layer.replace('/', '_')}.json"
            model.save(directory / files[layer])
        if self.classic_ is not None:
            self.classic_.save(directory / "criteria")
        (directory / "suite.json").write_text(json.dumps(
            {"criteria": list(self.criteria), "primary": self.primary_, "idc_files": files}, indent=2))
        return directory

    @classmethod
    def load(cls, directory, model) -> "CoverageSuite":
        """A fitted suite saved by :meth:`save`, attached to ``model`` (scores without training data)."""
        directory = pathlib.Path(directory)
        if not (directory / "suite.json").is_file():
            raise UserError(f"'{directory}' holds no saved coverage model (suite.json missing)")
        saved = json.loads((directory / "suite.json").read_text())
        suite = cls(saved["criteria"], progress=False)
        suite.primary_ = saved["primary"]
        suite.idc_models_ = {layer: ImportanceDrivenCoverage.load(directory / file, model)
                             for layer, file in saved["idc_files"].items()}
        if suite.classic:
            suite.classic_ = ClassicCoverage.load(directory / "criteria", model=model, progress=False)
        return suite


def growth_curve(report: CoverageReport) -> np.ndarray:
    """Covered fraction after each input of the report's test set."""
    return np.asarray(report.growth, dtype=np.float64) / report.total
