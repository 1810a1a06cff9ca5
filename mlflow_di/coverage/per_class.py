"""IDC per class: importance analysis, clustering and coverage of each class on its own.

One IDC over all classes says how much of the model's decisive behaviour a test set exercises;
IDC per class says *which classes'* decision logic it exercises least. For class c, the analysis
inputs and the test inputs are those labelled c, and an :class:`ImportanceDrivenCoverage` with
the same layer, ``top_m``, candidate cluster counts and LRP rule is fitted and scored on them.
This is also the protocol of the IDC paper's Table 3 scripts (one digit at a time, averaged
over the ten digits; see ../shared/notes/deepimportance.md).

Cost: one forward+LRP pass over all analysis inputs and one forward pass over all test inputs,
whatever the number of classes. LRP relevance is computed input by input, so each class is
fitted from its rows of the one pass (:meth:`ImportanceDrivenCoverage.fit_relevance`), which
equals fitting on that class alone.

A class is skipped, with the reason, never with an error: when it has fewer analysis inputs
than clustering needs (the largest candidate cluster count, counting only correctly classified
inputs unless ``only_correct`` is off; see :func:`~mlflow_di.coverage.idc.too_few_to_cluster`),
or when the test set holds none of its inputs.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
from sklearn.base import BaseEstimator, clone

from mlflow_di.coverage.activations import PreprocessedImages, collect_activations, default_layer
from mlflow_di.coverage.base import check_fitted, check_saved, stamped
from mlflow_di.coverage.idc import ImportanceDrivenCoverage, too_few_to_cluster
from mlflow_di.coverage.relevance import layer_relevance
from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.results_json import JsonRoundTrip

KIND = "idc-per-class"
#: Skip reasons that do not come from the clustering rule.
NO_TEST_INPUTS = "no test inputs of this class"
NO_ANALYSIS_INPUTS = "no analysis inputs of this class"
#: How many of the least-covered classes a report points out.
LEAST_COVERED = 3


@dataclasses.dataclass
class ClassCoverage(JsonRoundTrip):
    """IDC of one class: ``label``; ``analysis_inputs`` (those analysed: the correctly classified
    ones unless ``only_correct`` is off); ``test_inputs``; ``idc``, ``covered`` and ``total``
    combinations, ``important_neurons`` and ``clusters_per_neuron`` when scored; ``skipped``, the
    reason, when not (then ``idc``, ``covered`` and ``total`` are None)."""

    label: int
    analysis_inputs: int
    test_inputs: int
    idc: float | None = None
    covered: int | None = None
    total: int | None = None
    important_neurons: list[int] = dataclasses.field(default_factory=list)
    clusters_per_neuron: list[int] = dataclasses.field(default_factory=list)
    skipped: str | None = None

    @property
    def scored(self) -> bool:
        return self.skipped is None


@dataclasses.dataclass
class PerClassResult(JsonRoundTrip):
    """IDC of each class of one test set (``data``), fitted on ``analysis_data``, for subject ``layer``.

    Saved (``to_dict``/``to_json``) with the coverage files' ``format``/``format_version`` stamp
    (:mod:`mlflow_di.coverage.base`), so a reader of another version gets a one-line error.
    """

    layer: str
    top_m: int
    analysis_data: str
    data: str
    classes: list[ClassCoverage]

    JSON_DUMPS: ClassVar[dict] = {"indent": 1}

    @property
    def scored(self) -> list[ClassCoverage]:
        return [c for c in self.classes if c.scored]

    @property
    def skipped(self) -> list[ClassCoverage]:
        return [c for c in self.classes if not c.scored]

    @property
    def mean_idc(self) -> float | None:
        """Mean IDC over the scored classes (each class weighs the same); None when none was scored."""
        scored = self.scored
        return float(np.mean([c.idc for c in scored])) if scored else None

    def least_covered(self, count: int = LEAST_COVERED) -> list[ClassCoverage]:
        """The ``count`` scored classes of lowest IDC, lowest first (ties: the smaller label first)."""
        return sorted(self.scored, key=lambda c: (c.idc, c.label))[:count]

    def metrics(self) -> dict[str, float]:
        """``idc_per_class_mean`` (when a class was scored) and ``idc_class_<label>`` per scored class."""
        values = {f"idc_class_{c.label}": c.idc for c in self.scored}
        if self.scored:
            values = {"idc_per_class_mean": self.mean_idc, **values}
        return values

    def table(self) -> list[dict]:
        """One row per class (same keys in every row): counts, IDC and combinations, or why it was skipped."""
        return [{"class": c.label, "analysis_inputs": c.analysis_inputs, "test_inputs": c.test_inputs,
                 "idc": c.idc, "covered": c.covered, "total": c.total, "skipped": c.skipped or ""}
                for c in self.classes]

    def to_dict(self) -> dict:
        return stamped(KIND, super().to_dict())

    @classmethod
    def from_dict(cls, values: dict) -> "PerClassResult":
        check_saved(values, KIND, "per-class IDC result")
        return super().from_dict({k: v for k, v in values.items() if k not in ("format", "format_version")})


class PerClassCoverage(BaseEstimator):
    """IDC fitted and scored separately for each class: ``fit(model, analysis)``, ``score(test)``.

    A scikit-learn meta-estimator, like ``OneVsRestClassifier``: ``idc`` is the single-layer
    :class:`ImportanceDrivenCoverage` (unfitted) whose settings every class uses (None: its
    defaults); each class gets a clone of it. ``progress`` shows the relevance and activation
    passes.

    Fitted attributes: ``layer_``, ``classes_`` (labels seen in the analysis set, ascending),
    ``fitted_classes_`` ({label: fitted ImportanceDrivenCoverage} of the classes that could be
    clustered), ``analysis_counts_`` ({label: analysed inputs}), ``skipped_`` ({label: reason}
    of the classes that could not), ``analysis_data_``, ``model_``, ``top_m_`` and
    ``batch_size_`` (the IDC's settings used).
    """

    def __init__(self, idc: ImportanceDrivenCoverage | None = None, progress: bool = True):
        self.idc = idc
        self.progress = progress

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "fitted_classes_")

    def class_estimator(self) -> ImportanceDrivenCoverage:
        """A fresh, unfitted copy of the single-layer IDC every class is fitted with."""
        template = ImportanceDrivenCoverage() if self.idc is None else clone(self.idc)
        if not isinstance(template, ImportanceDrivenCoverage):
            raise UserError(f"per-class IDC needs an ImportanceDrivenCoverage, got {type(template).__name__}")
        if template.multi_layer:
            raise UserError(f"per-class IDC takes one layer name, got {template.layers!r}")
        return template.set_params(progress=False, resamples=0)  # per-class figures are read, not judged: no interval

    def fit(self, model, images: ImageSet) -> "PerClassCoverage":
        """One relevance pass over ``images``, then importance analysis and clustering per label."""
        template = self.class_estimator()
        ks = template.check_params()
        if not isinstance(images, ImageSet):
            raise UserError("per-class IDC is fitted on an ImageSet (raw images and their labels)")
        layer = template.layers or default_layer(model.module)
        attribution = layer_relevance(model.module, PreprocessedImages(images.images, model.preprocessing), [layer],
                                      rule=template.rule, epsilon=template.epsilon, batch_size=template.batch_size,
                                      progress=self.progress)
        correct = attribution.predictions == images.labels
        self.classes_ = [int(c) for c in np.unique(images.labels)]
        self.fitted_classes_, self.analysis_counts_, self.skipped_ = {}, {}, {}
        for label in self.classes_:
            members = images.labels == label
            analysed = int((members & correct).sum()) if template.only_correct else int(members.sum())
            self.analysis_counts_[label] = analysed
            shortfall = too_few_to_cluster(analysed, ks, template.only_correct)
            if shortfall:
                self.skipped_[label] = shortfall
                continue
            subset = images.subset(members, f"{images.name} (class {label})")
            self.fitted_classes_[label] = clone(template).fit_relevance(model, subset, attribution.subset(members))
        self.layer_, self.analysis_data_, self.model_ = layer, images.name, model
        self.top_m_, self.batch_size_ = template.top_m, template.batch_size
        return self

    def score(self, images: ImageSet) -> PerClassResult:
        """IDC of each class's test inputs (by label) under that class's fitted IDC; one forward pass."""
        check_fitted(self, "fit(model, images)")
        if not isinstance(images, ImageSet):
            raise UserError("per-class IDC scores an ImageSet (raw images and their labels)")
        activations = collect_activations(
            self.model_.module, PreprocessedImages(images.images, self.model_.preprocessing), [self.layer_],
            batch_size=self.batch_size_, progress=self.progress)[self.layer_]
        labels = sorted(set(self.classes_) | {int(c) for c in np.unique(images.labels)})
        return PerClassResult(
            layer=self.layer_, top_m=self._effective_top_m(), analysis_data=self.analysis_data_, data=images.name,
            classes=[self._score_class(label, activations[images.labels == label], images.name) for label in labels])

    def _score_class(self, label: int, activations: np.ndarray, data: str) -> ClassCoverage:
        analysed = self.analysis_counts_.get(label, 0)
        skipped = self.skipped_.get(label) or (None if label in self.fitted_classes_ else NO_ANALYSIS_INPUTS)
        if skipped is None and len(activations) == 0:
            skipped = NO_TEST_INPUTS
        if skipped is not None:
            return ClassCoverage(label, analysed, len(activations), skipped=skipped)
        report = self.fitted_classes_[label].score_activations({self.layer_: activations}, data=data)
        return ClassCoverage(label, analysed, len(activations), idc=report.idc, covered=report.covered,
                             total=report.total, important_neurons=list(report.important_neurons),
                             clusters_per_neuron=list(report.clusters_per_neuron))

    def _effective_top_m(self) -> int:
        """The number of important neurons per class (below the setting where the layer is narrower)."""
        fitted = next(iter(self.fitted_classes_.values()), None)
        return int(fitted.top_m_) if fitted is not None else int(self.top_m_)
