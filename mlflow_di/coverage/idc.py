"""Importance-Driven Coverage (IDC, Gerasimou et al., ICSE 2020) as a fit/score estimator.

``fit`` (importance analysis + quantisation, Alg. 1-2 of the paper): over the analysis inputs
(training inputs the model classifies correctly), LRP relevance of every neuron of the subject
layer is summed (signed, as in the reference code); the ``top_m`` neurons with the highest sum are
the important ones; each one's activations are clustered by 1-D k-means with the k in ``clusters``
of best Silhouette. ``score`` (Eq. 5-6): each test input maps every important neuron to its nearest
centroid; the tuple of centroid indices is a *combination*; IDC = covered combinations / all
combinations (the product of the neurons' cluster counts).

The fitted model is plain numbers (layer, neurons, importance, centroids, preprocessing) and saves
as JSON; a reloaded model needs only the PyTorch module attached to score new data.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
from typing import Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.importance.activations import (
    PreprocessedImages,
    check_layers,
    collect_activations,
    default_layer,
    hidden_layers,
)
from mlflow_di.importance.quantize import check_candidates, choose_clusters, nearest_centroid
from mlflow_di.importance.relevance import RULES, layer_relevance
from mlflow_di.models.preprocessing import Preprocessing

FORMAT = "mlflow-di/idc"
FORMAT_VERSION = 1
#: Combinations are numbered as int64; beyond this many, IDC is meaningless anyway (never coverable).
MAX_COMBINATIONS = 2**62


def module_fingerprint(module: nn.Module) -> str:
    """SHA-256 of a module's parameters and buffers (names, shapes, values): which weights a coverage model fits."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        array = tensor.detach().cpu().contiguous().numpy()
        digest.update(f"{name}:{array.dtype}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _images_of(data) -> tuple[np.ndarray, str]:
    if isinstance(data, ImageSet):
        return data.images, data.name
    images = np.asarray(data)
    if images.dtype != np.uint8:
        raise UserError(f"expected raw uint8 images (N, H, W, C) or an ImageSet, got {images.dtype} {images.shape}")
    return images, "images"


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

    @property
    def n_inputs(self) -> int:
        return len(self.combination)

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


class ImportanceDrivenCoverage:
    """IDC of one layer: ``fit(torch_model, train)`` finds important neurons and their clusters, ``score(test)``.

    Parameters
    ----------
    layer: subject layer (a name from ``module.named_modules()``); default: the last hidden layer
        with parameters before the logits (LeNet-5: ``fc2``).
    top_m: number of important neurons.
    clusters: candidate cluster counts per neuron (the best by Silhouette is kept).
    rule, epsilon: LRP rule (see :mod:`mlflow_di.importance.relevance`) and its epsilon/stabiliser.
    only_correct: analyse only the training inputs the model classifies correctly (as the paper).
    seed: seed of the k-means initialisation.
    reference_quirks: cluster as the reference code does (drop zeros, < 10 values -> centroid 0,
        round centroids to 2 decimals) instead of as the paper says.

    Fitted attributes: ``layer_``, ``important_neurons_`` (indices in the layer's neuron order, most
    important first), ``importance_`` (summed relevance of every neuron of the layer),
    ``centroids_`` (ascending array per important neuron), ``silhouettes_``, ``n_analysis_``,
    ``preprocessing_`` (dict), ``model_name_``, ``model_fingerprint_``, ``analysis_data_``.
    """

    def __init__(self, layer: str | None = None, top_m: int = 6, clusters: Sequence[int] = (2, 3, 4),
                 rule: str = "epsilon", epsilon: float | None = None, only_correct: bool = True, seed: int = 0,
                 batch_size: int = 256, progress: bool = True, reference_quirks: bool = False):
        self.layer = layer
        self.top_m = top_m
        self.clusters = clusters
        self.rule = rule
        self.epsilon = epsilon
        self.only_correct = only_correct
        self.seed = seed
        self.batch_size = batch_size
        self.progress = progress
        self.reference_quirks = reference_quirks
        self._module: nn.Module | None = None

    def get_params(self) -> dict:
        """The constructor arguments (scikit-learn convention)."""
        return {"layer": self.layer, "top_m": self.top_m, "clusters": list(self.clusters), "rule": self.rule,
                "epsilon": self.epsilon, "only_correct": self.only_correct, "seed": self.seed,
                "batch_size": self.batch_size, "progress": self.progress, "reference_quirks": self.reference_quirks}

    def _check_params(self) -> tuple[int, ...]:
        if not isinstance(self.top_m, (int, np.integer)) or self.top_m < 1:
            raise UserError(f"top_m must be a positive integer, got {self.top_m!r}")
        if self.rule not in RULES:
            raise UserError(f"unknown LRP rule '{self.rule}'; choose one of {', '.join(RULES)}")
        return check_candidates(self.clusters)

    # ----------------------------------------------------------------------------------- fit
    def fit(self, torch_model, train: ImageSet) -> "ImportanceDrivenCoverage":
        """Importance analysis and quantisation on the training set ``train`` (raw images + labels)."""
        self._check_params()
        module = torch_model.module
        layer = self.layer or default_layer(module)
        check_layers(module, [layer])
        inputs = PreprocessedImages(train.images, torch_model.preprocessing)
        self._check_width(layer, _layer_width(module, inputs, layer))
        attribution = layer_relevance(module, inputs, [layer], rule=self.rule, epsilon=self.epsilon,
                                      batch_size=self.batch_size, progress=self.progress)
        self._set_model(torch_model, train)
        self._fit_layer(layer, attribution.relevance[layer], attribution.activations[layer],
                        attribution.predictions == train.labels, self.top_m)
        return self

    def _check_width(self, layer: str, width: int) -> None:
        if self.top_m > width:
            raise UserError(f"top_m={self.top_m} exceeds the {width} neurons of layer '{layer}'; choose top_m <= {width}")

    def _set_model(self, torch_model, train: ImageSet) -> None:
        self._module = torch_model.module
        self.preprocessing_ = torch_model.preprocessing.to_dict()
        self.model_name_ = getattr(torch_model, "name", type(torch_model.module).__name__)
        self.model_fingerprint_ = module_fingerprint(torch_model.module)
        self.analysis_data_ = train.name

    def _fit_layer(self, layer: str, relevance: np.ndarray, activations: np.ndarray, correct: np.ndarray,
                   top_m: int) -> None:
        """Pick the important neurons from per-input relevance and cluster their activations."""
        ks = self._check_params()
        analysed = correct if self.only_correct else np.ones(len(relevance), dtype=bool)
        n_analysis = int(analysed.sum())
        if n_analysis < max(ks):
            which = "correctly classified " if self.only_correct else ""
            raise UserError(
                f"only {n_analysis} {which}analysis inputs for layer '{layer}' but clustering needs at least "
                f"{max(ks)} (the largest cluster count); give more training data"
            )
        importance = relevance[analysed].sum(axis=0, dtype=np.float64)
        important = np.argsort(-importance, kind="stable")[:top_m]
        choices = [
            choose_clusters(activations[analysed, neuron], ks, seed=self.seed, reference_quirks=self.reference_quirks)
            for neuron in tqdm(important, desc=f"clustering {layer}", disable=not self.progress, leave=False)
        ]
        total = math.prod(len(c.centroids) for c in choices)
        if total >= MAX_COMBINATIONS:
            raise UserError(f"{total} combinations for top_m={top_m} neurons cannot be covered; lower top_m")
        self.layer_ = layer
        self.top_m_ = int(top_m)
        self.importance_ = importance
        self.important_neurons_ = important.astype(np.int64)
        self.centroids_ = [np.asarray(c.centroids, dtype=np.float64) for c in choices]
        self.silhouettes_ = np.array([c.silhouette for c in choices], dtype=np.float64)
        self.n_analysis_ = n_analysis

    # --------------------------------------------------------------------------------- score
    @property
    def clusters_per_neuron_(self) -> list[int]:
        return [len(c) for c in self.centroids_]

    @property
    def total_combinations_(self) -> int:
        return math.prod(self.clusters_per_neuron_)

    def _check_fitted(self) -> None:
        if not hasattr(self, "centroids_"):
            raise UserError("this coverage model is not fitted yet; call fit(torch_model, train) first")
        if self._module is None:
            raise UserError("no PyTorch model attached to this loaded coverage model; call attach(torch_model) first")

    def attach(self, torch_model, check: bool = True) -> "ImportanceDrivenCoverage":
        """Use ``torch_model`` (a TorchModel or nn.Module) to compute activations when scoring.

        With ``check`` the model's weights must be the ones the coverage model was fitted on.
        """
        module = torch_model if isinstance(torch_model, nn.Module) else torch_model.module
        if check and getattr(self, "model_fingerprint_", None) and module_fingerprint(module) != self.model_fingerprint_:
            raise UserError(
                f"the attached model's weights differ from those the coverage model was fitted on "
                f"('{self.model_name_}'); attach that model or fit a new coverage model"
            )
        check_layers(module, [self.layer_])
        self._module = module
        return self

    def combinations(self, images) -> np.ndarray:
        """Combination id of each raw image (see :class:`CoverageReport`)."""
        self._check_fitted()
        images, _ = _images_of(images)
        inputs = PreprocessedImages(images, Preprocessing.from_dict(self.preprocessing_))
        activations = collect_activations(self._module, inputs, [self.layer_], batch_size=self.batch_size,
                                          progress=self.progress)[self.layer_]
        return self.combinations_of_activations(activations)

    def combinations_of_activations(self, activations: np.ndarray) -> np.ndarray:
        """Combination ids from the subject layer's (N, neurons) activations: nearest centroid per neuron."""
        values = activations[:, self.important_neurons_]
        ids = np.zeros(len(values), dtype=np.int64)
        stride = 1
        for column, centroids in enumerate(self.centroids_):
            ids += nearest_centroid(values[:, column], centroids).astype(np.int64) * stride
            stride *= len(centroids)
        return ids

    def score(self, test, accumulate: CoverageReport | None = None) -> CoverageReport:
        """IDC of ``test`` (ImageSet or raw uint8 images); with ``accumulate``, on top of that earlier report."""
        name = test.name if isinstance(test, ImageSet) else "images"
        return self.report(self.combinations(test), accumulate=accumulate, data=name)

    def report(self, ids: np.ndarray, accumulate: CoverageReport | None = None, data: str = "") -> CoverageReport:
        """The :class:`CoverageReport` of given combination ids, optionally on top of ``accumulate``."""
        before = np.zeros(0, dtype=np.int64)
        if accumulate is not None:
            self._check_compatible(accumulate)
            before = np.asarray(accumulate.covered_combinations, dtype=np.int64)
        unique, first = np.unique(ids, return_index=True)
        is_new = ~np.isin(unique, before)
        contributed = np.zeros(len(ids), dtype=bool)
        contributed[first[is_new]] = True
        covered = np.union1d(before, unique)
        return CoverageReport(
            idc=len(covered) / self.total_combinations_, covered=int(len(covered)), total=self.total_combinations_,
            layer=self.layer_, important_neurons=self.important_neurons_.tolist(),
            clusters_per_neuron=self.clusters_per_neuron_, combination=ids,
            contributed_new=contributed, growth=len(before) + np.cumsum(contributed, dtype=np.int64),
            covered_combinations=covered.tolist(), data=data, covered_before=int(len(before)),
        )

    def _check_compatible(self, earlier: CoverageReport) -> None:
        if (earlier.layer != self.layer_ or list(earlier.important_neurons) != self.important_neurons_.tolist()
                or list(earlier.clusters_per_neuron) != self.clusters_per_neuron_):
            raise UserError(
                f"cannot accumulate onto a report of another coverage model (layer '{earlier.layer}', "
                f"neurons {earlier.important_neurons}); use reports of the same fitted model"
            )

    # ------------------------------------------------------------------------------ persist
    def to_dict(self) -> dict:
        """Settings and fitted state as plain JSON-able values (no weights: attach the model after loading)."""
        self._check_fitted_state()
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "params": self.get_params(),
            "layer": self.layer_, "top_m": self.top_m_, "important_neurons": self.important_neurons_.tolist(),
            "importance": self.importance_.tolist(), "centroids": [c.tolist() for c in self.centroids_],
            "silhouettes": self.silhouettes_.tolist(), "n_analysis": self.n_analysis_,
            "preprocessing": self.preprocessing_, "model_name": self.model_name_,
            "model_fingerprint": self.model_fingerprint_, "analysis_data": self.analysis_data_,
        }

    def _check_fitted_state(self) -> None:
        if not hasattr(self, "centroids_"):
            raise UserError("this coverage model is not fitted yet; call fit(torch_model, train) first")

    @classmethod
    def from_dict(cls, values: dict, torch_model=None) -> "ImportanceDrivenCoverage":
        if values.get("format") != FORMAT:
            raise UserError(f"not an IDC coverage model (format {values.get('format')!r}, expected '{FORMAT}')")
        if values.get("version") != FORMAT_VERSION:
            raise UserError(f"IDC coverage model version {values.get('version')} is not supported "
                            f"(this mlflow-di reads version {FORMAT_VERSION})")
        model = cls(**values["params"])
        model.layer_ = values["layer"]
        model.top_m_ = values["top_m"]
        model.important_neurons_ = np.asarray(values["important_neurons"], dtype=np.int64)
        model.importance_ = np.asarray(values["importance"], dtype=np.float64)
        model.centroids_ = [np.asarray(c, dtype=np.float64) for c in values["centroids"]]
        model.silhouettes_ = np.asarray(values["silhouettes"], dtype=np.float64)
        model.n_analysis_ = values["n_analysis"]
        model.preprocessing_ = values["preprocessing"]
        model.model_name_ = values["model_name"]
        model.model_fingerprint_ = values["model_fingerprint"]
        model.analysis_data_ = values["analysis_data"]
        if torch_model is not None:
            model.attach(torch_model)
        return model

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str, torch_model=None) -> "ImportanceDrivenCoverage":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"IDC coverage model is not valid JSON: {exc}") from None
        return cls.from_dict(values, torch_model)

    def save(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path, torch_model=None) -> "ImportanceDrivenCoverage":
        path = pathlib.Path(path)
        if not path.is_file():
            raise UserError(f"IDC coverage model file '{path}' does not exist")
        return cls.from_json(path.read_text(), torch_model)


