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
import collections.abc
from typing import Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator

from mlflow_di.coverage.activations import default_layer
from mlflow_di.coverage.base import check_fitted, images_of, parse_saved, stamped
from mlflow_di.coverage.criteria import CRITERIA, CRITERION, ClassicCoverage, CriteriaReport, coverage_device
from mlflow_di.coverage.idc import CoverageReport, ImportanceDrivenCoverage
from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError

#: IDC and the built-in classic criteria: the suite's default
ALL_CRITERIA = ("idc", *CRITERIA)
KIND = "coverage-suite"


class _Known(collections.abc.Sequence):
    """IDC and every classic criterion's record, registered ones included (what ``--criteria`` accepts)."""

    def __getitem__(self, index):
        return ("idc", *CRITERION)[index]

    def __len__(self) -> int:
        return 1 + len(CRITERION)


KNOWN_CRITERIA = _Known()
SUITE_FILE, IDC_FILE, CRITERIA_DIR = "suite.json", "idc.json", "criteria"


def parse_criteria(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"idc,nc,dsc"`` (or a list) -> a checked tuple in canonical order."""
    names = [c.strip().lower() for c in (text.split(",") if isinstance(text, str) else text) if c.strip()]
    unknown = sorted(set(names) - set(KNOWN_CRITERIA))
    if unknown or not names:
        raise UserError(f"unknown criteria {unknown or '(none given)'}; choose from {','.join(KNOWN_CRITERIA)}")
    return tuple(c for c in KNOWN_CRITERIA if c in names)


@dataclasses.dataclass
class CoverageResult:
    """IDC per layer (``primary`` is the layer reported as ``idc``) and the classic criteria."""

    idc: dict[str, CoverageReport]
    primary: str | None
    criteria: CriteriaReport | None
    data: str
    #: the analysis inputs IDC was fitted on (the sample size of reachable IDC's interval)
    n_analysis: int = 0

    def metrics(self) -> dict[str, float]:
        """Flat metrics: ``idc`` (the paper's: covered / all combinations), ``idc_covered``, ``idc_total``;
        ``idc_reachable`` (covered / the combinations the analysis inputs realise: what a gate judges) with
        ``idc_reachable_low``/``_high``/``_n`` (its 95% interval over analysis-data resamples, n the analysis
        inputs) and ``idc_analysis`` (the analysis inputs' own IDC); ``idc.<layer>`` (several layers), ``nc``..."""
        values: dict[str, float] = {}
        if self.primary is not None:
            main = self.idc[self.primary]
            values.update(idc=main.idc, idc_covered=main.covered, idc_total=main.total)
            if main.reachable:
                values.update(idc_reachable=main.idc_reachable, idc_reachable_covered=main.covered_reachable,
                              idc_reachable_total=main.reachable, idc_analysis=main.analysis_idc)
                spread = main.reachable_interval(self.n_analysis)
                if spread is not None:
                    values.update(idc_reachable_low=spread.low, idc_reachable_high=spread.high,
                                  idc_reachable_n=spread.n)
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
                        "clusters_per_neuron": list(r.clusters_per_neuron),
                        **({"reachable": r.reachable, "covered_reachable": r.covered_reachable,
                            "idc_reachable": r.idc_reachable, "idc_analysis": r.analysis_idc} if r.reachable else {})}
                for layer, r in self.idc.items()
            }
        return summary


class CoverageSuite(BaseEstimator):
    """Fit IDC (one or more layers) and the classic criteria on a training set; score test sets.

    ``criteria``: any of :data:`ALL_CRITERIA` (a list or ``"idc,nc"``). ``layers``: the IDC
    layers, None (the default subject layer: last hidden layer before the logits), ``"all"``
    (every hidden layer; a layer narrower than ``top_m`` uses all its neurons) or a list of names.
    ``criterion_settings``: registered criteria's own settings, ``{field: value}``, for
    :class:`~mlflow_di.coverage.criteria.ClassicCoverage`. The other arguments go to
    :class:`~mlflow_di.coverage.idc.ImportanceDrivenCoverage`; ``batch_size`` and ``progress`` to
    ClassicCoverage too.

    Fitted attributes: ``criteria_`` (the checked criteria, canonical order), ``idc_``
    (a multi-layer ImportanceDrivenCoverage, or None without ``idc``), ``classic_``
    (ClassicCoverage, or None without classic criteria), ``primary_`` (the IDC layer reported
    as ``idc``), ``model_``.
    """

    def __init__(self, criteria: str | Sequence[str] = ALL_CRITERIA, layers: str | Sequence[str] | None = None,
                 top_m: int = 6, clusters: Sequence[int] = (2, 3, 4), rule: str = "epsilon",
                 only_correct: bool = True, seed: int = 0, reference_quirks: bool = False,
                 criterion_settings: Mapping | None = None, batch_size: int = 256, progress: bool = True,
                 resamples: int = 0):
        self.criteria = criteria
        self.layers = layers
        self.top_m = top_m
        self.clusters = clusters
        self.rule = rule
        self.only_correct = only_correct
        self.seed = seed
        self.reference_quirks = reference_quirks
        self.criterion_settings = criterion_settings
        self.batch_size = batch_size
        self.progress = progress
        self.resamples = resamples

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "criteria_")

    def fit(self, model, images: ImageSet, passes=None) -> "CoverageSuite":
        """Importance analysis + quantisation (IDC) and the criteria's statistics from ``images``.

        ``passes``: None runs the passes over the images here; a passes executor
        (:class:`~mlflow_di.coverage.partials.LocalPasses`,
        :class:`~mlflow_di.coverage.distributed.RayPasses`) runs them batch by batch and this
        process merges the partial results into the same fitted suite (clustering stays here).
        """
        if passes is not None:
            return self._fit_with(passes, model, images)
        criteria = parse_criteria(self.criteria)
        idc = classic = primary = None
        if "idc" in criteria:
            default = default_layer(model.module)
            layers = [default] if self.layers is None else self.layers
            idc = ImportanceDrivenCoverage(
                layers=layers, top_m=self.top_m, clusters=self.clusters, rule=self.rule,
                only_correct=self.only_correct, seed=self.seed, reference_quirks=self.reference_quirks,
                batch_size=self.batch_size, progress=self.progress, resamples=self.resamples).fit(model, images)
            primary = default if default in idc.layers_ else idc.layers_[0]
        names = [c for c in criteria if c != "idc"]
        if names:
            classic = ClassicCoverage(names, criterion_settings=self.criterion_settings, batch_size=self.batch_size,
                                      progress=self.progress).fit(model, images)
        self.criteria_, self.idc_, self.classic_, self.primary_, self.model_ = criteria, idc, classic, primary, model
        return self

    def score(self, images: ImageSet, accumulate: CoverageResult | None = None, passes=None) -> CoverageResult:
        """All criteria on ``images``; with ``accumulate``, coverage of the earlier sets plus this one.

        ``passes``: as for :meth:`fit`; the result is the same.
        """
        check_fitted(self, "fit(model, images) or CoverageSuite.load(directory, model)")
        if passes is not None:
            return self._score_with(passes, images, accumulate)
        _, name = images_of(images)
        criteria_report, activations = None, {}
        if self.classic_ is not None:
            idc_layers = self.idc_.layers_ if self.idc_ is not None else ()
            criteria_report, activations = self.classic_.score_pass(images, keep_layers=idc_layers)
            if accumulate is not None and accumulate.criteria is not None:
                criteria_report = accumulate.criteria.merge(criteria_report, name=f"{accumulate.data} + {name}")
        idc_reports = {}
        if self.idc_ is not None:
            earlier = accumulate.idc if accumulate is not None else None
            if all(layer in activations for layer in self.idc_.layers_):  # reuse the criteria's pass
                idc_reports = self.idc_.score_activations(activations, accumulate=earlier, data=name)
            else:
                idc_reports = self.idc_.score(images, accumulate=earlier)
        data = f"{accumulate.data} + {name}" if accumulate is not None else name
        return CoverageResult(idc_reports, self.primary_, criteria_report, data, self._n_analysis())

    def _n_analysis(self) -> int:
        """The analysis inputs of the primary IDC layer (0 without IDC)."""
        return self.idc_.fitted_layers_[self.primary_].n_analysis if self.idc_ is not None else 0

    # ------------------------------------------------------------- passes spread over batches/workers
    def _estimators(self, model):
        """The unfitted IDC and classic estimators of these settings, their layers resolved on ``model``."""
        criteria = parse_criteria(self.criteria)
        idc = classic = None
        if "idc" in criteria:
            default = default_layer(model.module)
            idc = ImportanceDrivenCoverage(
                layers=[default] if self.layers is None else self.layers, top_m=self.top_m, clusters=self.clusters,
                rule=self.rule, only_correct=self.only_correct, seed=self.seed,
                reference_quirks=self.reference_quirks, batch_size=self.batch_size, progress=self.progress,
                resamples=self.resamples)
        names = [c for c in criteria if c != "idc"]
        if names:
            classic = ClassicCoverage(names, criterion_settings=self.criterion_settings, batch_size=self.batch_size,
                                      progress=self.progress)
            classic._check_settings()
            classic.resolve_layers(model.module)
        return criteria, idc, classic

    def _fit_with(self, passes, model, images: ImageSet) -> "CoverageSuite":
        """:meth:`fit` with the passes run by ``passes`` (see :mod:`mlflow_di.coverage.partials`)."""
        from mlflow_di.coverage.activations import PreprocessedImages, collect_activations
        from mlflow_di.coverage.partials import (FitJob, classic_settings, merge_fit, neuron_columns, read_matrix,
                                                 relevance_prefix)

        criteria, idc, classic = self._estimators(model)
        layers: list[str] = []
        if idc is not None:
            idc.check_params()
            if not isinstance(images, ImageSet):
                raise UserError("IDC is fitted on an ImageSet (raw images and their labels)")
            layers, clamp = idc._resolve_layers(model.module)
            probe = PreprocessedImages(images.images[0:1], model.preprocessing)
            idc._check_widths({layer: values.shape[1] for layer, values in
                               collect_activations(model.module, probe, layers).items()}, clamp)
        job = FitJob(layers, rule=self.rule, only_correct=self.only_correct,
                     classic=None if classic is None else classic_settings(classic),
                     relevance_traces=idc is not None and idc.resamples > 0)
        with passes.run(job, model, images, self.batch_size) as output:
            merged = merge_fit(output.partials)
            if idc is not None:
                n_analysis = sum(merged.n_analysis_by_batch)

                def analysed_columns(layer, neurons):  # only the important neurons' columns are read
                    return read_matrix(output.traces / "idc", merged.starts, n_analysis, neuron_columns(layer, neurons))

                def analysed_relevance(layer):  # every neuron's: the resamples choose their own important ones
                    return read_matrix(output.traces / "idc", merged.starts, n_analysis, neuron_columns(
                        relevance_prefix(layer), range(len(merged.importance[layer]))))

                idc.fit_importance(model, images, merged.importance, n_analysis, analysed_columns, analysed_relevance)
            if classic is not None:
                traces = predictions = None
                if classic.sa_layers_:
                    traces, predictions = _sa_traces(output.traces / "sa", merged.starts, merged.rows)
                classic.fit_statistics(merged.layer_sizes, merged.low, merged.high, traces, predictions, merged.rows,
                                       train_name=images_of(images)[1], device=coverage_device(model))
                classic.model_ = model
        primary = None
        if idc is not None:
            default = default_layer(model.module)
            primary = default if default in idc.layers_ else idc.layers_[0]
        self.criteria_, self.idc_, self.classic_, self.primary_, self.model_ = criteria, idc, classic, primary, model
        return self

    def score_all(self, sets: Sequence[ImageSet], passes=None) -> list[CoverageResult]:
        """Each set's result accumulated onto the ones before it (as :meth:`score` with ``accumulate``);
        with ``passes``, all sets go through one pass (on Ray: one actor pool for all of them)."""
        check_fitted(self, "fit(model, images) or CoverageSuite.load(directory, model)")
        results: list[CoverageResult] = []
        if passes is None:
            for images in sets:
                results.append(self.score(images, accumulate=results[-1] if results else None))
            return results
        with passes.run_many(self._score_job(), self.model_, list(sets), self.batch_size) as outputs:
            for images, output in zip(sets, outputs):
                results.append(self._score_output(output, images, results[-1] if results else None))
        return results

    def _score_job(self):
        from mlflow_di.coverage.partials import ScoreJob, classic_settings

        classic_job = idc_job = None
        if self.classic_ is not None:
            classic_job = dict(classic_settings(self.classic_), low=self.classic_.low_, high=self.classic_.high_,
                               layer_sizes=list(self.classic_.layer_sizes_))
        if self.idc_ is not None:
            idc_job = {"layers": dict(self.idc_.fitted_layers_), "preprocessing": self.idc_.preprocessing_}
        return ScoreJob(classic_job, idc_job)

    def _score_with(self, passes, images: ImageSet, accumulate: CoverageResult | None) -> CoverageResult:
        """:meth:`score` with the pass run by ``passes``."""
        with passes.run(self._score_job(), self.model_, images, self.batch_size) as output:
            return self._score_output(output, images, accumulate)

    def _score_output(self, output, images: ImageSet, accumulate: CoverageResult | None) -> CoverageResult:
        """A scoring pass's partials merged into the result: cells united, IDC ids per input, SA traces read back."""
        from mlflow_di.coverage.partials import merge_score

        _, name = images_of(images)
        merged = merge_score(output.partials)
        traces = predictions = None
        if self.classic_ is not None and self.classic_.sa_layers_:
            traces, predictions = _sa_traces(output.traces / "sa", merged.starts, merged.rows)
        criteria_report = None
        if self.classic_ is not None:
            criteria_report = self.classic_.score_cells(merged.cells, traces, predictions, merged.rows, data_name=name)
            if accumulate is not None and accumulate.criteria is not None:
                criteria_report = accumulate.criteria.merge(criteria_report, name=f"{accumulate.data} + {name}")
        idc_reports = {}
        if self.idc_ is not None:
            earlier = (accumulate.idc if accumulate is not None else None) or {}
            idc_reports = {layer: fitted.report(merged.combinations[layer], accumulate=earlier.get(layer), data=name,
                                                resampled=merged.resampled.get(layer))
                           for layer, fitted in self.idc_.fitted_layers_.items()}
        data = f"{accumulate.data} + {name}" if accumulate is not None else name
        return CoverageResult(idc_reports, self.primary_, criteria_report, data, self._n_analysis())

    def important_neurons_table(self) -> list[dict]:
        """One row per important neuron of every IDC layer: rank, index, importance, clusters."""
        check_fitted(self)
        return self.idc_.important_neurons_table() if self.idc_ is not None else []

    def save(self, directory) -> pathlib.Path:
        """``suite.json`` (settings, primary layer), ``idc.json`` and the criteria's statistics, in ``directory``."""
        check_fitted(self)
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.idc_ is not None:
            self.idc_.save(directory / IDC_FILE)
        if self.classic_ is not None:
            self.classic_.save(directory / CRITERIA_DIR)
        params = self.get_params()
        params.update(criteria=list(self.criteria_), clusters=list(self.clusters))
        if params["layers"] is not None and not isinstance(params["layers"], str):
            params["layers"] = list(params["layers"])
        (directory / SUITE_FILE).write_text(json.dumps(stamped(KIND, {"params": params, "primary": self.primary_}),
                                                       indent=2))
        return directory

    @classmethod
    def load(cls, directory, model) -> "CoverageSuite":
        """A fitted suite saved by :meth:`save`, attached to ``model`` (scores without training data)."""
        directory = pathlib.Path(directory)
        if not (directory / SUITE_FILE).is_file():
            raise UserError(f"'{directory}' holds no saved coverage model ({SUITE_FILE} missing)")
        saved = parse_saved((directory / SUITE_FILE).read_text(), KIND, f"'{directory / SUITE_FILE}'")
        suite = cls(**dict(saved["params"], progress=False))
        suite.criteria_ = parse_criteria(suite.criteria)
        suite.primary_ = saved["primary"]
        suite.idc_ = ImportanceDrivenCoverage.load(directory / IDC_FILE, model) if "idc" in suite.criteria_ else None
        if suite.idc_ is not None:
            suite.idc_.progress = False
        suite.classic_ = None
        if any(c != "idc" for c in suite.criteria_):
            suite.classic_ = ClassicCoverage.load(directory / CRITERIA_DIR, model=model, progress=False)
        suite.model_ = model
        return suite


def _sa_traces(folder, starts, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(SA traces (rows, neurons) float32, predicted classes) from a pass's trace files (``sa#j``, ``prediction``)."""
    import pyarrow.parquet as pq

    from mlflow_di.coverage.partials import neuron_columns, read_matrix

    schema = pq.read_schema(folder / f"{starts[0]:012d}.parquet")
    names = neuron_columns("sa", range(sum(1 for name in schema.names if name.startswith("sa#"))))
    predictions = read_matrix(folder, starts, rows, ["prediction"], dtype=np.int64)[:, 0]
    return read_matrix(folder, starts, rows, names), predictions


def growth_curve(report: CoverageReport) -> np.ndarray:
    """Covered fraction after each input of the report's test set."""
    return np.asarray(report.growth, dtype=np.float64) / report.total
