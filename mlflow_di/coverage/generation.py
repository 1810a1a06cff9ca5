"""IDC-guided test generation: mutate seed inputs and keep the mutants that cover a new IDC combination.

A fitted :class:`~mlflow_di.coverage.idc.ImportanceDrivenCoverage` says which combinations of its
important neurons' clusters the seeds cover. :func:`generate` then spends a budget of mutants
(model queries) in batches: each mutant is one mild operator (DFlare's noise, blur and pixel
operators with small parameters, and albumentations' brightness, elastic and JPEG transforms at
severity 1; see :func:`generation_operators`) applied to a parent input, which is a seed or, half
of the time once there are some, an input kept earlier (at most ``max_depth`` operators away from
its seed, so the changes stay bounded). A mutant is kept when

* the **oracle** accepts it: the model still predicts the label of the seed it comes from (the
  seed's label in the data). This is the usual metamorphic assumption of coverage-guided testing
  (DeepHunter, DeepImportance's evaluation): mild mutations preserve the true label, and a
  mutant the model relabels is treated as having possibly changed it, so it is not kept. Seeds
  the model misclassifies yield only mutants the model classifies correctly;
* and its combination (of the IDC layer ``layer``) is not covered by the seeds or the inputs
  kept so far.

The search stops when the budget is spent or every combination is covered.

Baseline, "random mutation of the same size": the same budget of mutants, drawn with the same
operators from the seeds only (no feedback, no chains); every mutant the oracle accepts is kept.
Its IDC is that of the seeds plus all those mutants, against the seeds plus the guided kept
inputs: the same number of model queries, so the comparison is of IDC reached for equal budgets
(the random set usually holds many more inputs).

Everything is drawn from ``np.random.SeedSequence(seed)``: the same seed, seeds, model, budget
and ``batch_size`` give the same result. A batch is queried whole, so a search that reaches full
coverage inside a batch still counts (and records) that batch's remaining mutants.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz._random import draw_index
from mlflow_di.fuzz.mutations import GaussianBlur, GaussianNoise, MultiplicativeNoise, Operator, PixelChange
from mlflow_di.robustness.corruptions import CORRUPTIONS, corrupt

#: Share of parents drawn from the kept inputs (when there are any) instead of the seeds.
KEPT_PARENT_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Corrupt:
    """An albumentations corruption of the catalogue (:mod:`mlflow_di.robustness.corruptions`) as a mutation operator.

    What the corruption draws (where the elastic field moves pixels, ...) is seeded from ``rng``.
    """

    corruption: str
    severity: int = 1

    @property
    def name(self) -> str:
        return self.corruption

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        transform = _transform(self.corruption, self.severity, image.shape)
        index = int(rng.integers(2**31))
        return corrupt(image[None], self.corruption, self.severity, indices=[index], transform=transform)[0]


_TRANSFORMS: dict = {}


def _transform(corruption: str, severity: int, shape: tuple[int, ...]):
    key = (corruption, severity, tuple(shape))
    if key not in _TRANSFORMS:
        _TRANSFORMS[key] = CORRUPTIONS[corruption].build(severity, tuple(shape))
    return _TRANSFORMS[key]


def generation_operators() -> tuple[Operator, ...]:
    """Mild operators meant to keep the label: DFlare's with small parameters, albumentations' at severity 1."""
    return (GaussianNoise(sigma=8.0), MultiplicativeNoise(mean_low=-0.15, mean_high=0.15, var_max=0.01),
            PixelChange(max_values=4), GaussianBlur(kernels=(1, 3)),
            Corrupt("brightness"), Corrupt("elastic"), Corrupt("jpeg"))


@dataclasses.dataclass
class GenerationResult:
    """What :func:`generate` kept, and how IDC grew with the queries, guided and random.

    ``images``/``labels``: the kept inputs (uint8 N x H x W x C) and their seeds' labels;
    ``seed_index``: the seed each one descends from; ``operators``: the operators from the seed to
    it ("+"-joined); ``combinations``: the combination each one covered first. ``guided_growth[i]``
    / ``random_growth[i]``: combinations covered (seeds included) after mutant i of each search.
    ``guided_preserved``/``random_preserved``: mutants the oracle accepted.
    """

    images: np.ndarray
    labels: np.ndarray
    seed_index: np.ndarray
    operators: list[str]
    combinations: np.ndarray
    layer: str
    total: int
    n_seeds: int
    seeds_covered: int
    budget: int
    guided_growth: np.ndarray
    random_growth: np.ndarray
    guided_preserved: int
    random_preserved: int
    seed: int = 0

    @property
    def kept(self) -> int:
        return len(self.labels)

    @property
    def idc_seeds(self) -> float:
        return self.seeds_covered / self.total

    @property
    def idc_guided(self) -> float:
        return (int(self.guided_growth[-1]) if len(self.guided_growth) else self.seeds_covered) / self.total

    @property
    def idc_random(self) -> float:
        return (int(self.random_growth[-1]) if len(self.random_growth) else self.seeds_covered) / self.total

    def metrics(self) -> dict[str, float]:
        return {"idc_seeds": self.idc_seeds, "idc_guided": self.idc_guided, "idc_random": self.idc_random,
                "kept": self.kept, "queries_guided": len(self.guided_growth), "queries_random": len(self.random_growth),
                "preserved_guided": self.guided_preserved, "preserved_random": self.random_preserved}

    def summary(self) -> dict:
        return {**self.metrics(), "layer": self.layer, "total_combinations": self.total, "seeds": self.n_seeds,
                "covered_seeds": self.seeds_covered, "covered_guided": self.covered_guided,
                "covered_random": self.covered_random, "budget": self.budget, "seed": self.seed}

    @property
    def covered_guided(self) -> int:
        return round(self.idc_guided * self.total)

    @property
    def covered_random(self) -> int:
        return round(self.idc_random * self.total)


def generate(idc, model, seeds: ImageSet, budget: int, *, layer: str | None = None,
             operators: Sequence[Operator] | None = None, batch_size: int = 64, seed: int = 0,
             max_depth: int = 3, baseline: bool = True) -> GenerationResult:
    """IDC-guided generation from ``seeds`` with ``budget`` mutants, and the random baseline (see the module docstring).

    ``idc``: a fitted IDC attached to ``model`` (a TorchModel, whose predictions are the oracle);
    ``layer``: which of its layers guides (default its first).
    """
    if budget < 1:
        raise UserError(f"the budget must be at least one mutant, got {budget}")
    if len(seeds) == 0:
        raise UserError(f"no seed inputs in '{seeds.name}'")
    if max_depth < 1:
        raise UserError(f"max_depth must be at least 1, got {max_depth}")
    layer = layer or idc.layers_[0]
    if layer not in idc.fitted_layers_:
        raise UserError(f"the IDC model has no layer '{layer}' (it has {', '.join(idc.layers_)})")
    operators = tuple(operators or generation_operators())
    query = _Oracle(idc, model, layer, batch_size)
    images = np.asarray(seeds.images)
    labels = np.asarray(seeds.labels, dtype=np.int64)
    seed_combinations = query.combinations(images)
    guided_rng, random_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    total = idc.fitted_layers_[layer].total_combinations
    guided = _Search(images, labels, seed_combinations, total)
    guided.run(query, operators, guided_rng, budget, batch_size, max_depth, feedback=True)
    random = _Search(images, labels, seed_combinations, total)
    if baseline:
        random.run(query, operators, random_rng, budget, batch_size, max_depth, feedback=False)
    kept = guided.kept
    shape = (0, *images.shape[1:])
    return GenerationResult(
        images=np.stack([guided.images[i] for i in kept]) if kept else np.empty(shape, dtype=np.uint8),
        labels=np.array([guided.labels[i] for i in kept], dtype=np.int64),
        seed_index=np.array([guided.origin[i] for i in kept], dtype=np.int64),
        operators=[guided.chain[i] for i in kept],
        combinations=np.array(guided.new_combinations, dtype=np.int64),
        layer=layer, total=total, n_seeds=len(images), seeds_covered=len(set(seed_combinations.tolist())),
        budget=int(budget), guided_growth=np.array(guided.growth, dtype=np.int64),
        random_growth=np.array(random.growth, dtype=np.int64), guided_preserved=guided.preserved,
        random_preserved=random.preserved, seed=int(seed))


class _Oracle:
    """One model query per batch of mutants: predictions (the oracle) and IDC combinations."""

    def __init__(self, idc, model, layer: str, batch_size: int):
        self.idc, self.layer, self.batch_size = idc, layer, batch_size
        self.classifier = model.classifier()

    def combinations(self, images: np.ndarray) -> np.ndarray:
        previous, self.idc.progress = self.idc.progress, False  # one bar per batch of mutants would flood the output
        try:
            ids = self.idc.combinations(images)
        finally:
            self.idc.progress = previous
        return ids[self.layer] if isinstance(ids, dict) else ids

    def __call__(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.classifier.predict(images, self.batch_size), self.combinations(images)


class _Search:
    """A pool of inputs (the seeds, then what is kept) and the covered combinations."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, combinations: np.ndarray, total: int):
        n = len(images)
        self.images, self.labels = list(images), list(labels)
        self.origin, self.depth, self.chain = list(range(n)), [0] * n, [""] * n
        self.n_seeds, self.total = n, total
        self.covered = set(combinations.tolist())
        self.kept: list[int] = []
        self.new_combinations: list[int] = []
        self.growth: list[int] = []
        self.preserved = 0

    def parent(self, rng: np.random.Generator, feedback: bool, max_depth: int) -> int:
        if feedback and self.kept and rng.random() < KEPT_PARENT_SHARE:
            eligible = [i for i in self.kept if self.depth[i] < max_depth]
            if eligible:
                return eligible[draw_index(rng, len(eligible))]
        return draw_index(rng, self.n_seeds)

    def run(self, query: Callable, operators: Sequence[Operator], rng: np.random.Generator, budget: int,
            batch_size: int, max_depth: int, feedback: bool) -> None:
        while len(self.growth) < budget and len(self.covered) < self.total:
            count = min(batch_size, budget - len(self.growth))
            parents = [self.parent(rng, feedback, max_depth) for _ in range(count)]
            chosen = [operators[draw_index(rng, len(operators))] for _ in parents]
            mutants = np.stack([op(self.images[p], rng) for p, op in zip(parents, chosen)])
            predictions, combinations = query(mutants)
            for mutant, parent, op, predicted, combination in zip(mutants, parents, chosen, predictions.tolist(),
                                                                   combinations.tolist()):
                preserved = predicted == self.labels[parent]
                self.preserved += int(preserved)
                if preserved and combination not in self.covered:
                    self.covered.add(combination)
                    if feedback:
                        self._keep(mutant, parent, op.name, combination)
                self.growth.append(len(self.covered))

    def _keep(self, mutant: np.ndarray, parent: int, operator: str, combination: int) -> None:
        self.kept.append(len(self.images))
        self.images.append(mutant)
        self.labels.append(self.labels[parent])
        self.origin.append(self.origin[parent])
        self.depth.append(self.depth[parent] + 1)
        self.chain.append(f"{self.chain[parent]}+{operator}" if self.chain[parent] else operator)
        self.new_combinations.append(combination)