def _layer_width(module: nn.Module, inputs, layer: str) -> int:
    """Number of neurons of ``layer``, from a forward pass of one input."""
    return collect_activations(module, inputs[0:1], [layer])[layer].shape[1]


def fit_layers(torch_model, train: ImageSet, layers: str | Sequence[str] = "all",
               **params) -> dict[str, ImportanceDrivenCoverage]:
    """One IDC model per layer from a single forward+LRP pass (``layers="all"``: every hidden layer).

    With ``"all"``, a layer with fewer neurons than ``top_m`` uses all of its neurons (its
    ``top_m_`` says how many); named layers must have at least ``top_m`` neurons.
    """
    module = torch_model.module
    clamp = isinstance(layers, str) and layers == "all"
    layers = hidden_layers(module) if clamp else ([layers] if isinstance(layers, str) else list(layers))
    check_layers(module, layers)
    models = {layer: ImportanceDrivenCoverage(layer=layer, **params) for layer in layers}
    template = models[layers[0]]
    template._check_params()
    inputs = PreprocessedImages(train.images, torch_model.preprocessing)
    widths = collect_activations(module, inputs[0:1], layers)
    if not clamp:
        for layer, model in models.items():
            model._check_width(layer, widths[layer].shape[1])
    attribution = layer_relevance(module, inputs, layers, rule=template.rule, epsilon=template.epsilon,
                                  batch_size=template.batch_size, progress=template.progress)
    correct = attribution.predictions == train.labels
    for layer, model in models.items():
        model._set_model(torch_model, train)
        model._fit_layer(layer, attribution.relevance[layer], attribution.activations[layer], correct,
                         min(model.top_m, widths[layer].shape[1]))
    return models


def score_layers(models: dict[str, ImportanceDrivenCoverage], test,
                 accumulate: dict[str, CoverageReport] | None = None) -> dict[str, CoverageReport]:
    """Score several fitted layer models of the same network with one forward pass over ``test``."""
    if not models:
        return {}
    first = next(iter(models.values()))
    first._check_fitted()
    images, name = _images_of(test)
    inputs = PreprocessedImages(images, Preprocessing.from_dict(first.preprocessing_))
    activations = collect_activations(first._module, inputs, [m.layer_ for m in models.values()],
                                      batch_size=first.batch_size, progress=first.progress)
    accumulate = accumulate or {}
    return {
        key: model.report(model.combinations_of_activations(activations[model.layer_]),
                          accumulate=accumulate.get(key), data=name)
        for key, model in models.items()
    }
