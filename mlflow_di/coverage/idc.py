"""Importance-Driven Coverage (IDC, Gerasimou et al., ICSE 2020) as a scikit-learn estimator.

``fit`` (importance analysis + quantisation, Alg. 1-2 of the paper): over the analysis inputs
(training inputs the model classifies correctly), LRP relevance of every neuron of a subject
layer is summed (signed, as in the reference code); the ``top_m`` neurons with the highest sum are
the important ones; each one's activations are clustered by 1-D k-means with the k in ``clusters``
of best Silhouette. ``score`` (Eq. 5-6): each test input maps every important neuron to its nearest
centroid; the tuple of centroid indices is a *combination*; IDC = covered combinations / all
combinations (the product of the neurons' cluster counts).

That denominator is the paper's, and it is not comparable between models: the Silhouette choice makes
it vary several-fold between trainings of one architecture, and most combinations are realised by no
input at all (the training data of the demo's CNN reach 26-64% of theirs). So each report also says
which combinations the analysis inputs themselves realise (*reachable*), and the figure a gate
judges is *reachable IDC*: the share of those the test data cover. Its 95% interval comes from
refitting importance and clusters on ``resamples`` bootstrap resamples of the analysis inputs (the
important neurons chosen again from the resample's summed relevance, then their clusters), re-reading
the combinations all analysis inputs realise and those the test data cover under each refit, and
taking the percentiles of the refits' reachable IDC.

One estimator covers one layer or several: all of them come from a single forward+LRP pass when
fitting and a single forward pass when scoring. The fitted model is plain numbers (per layer:
neurons, importance, centroids; the preprocessing) and saves as JSON; a reloaded model needs only
the PyTorch module attached to score new data.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
from typing import Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator
import torch
from torch import nn
from mlflow_di.progress import progress_bar as tqdm

from mlflow_di.coverage.activations import (
    PreprocessedImages,
    check_layers,
    collect_activations,
    default_layer,
    hidden_layers,
)
from mlflow_di.coverage.base import check_fitted, images_of, parse_saved, stamped
from mlflow_di.coverage.partials import exact_column_sums
from mlflow_di.coverage.clustering import check_candidates, choose_clusters, nearest_centroid
from mlflow_di.coverage.relevance import RULES, LayerRelevance, layer_relevance
from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.models.preprocessing import Preprocessing
from mlflow_di.models.torch_model import TorchModel

KIND = "idc"
#: Combinations are numbered as int64; beyond this many, IDC is meaningless anyway (never coverable).
MAX_COMBINATIONS = 2**62
#: Analysis-data resamples behind reachable IDC's interval in ``mlflow-di coverage``: the 2.5% and 97.5%
#: percentiles of 50 refits (benchmarks/bench_idc_interval.py compares them with 200 on the demo's CNNs).
RESAMPLES = 50


def module_fingerprint(module: nn.Module) -> str:
    """SHA-256 of a module's parameters and buffers (names, shapes, values): which weights a coverage model fits.

    The tensors of a GPU module come to the host in one copy (a copy per tensor waited for the GPU
    each time: ResNet-18 has 122); the bytes hashed are the same on every device.
    """
    digest = hashlib.sha256()
    tensors = {name: tensor.detach().contiguous() for name, tensor in module.state_dict().items()}
    for name, raw in _host_bytes(tensors).items():
        dtype = torch.empty(0, dtype=tensors[name].dtype).numpy().dtype
        digest.update(f"{name}:{dtype}:{tuple(tensors[name].shape)};".encode())
        digest.update(raw)
    return digest.hexdigest()


def _host_bytes(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Each contiguous tensor's bytes as a uint8 array on the host, those of a device in one copy."""
    raw = {name: tensor.reshape(-1).view(torch.uint8) for name, tensor in tensors.items()}
    by_device: dict = {}
    for name, flat in raw.items():
        by_device.setdefault(flat.device, []).append(name)
    out = {}
    for device, names in by_device.items():
        if device.type == "cpu":
            out.update({name: raw[name].numpy() for name in names})
            continue
        joined = torch.cat([raw[name] for name in names]).cpu().numpy()
        offsets = np.cumsum([0, *(raw[name].numel() for name in names)])
        out.update({name: joined[start:stop] for name, start, stop in zip(names, offsets[:-1], offsets[1:])})
    return {name: out[name] for name in tensors}


@dataclasses.dataclass
class CoverageReport:
    """IDC of one test set (optionally on top of earlier sets): what was covered, and by which inputs.

    ``combination[i]`` is input i's combination id: the mixed-radix number whose digit j is the
    index of the centroid nearest to important neuron j (neuron 0 the least significant digit).
    ``contributed_new[i]`` says whether input i covered a combination not covered before it;
    ``growth[i]`` is the number of covered combinations after input i (counting earlier sets).
    """

    idc: float
    covered: int
    total: int
    layer: str
    important_neurons: list[int]
    clusters_per_neuron: list[int]
    combination: np.ndarray
    contributed_new: np.ndarray
    growth: np.ndarray
    covered_combinations: list[int]
    data: str = ""
    covered_before: int = 0
    #: combinations the analysis inputs realise (0: unknown, a coverage model saved before they were recorded)
    reachable: int = 0
    #: of those, the ones covered (counting earlier sets)
    covered_reachable: int = 0
    #: per resample of the analysis inputs: the reachable combinations covered, and how many are reachable
    resampled_covered: list = dataclasses.field(default_factory=list)
    resampled_reachable: list = dataclasses.field(default_factory=list)

    @property
    def n_inputs(self) -> int:
        return len(self.combination)

    @property
    def idc_reachable(self) -> float | None:
        """Reachable IDC: the share of the combinations the analysis inputs realise that are covered (None unknown)."""
        return self.covered_reachable / self.reachable if self.reachable else None

    @property
    def analysis_idc(self) -> float | None:
        """The analysis inputs' own IDC: the share of all combinations they realise (None unknown)."""
        return self.reachable / self.total if self.reachable else None

    def reachable_interval(self, n_analysis: int = 0):
        """The 95% percentile interval of reachable IDC over the analysis-data resamples (None without them),
        an :class:`~mlflow_di.intervals.Interval` whose ``n`` is ``n_analysis``."""
        from mlflow_di.intervals import COVERAGE_BOOTSTRAP, percentile

        if not self.resampled_covered:
            return None
        figures = [len(covered) / reachable for covered, reachable in zip(self.resampled_covered, self.resampled_reachable)]
        return percentile(figures, n_analysis, f"{COVERAGE_BOOTSTRAP} ({len(figures)} resamples)")

    def combination_clusters(self, combination_id: int) -> list[int]:
        """The centroid index of each important neuron in combination ``combination_id``."""
        digits = []
        for k in self.clusters_per_neuron:
            combination_id, digit = divmod(int(combination_id), k)
            digits.append(digit)
        return digits

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["combination"] = self.combination.tolist()
        values["contributed_new"] = self.contributed_new.tolist()
        values["growth"] = self.growth.tolist()
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "CoverageReport":
        values = dict(values)
        values["combination"] = np.asarray(values["combination"], dtype=np.int64)
        values["contributed_new"] = np.asarray(values["contributed_new"], dtype=bool)
        values["growth"] = np.asarray(values["growth"], dtype=np.int64)
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "CoverageReport":
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass
class LayerCoverage:
    """IDC's fitted state for one layer: its important neurons and their clusters.

    ``important_neurons``: indices in the layer's neuron order, most important first;
    ``importance``: summed relevance of every neuron of the layer; ``centroids``: an ascending
    array per important neuron; ``silhouettes``: the chosen clustering's Silhouette per neuron;
    ``top_m``: number of important neurons (below the setting when the layer is narrower);
    ``n_analysis``: number of analysis inputs; ``reachable``: the combination ids the analysis inputs
    realise (None for a model saved before it was recorded); ``resampled_neurons`` /
    ``resampled_centroids`` / ``resampled_reachable``: per bootstrap resample of the analysis inputs,
    the important neurons and centroids refitted on it and the combinations all analysis inputs
    realise under them (the interval of reachable IDC).
    """

    layer: str
    top_m: int
    important_neurons: np.ndarray
    importance: np.ndarray
    centroids: list[np.ndarray]
    silhouettes: np.ndarray
    n_analysis: int
    reachable: np.ndarray | None = None
    resampled_neurons: list[np.ndarray] = dataclasses.field(default_factory=list)
    resampled_centroids: list[list[np.ndarray]] = dataclasses.field(default_factory=list)
    resampled_reachable: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def clusters_per_neuron(self) -> list[int]:
        return [len(c) for c in self.centroids]

    @property
    def total_combinations(self) -> int:
        return math.prod(self.clusters_per_neuron)

    def combinations(self, activations: np.ndarray) -> np.ndarray:
        """Combination ids from the layer's (N, neurons) activations: nearest centroid per neuron."""
        return combination_ids(activations[:, self.important_neurons], self.centroids)

    def resampled_combinations(self, activations: np.ndarray) -> np.ndarray:
        """(resamples, N) combination ids of the layer's (N, neurons) activations under each resample's centroids."""
        if not self.resampled_centroids:
            return np.zeros((0, len(activations)), np.int64)
        return np.stack([combination_ids(activations[:, neurons], centroids)
                         for neurons, centroids in zip(self.resampled_neurons, self.resampled_centroids)])

    def report(self, ids: np.ndarray, accumulate: CoverageReport | None = None, data: str = "",
               resampled: np.ndarray | None = None) -> CoverageReport:
        """The :class:`CoverageReport` of given combination ids, optionally on top of ``accumulate``;
        ``resampled``: the same inputs' ids under each resample (:meth:`resampled_combinations`)."""
        before = np.zeros(0, dtype=np.int64)
        if accumulate is not None:
            self._check_compatible(accumulate)
            before = np.asarray(accumulate.covered_combinations, dtype=np.int64)
        unique, first = np.unique(ids, return_index=True)
        is_new = ~np.isin(unique, before)
        contributed = np.zeros(len(ids), dtype=bool)
        contributed[first[is_new]] = True
        covered = np.union1d(before, unique)
        total = self.total_combinations
        reachable = self.reachable if self.reachable is not None else np.zeros(0, np.int64)
        return CoverageReport(
            idc=len(covered) / total, covered=int(len(covered)), total=total,
            layer=self.layer, important_neurons=self.important_neurons.tolist(),
            clusters_per_neuron=self.clusters_per_neuron, combination=ids,
            contributed_new=contributed, growth=len(before) + np.cumsum(contributed, dtype=np.int64),
            covered_combinations=covered.tolist(), data=data, covered_before=int(len(before)),
            reachable=int(len(reachable)), covered_reachable=int(np.isin(covered, reachable).sum()),
            resampled_covered=self._resampled_covered(resampled, accumulate),
            resampled_reachable=[int(len(r)) for r in self.resampled_reachable],
        )

    def _resampled_covered(self, resampled: np.ndarray | None, accumulate: CoverageReport | None) -> list[list[int]]:
        """Per resample, the reachable combinations covered (on top of ``accumulate``'s); [] without resamples."""
        if resampled is None or not self.resampled_centroids:
            return []
        earlier = accumulate.resampled_covered if accumulate is not None and accumulate.resampled_covered else \
            [[] for _ in self.resampled_reachable]
        return [np.intersect1d(np.union1d(np.asarray(before, np.int64), ids), reachable).tolist()
                for ids, reachable, before in zip(resampled, self.resampled_reachable, earlier)]

    def _check_compatible(self, earlier: CoverageReport) -> None:
        if (earlier.layer != self.layer or list(earlier.important_neurons) != self.important_neurons.tolist()
                or list(earlier.clusters_per_neuron) != self.clusters_per_neuron):
            raise UserError(
                f"cannot accumulate onto a report of another coverage model (layer '{earlier.layer}', "
                f"neurons {earlier.important_neurons}); use reports of the same fitted model"
            )

    def table(self) -> list[dict]:
        """One row per important neuron: rank, index, importance, clusters, Silhouette, centroids."""
        return [
            {"layer": self.layer, "rank": rank, "neuron": int(neuron),
             "importance": float(self.importance[neuron]), "clusters": len(centroids),
             "silhouette": float(silhouette), "centroids": ", ".join(f"{c:.3g}" for c in centroids)}
            for rank, (neuron, centroids, silhouette) in enumerate(
                zip(self.important_neurons, self.centroids, self.silhouettes), start=1)
        ]

    def to_dict(self) -> dict:
        values = {"layer": self.layer, "top_m": self.top_m, "important_neurons": self.important_neurons.tolist(),
                  "importance": self.importance.tolist(), "centroids": [c.tolist() for c in self.centroids],
                  "silhouettes": self.silhouettes.tolist(), "n_analysis": self.n_analysis}
        if self.reachable is not None:
            values["reachable"] = self.reachable.tolist()
        if self.resampled_centroids:
            values["resampled_neurons"] = [n.tolist() for n in self.resampled_neurons]
            values["resampled_centroids"] = [[c.tolist() for c in centroids] for centroids in self.resampled_centroids]
            values["resampled_reachable"] = [r.tolist() for r in self.resampled_reachable]
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "LayerCoverage":
        return cls(
            layer=values["layer"], top_m=int(values["top_m"]),
            important_neurons=np.asarray(values["important_neurons"], dtype=np.int64),
            importance=np.asarray(values["importance"], dtype=np.float64),
            centroids=[np.asarray(c, dtype=np.float64) for c in values["centroids"]],
            silhouettes=np.asarray(values["silhouettes"], dtype=np.float64),
            n_analysis=int(values["n_analysis"]),
            reachable=None if values.get("reachable") is None else np.asarray(values["reachable"], dtype=np.int64),
            resampled_neurons=[np.asarray(n, dtype=np.int64) for n in values.get("resampled_neurons", [])],
            resampled_centroids=[[np.asarray(c, dtype=np.float64) for c in centroids]
                                 for centroids in values.get("resampled_centroids", [])],
            resampled_reachable=[np.asarray(r, dtype=np.int64) for r in values.get("resampled_reachable", [])],
        )


def combination_ids(values: np.ndarray, centroids: Sequence[np.ndarray]) -> np.ndarray:
    """Combination ids of (N, neurons) ``values`` of the important neurons: the mixed-radix number of each
    row's nearest centroid per neuron (neuron 0 the least significant digit)."""
    ids = np.zeros(len(values), dtype=np.int64)
    stride = 1
    for column, neuron_centroids in enumerate(centroids):
        ids += nearest_centroid(values[:, column], neuron_centroids).astype(np.int64) * stride
        stride *= len(neuron_centroids)
    return ids


def too_few_to_cluster(n_analysis: int, candidates: Sequence[int], only_correct: bool) -> str | None:
    """Why ``n_analysis`` analysis inputs cannot be clustered, or None when they can.

    Each important neuron's values are clustered for every candidate k, and k-means with
    Silhouette needs at least as many values as the largest k.
    """
    largest = max(candidates)
    if n_analysis >= largest:
        return None
    which = "correctly classified " if only_correct else ""
    return (f"only {n_analysis} {which}analysis inputs but clustering needs at least {largest} "
            "(the largest cluster count)")


def _check_analysis_set(images) -> None:
    if not isinstance(images, ImageSet):
        raise UserError("IDC is fitted on an ImageSet (raw images and their labels)")


def _single_layer_property(name: str) -> property:
    def get(self):
        return getattr(self._only_layer(name), name)

    return property(get, doc=f"``{name}`` of a single-layer IDC (several layers: ``fitted_layers_[layer].{name}``).")


class ImportanceDrivenCoverage(BaseEstimator):
    """IDC of one layer or several: ``fit(model, train)`` finds important neurons and their clusters, ``score(test)``.

    Parameters
    ----------
    layers: the subject layer(s), names from ``module.named_modules()``. None (default): the last
        hidden layer with parameters before the logits (LeNet-5: ``fc2``); a name: that layer;
        a list of names: those layers; ``"all"``: every hidden layer, where a layer narrower than
        ``top_m`` uses all of its neurons (named layers must have at least ``top_m``).
    top_m: number of important neurons per layer.
    clusters: candidate cluster counts per neuron (the best by Silhouette is kept).
    rule, epsilon: LRP rule (see :mod:`mlflow_di.coverage.relevance`) and its epsilon/stabiliser.
    only_correct: analyse only the training inputs the model classifies correctly (as the paper).
    seed: seed of the k-means initialisation and of the analysis-data resamples.
    reference_quirks: cluster as the reference code does (drop zeros, < 10 values -> centroid 0,
        round centroids to 2 decimals) instead of as the paper says.
    resamples: bootstrap resamples of the analysis inputs importance and clusters are refitted on, for
        the 95% interval of reachable IDC (0, the default: none, and no interval; each costs one clustering
        of the important neurons; ``mlflow-di coverage`` uses :data:`RESAMPLES`).

    ``score`` returns a :class:`CoverageReport` when ``layers`` is None or one name, and a
    ``{layer: CoverageReport}`` dict when it is a list or ``"all"``; ``accumulate`` takes the same.

    Fitted attributes: ``layers_`` (the layer names), ``fitted_layers_`` ({layer:
    :class:`LayerCoverage`}), ``model_`` (the TorchModel scored with; None after loading
    without one), ``preprocessing_`` (dict), ``model_name_``, ``model_fingerprint_``,
    ``analysis_data_``. A single-layer IDC also has ``layer_``, ``top_m_``,
    ``important_neurons_``, ``importance_``, ``centroids_``, ``silhouettes_``, ``n_analysis_``,
    ``clusters_per_neuron_`` and ``total_combinations_`` (those of its one :class:`LayerCoverage`).
    """

    def __init__(self, layers: str | Sequence[str] | None = None, top_m: int = 6, clusters: Sequence[int] = (2, 3, 4),
                 rule: str = "epsilon", epsilon: float | None = None, only_correct: bool = True, seed: int = 0,
                 batch_size: int = 256, progress: bool = True, reference_quirks: bool = False,
                 resamples: int = 0):
        self.layers = layers
        self.top_m = top_m
        self.clusters = clusters
        self.rule = rule
        self.epsilon = epsilon
        self.only_correct = only_correct
        self.seed = seed
        self.batch_size = batch_size
        self.progress = progress
        self.reference_quirks = reference_quirks
        self.resamples = resamples

    layer_ = _single_layer_property("layer")
    top_m_ = _single_layer_property("top_m")
    important_neurons_ = _single_layer_property("important_neurons")
    importance_ = _single_layer_property("importance")
    centroids_ = _single_layer_property("centroids")
    silhouettes_ = _single_layer_property("silhouettes")
    n_analysis_ = _single_layer_property("n_analysis")
    clusters_per_neuron_ = _single_layer_property("clusters_per_neuron")
    total_combinations_ = _single_layer_property("total_combinations")

    @property
    def multi_layer(self) -> bool:
        """Whether ``score`` gives a report per layer (``layers`` a list or ``"all"``)."""
        return not (self.layers is None or (isinstance(self.layers, str) and self.layers != "all"))

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "fitted_layers_")

    def _only_layer(self, name: str) -> LayerCoverage:
        check_fitted(self)
        if len(self.fitted_layers_) != 1:
            raise AttributeError(f"this IDC covers {len(self.fitted_layers_)} layers; "
                                 f"use fitted_layers_[layer].{name}")
        return next(iter(self.fitted_layers_.values()))

    def check_params(self) -> tuple[int, ...]:
        """The candidate cluster counts (sorted), after checking every setting: a UserError for a bad one."""
        if isinstance(self.top_m, bool) or not isinstance(self.top_m, (int, np.integer)) or self.top_m < 1:
            raise UserError(f"top_m must be a positive integer, got {self.top_m!r}")
        if self.rule not in RULES:
            raise UserError(f"unknown LRP rule '{self.rule}'; choose one of {', '.join(RULES)}")
        if isinstance(self.resamples, bool) or not isinstance(self.resamples, (int, np.integer)) or self.resamples < 0:
            raise UserError(f"resamples must be an integer of at least 0, got {self.resamples!r}")
        return check_candidates(self.clusters)

    def _resolve_layers(self, module: nn.Module) -> tuple[list[str], bool]:
        """(layer names, whether a layer narrower than top_m uses all its neurons)."""
        if self.layers is None:
            layers = [default_layer(module)]
        elif isinstance(self.layers, str):
            layers = hidden_layers(module) if self.layers == "all" else [self.layers]
        else:
            layers = list(self.layers)
        if not layers:
            raise UserError("no IDC layers given; name at least one layer, or 'all'")
        check_layers(module, layers)
        return layers, self.layers == "all"

    # ----------------------------------------------------------------------------------- fit
    def fit(self, model: TorchModel, images: ImageSet) -> "ImportanceDrivenCoverage":
        """Importance analysis and quantisation of every layer on the training set ``images`` (raw images + labels)."""
        self.check_params()
        _check_analysis_set(images)
        module = model.module
        layers, clamp = self._resolve_layers(module)
        inputs = PreprocessedImages(images.images, model.preprocessing)
        widths = {layer: values.shape[1] for layer, values in collect_activations(module, inputs[0:1], layers).items()}
        self._check_widths(widths, clamp)  # before the costly relevance pass
        attribution = layer_relevance(module, inputs, layers, rule=self.rule, epsilon=self.epsilon,
                                      batch_size=self.batch_size, progress=self.progress)
        return self.fit_relevance(model, images, attribution)

    def fit_relevance(self, model: TorchModel, images: ImageSet, attribution: LayerRelevance) -> "ImportanceDrivenCoverage":
        """:meth:`fit` from a relevance pass over ``images`` already made with this IDC's rule and epsilon.

        LRP relevance is computed input by input, so a slice of one pass over a larger set is the
        pass over the slice: per-class IDC (:mod:`mlflow_di.coverage.per_class`) runs one pass
        over all analysis inputs and fits each class from its rows.
        """
        ks = self.check_params()
        _check_analysis_set(images)
        module = model.module
        layers, clamp = self._resolve_layers(module)
        missing = [layer for layer in layers if layer not in attribution.relevance]
        if missing:
            raise UserError(f"the relevance pass has no layer '{missing[0]}'; compute it for layers {layers}")
        if len(attribution.predictions) != len(images):
            raise UserError(f"the relevance pass covers {len(attribution.predictions)} inputs, "
                            f"not the {len(images)} of '{images.name}'")
        widths = {layer: attribution.activations[layer].shape[1] for layer in layers}
        self._check_widths(widths, clamp)
        correct = attribution.predictions == images.labels
        fitted = {}
        for layer in layers:
            analysed = correct if self.only_correct else np.ones(len(correct), dtype=bool)
            activations = attribution.activations[layer]
            relevance = attribution.relevance[layer][analysed]
            fitted[layer] = self._fit_layer(
                layer, exact_column_sums(relevance), int(analysed.sum()),
                analysed_columns=lambda neurons, values=activations, rows=analysed: values[:, neurons][rows],
                top_m=min(self.top_m, widths[layer]), ks=ks, analysed_relevance=lambda values=relevance: values)
        return self._fitted(model, images, layers, fitted)

    def fit_importance(self, model: TorchModel, images: ImageSet, importance: Mapping[str, np.ndarray],
                       n_analysis: int, analysed_columns, analysed_relevance=None) -> "ImportanceDrivenCoverage":
        """:meth:`fit` from the relevance pass's aggregates (a pass spread over workers, see
        :mod:`mlflow_di.coverage.partials`): ``importance[layer]`` the summed relevance of each neuron
        over the ``n_analysis`` analysis inputs (exact sums, as :meth:`fit_relevance` takes them), and
        ``analysed_columns(layer, neurons)`` the analysis inputs' activations of those neurons,
        (n_analysis, len(neurons)), in input order: clustering needs them input by input.
        ``analysed_relevance(layer)``: the analysis inputs' relevance of every neuron, (n_analysis, width), in
        input order, which the resamples refit importance from (needed when ``resamples`` > 0).
        """
        ks = self.check_params()
        _check_analysis_set(images)
        layers, clamp = self._resolve_layers(model.module)
        widths = {layer: len(importance[layer]) for layer in layers}
        self._check_widths(widths, clamp)
        if self.resamples and analysed_relevance is None:
            raise UserError("resampling the analysis data needs its per-input relevance (analysed_relevance)")
        fitted = {layer: self._fit_layer(layer, np.asarray(importance[layer], np.float64), n_analysis,
                                         analysed_columns=lambda neurons, layer=layer: analysed_columns(layer, neurons),
                                         top_m=min(self.top_m, widths[layer]), ks=ks,
                                         analysed_relevance=lambda layer=layer: analysed_relevance(layer))
                  for layer in layers}
        return self._fitted(model, images, layers, fitted)

    def _fitted(self, model, images, layers, fitted) -> "ImportanceDrivenCoverage":
        self.layers_ = layers
        self.fitted_layers_ = fitted
        self.model_ = model
        self.preprocessing_ = model.preprocessing.to_dict()
        self.model_name_ = getattr(model, "name", type(model.module).__name__)
        self.model_fingerprint_ = module_fingerprint(model.module)
        self.analysis_data_ = images.name
        return self

    def _check_widths(self, widths: Mapping[str, int], clamp: bool) -> None:
        """A UserError when ``top_m`` exceeds a layer's neurons (unless narrower layers use all of theirs)."""
        if clamp:
            return
        for layer, width in widths.items():
            if self.top_m > width:
                raise UserError(f"top_m={self.top_m} exceeds the {width} neurons of layer '{layer}'; "
                                f"choose top_m <= {width}")

    def _fit_layer(self, layer: str, importance: np.ndarray, n_analysis: int, analysed_columns,
                   top_m: int, ks: tuple[int, ...], analysed_relevance=None) -> LayerCoverage:
        """Pick the important neurons from the summed relevance and cluster their activations.

        ``importance``: each neuron's relevance summed over the analysis inputs (exactly rounded, see
        :class:`~mlflow_di.coverage.partials.ExactSum`, so a pass split into batches anywhere gives the
        same bits); ``analysed_columns(neurons)``: the analysis inputs' activations of ``neurons``;
        ``analysed_relevance()``: their relevance of every neuron, which the resamples refit importance from.
        """
        shortfall = too_few_to_cluster(n_analysis, ks, self.only_correct)
        if shortfall:
            raise UserError(f"{shortfall} for layer '{layer}'; give more training data")
        important = np.argsort(-importance, kind="stable")[:top_m]
        columns = analysed_columns(important)
        choices = [
            choose_clusters(columns[:, column], ks, seed=self.seed, reference_quirks=self.reference_quirks)
            for column in tqdm(range(len(important)), desc=f"clustering {layer}", disable=not self.progress,
                               leave=False)
        ]
        total = math.prod(len(c.centroids) for c in choices)
        if total >= MAX_COMBINATIONS:
            raise UserError(f"{total} combinations for top_m={top_m} neurons cannot be covered; lower top_m")
        centroids = [np.asarray(c.centroids, dtype=np.float64) for c in choices]
        refits = self._refits(layer, analysed_relevance, analysed_columns, n_analysis, top_m, ks) if self.resamples else []
        return LayerCoverage(
            layer=layer, top_m=int(top_m), important_neurons=important.astype(np.int64), importance=importance,
            centroids=centroids, silhouettes=np.array([c.silhouette for c in choices], dtype=np.float64),
            n_analysis=n_analysis, reachable=np.unique(combination_ids(columns, centroids)),
            resampled_neurons=[neurons for neurons, _, _ in refits],
            resampled_centroids=[refit for _, refit, _ in refits],
            resampled_reachable=[reachable for _, _, reachable in refits],
        )

    def _refits(self, layer: str, analysed_relevance, analysed_columns, n_analysis: int, top_m: int,
                ks: tuple[int, ...]) -> list[tuple[np.ndarray, list[np.ndarray], np.ndarray]]:
        """(important neurons, their centroids, the combinations all analysis inputs realise) refitted on each of
        ``resamples`` bootstrap resamples of the analysis inputs (rows drawn with replacement by a generator
        seeded by ``seed``): importance summed over the resample's rows in their drawn order (float64 sums of
        the same numbers in the same order: the same bits on every CPU), then the new neurons' clusters."""
        relevance = np.asarray(analysed_relevance(), dtype=np.float64)
        rng = np.random.default_rng([self.seed, n_analysis])
        refits = []
        for _ in tqdm(range(self.resamples), desc=f"resampling {layer}", disable=not self.progress, leave=False):
            rows = rng.integers(0, n_analysis, size=n_analysis)
            neurons = np.argsort(-relevance[rows].sum(axis=0), kind="stable")[:top_m].astype(np.int64)
            columns = analysed_columns(neurons)
            refit = [np.asarray(choose_clusters(columns[rows, column], ks, seed=self.seed,
                                                reference_quirks=self.reference_quirks).centroids, dtype=np.float64)
                     for column in range(len(neurons))]
            if math.prod(len(c) for c in refit) >= MAX_COMBINATIONS:
                raise UserError(f"a resample's clusters give too many combinations for top_m={top_m}; lower top_m")
            refits.append((neurons, refit, np.unique(combination_ids(columns, refit))))
        return refits

    # --------------------------------------------------------------------------------- score
    def attach(self, model, check: bool = True) -> "ImportanceDrivenCoverage":
        """Score with ``model`` (a TorchModel, or an nn.Module taking the saved preprocessing).

        With ``check`` the model's weights must be the ones the coverage model was fitted on.
        """
        check_fitted(self, "fit(model, images) or load(path)")
        module = model if isinstance(model, nn.Module) else model.module
        if check and self.model_fingerprint_ and module_fingerprint(module) != self.model_fingerprint_:
            raise UserError(
                f"the attached model's weights differ from those the coverage model was fitted on "
                f"('{self.model_name_}'); attach that model or fit a new coverage model"
            )
        check_layers(module, self.layers_)
        if isinstance(model, nn.Module):
            model = TorchModel(module, Preprocessing.from_dict(self.preprocessing_), self.model_name_)
        self.model_ = model
        return self

    def activations(self, images) -> dict[str, np.ndarray]:
        """{layer: (N, neurons)} activations of every IDC layer, from one forward pass over raw ``images``."""
        check_fitted(self, "fit(model, images) or load(path)")
        if self.model_ is None:
            raise UserError("no PyTorch model attached to this loaded coverage model; call attach(model) first")
        images, _ = images_of(images)
        inputs = PreprocessedImages(images, Preprocessing.from_dict(self.preprocessing_))
        return collect_activations(self.model_.module, inputs, self.layers_, batch_size=self.batch_size,
                                   progress=self.progress)

    def combinations(self, images) -> np.ndarray | dict[str, np.ndarray]:
        """Combination ids of each raw image (see :class:`CoverageReport`); per layer for a multi-layer IDC."""
        activations = self.activations(images)
        ids = {layer: fitted.combinations(activations[layer]) for layer, fitted in self.fitted_layers_.items()}
        return ids if self.multi_layer else next(iter(ids.values()))

    def score(self, images, accumulate=None):
        """IDC of ``images`` (ImageSet or raw uint8 images); with ``accumulate``, on top of that earlier result."""
        check_fitted(self, "fit(model, images) or load(path)")
        _, name = images_of(images)
        return self.score_activations(self.activations(images), accumulate=accumulate, data=name)

    def score_activations(self, activations: Mapping[str, np.ndarray], accumulate=None, data: str = ""):
        """IDC from activations already collected (``activations[layer]`` (N, neurons) for each of ``layers_``).

        Returns and accumulates onto what :meth:`score` does.
        """
        check_fitted(self, "fit(model, images) or load(path)")
        if accumulate is None:
            earlier = {}
        elif self.multi_layer:
            earlier = dict(accumulate)
        else:
            earlier = {self.layers_[0]: accumulate}
        missing = [layer for layer in self.layers_ if layer not in activations]
        if missing:
            raise UserError(f"no activations for IDC layer '{missing[0]}' (have: {', '.join(sorted(activations))})")
        reports = {layer: fitted.report(fitted.combinations(np.asarray(activations[layer])),
                                        accumulate=earlier.get(layer), data=data,
                                        resampled=fitted.resampled_combinations(np.asarray(activations[layer])))
                   for layer, fitted in self.fitted_layers_.items()}
        return reports if self.multi_layer else reports[self.layers_[0]]

    def important_neurons_table(self) -> list[dict]:
        """One row per important neuron of every layer: layer, rank, index, importance, clusters."""
        check_fitted(self)
        return [row for fitted in self.fitted_layers_.values() for row in fitted.table()]

    # ------------------------------------------------------------------------------ persist
    def to_dict(self) -> dict:
        """Settings and fitted state as plain JSON-able values (no weights: attach the model after loading)."""
        check_fitted(self)
        params = self.get_params()
        params["clusters"] = list(params["clusters"])
        if params["layers"] is not None and not isinstance(params["layers"], str):
            params["layers"] = list(params["layers"])
        return stamped(KIND, {
            "params": params, "layers": [self.fitted_layers_[layer].to_dict() for layer in self.layers_],
            "preprocessing": self.preprocessing_, "model_name": self.model_name_,
            "model_fingerprint": self.model_fingerprint_, "analysis_data": self.analysis_data_,
        })

    @classmethod
    def from_dict(cls, values: dict, model=None) -> "ImportanceDrivenCoverage":
        """A fitted IDC from :meth:`to_dict`'s values (already checked), attached to ``model`` when given."""
        coverage = cls(**values["params"])
        fitted = [LayerCoverage.from_dict(layer) for layer in values["layers"]]
        coverage.layers_ = [layer.layer for layer in fitted]
        coverage.fitted_layers_ = {layer.layer: layer for layer in fitted}
        coverage.model_ = None
        coverage.preprocessing_ = values["preprocessing"]
        coverage.model_name_ = values["model_name"]
        coverage.model_fingerprint_ = values["model_fingerprint"]
        coverage.analysis_data_ = values["analysis_data"]
        if model is not None:
            coverage.attach(model)
        return coverage

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str, model=None, source: str = "IDC coverage model") -> "ImportanceDrivenCoverage":
        return cls.from_dict(parse_saved(text, KIND, source), model)

    def save(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path, model=None) -> "ImportanceDrivenCoverage":
        """A fitted IDC saved by :meth:`save`; ``model`` (its fitted weights) to score with."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise UserError(f"IDC coverage model file '{path}' does not exist")
        return cls.from_json(path.read_text(), model, source=f"'{path}'")
