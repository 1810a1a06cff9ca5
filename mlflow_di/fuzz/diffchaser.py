"""DiffChaser (Xie et al., IJCAI 2019), the genetic-algorithm baseline of the DFlare paper.

No official code was released; this follows the paper's Algorithm 1:

    X <- population of m mutants of the seed
    repeat until the budget is spent:
        evaluate X (one query per new chromosome); if some x in X is a triggering input, return it
        for every chromosome except the fittest (kept as is):
            X[i] <- mutate(crossover(select(X), select(X)), rate)

with the k-uncertainty fitness (:func:`~mlflow_di.fuzz.fitness.k_uncertainty`, minimised),
binary tournament selection, uniform pixel-wise crossover and, with probability
``mutation_rate``, one of DFlare's mutation operators as the mutation step (the same
operators, so the two strategies differ only in how they search). Children are bred from the
previous generation (generational replacement). When a generation holds several triggering
inputs, the first counts, and queries are counted up to it, as if evaluated one by one.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.fuzz._random import draw_index
from mlflow_di.fuzz.mutations import Operator, default_operators, operator_names
from mlflow_di.fuzz.search import Search

CROSSOVER = "crossover"


@dataclasses.dataclass(frozen=True)
class DiffChaser:
    """The DiffChaser strategy: population size, mutation rate, tournament size, k."""

    name: str = "diffchaser"
    population_size: int = 100
    mutation_rate: float = 0.5
    tournament_size: int = 2
    k: int = 2
    operators: tuple[Operator, ...] = dataclasses.field(default_factory=default_operators)

    def __post_init__(self):
        if self.population_size < 2:
            raise ValueError("DiffChaser needs a population of at least 2")
        if not 0.0 <= self.mutation_rate <= 1.0:
            raise ValueError("mutation_rate must be in [0, 1]")
        operator_names(self.operators)

    def options(self) -> dict:
        return {"population_size": self.population_size, "mutation_rate": self.mutation_rate,
                "tournament_size": self.tournament_size, "k": self.k,
                "operators": [repr(op) for op in self.operators]}

    def start(self, seed_image: np.ndarray, p_original: np.ndarray, p_compressed: np.ndarray,
              rng: np.random.Generator) -> "DiffChaserSearch":
        return DiffChaserSearch(self, seed_image, rng)


def k_uncertainties(p_original: np.ndarray, p_compressed: np.ndarray, k: int) -> np.ndarray:
    """Row-wise :func:`~mlflow_di.fuzz.fitness.k_uncertainty` for (n, C) probability arrays."""
    k = min(k, p_compressed.shape[1])
    kth = np.partition(p_compressed, -k, axis=1)[:, -k]
    return np.abs(p_original.max(axis=1) - kth)


class DiffChaserSearch(Search):
    """One seed's genetic search; proposes a whole generation at a time."""

    def __init__(self, strategy: DiffChaser, seed_image: np.ndarray, rng: np.random.Generator):
        super().__init__(operator_names(strategy.operators))
        self._strategy = strategy
        self._operators = strategy.operators
        self._rng = rng
        self._seed = seed_image
        self.population: np.ndarray | None = None   # (m, H, W, C)
        self.fitness: np.ndarray | None = None      # (m,), higher is better (= -k-uncertainty)
        # Lineage as linked (operator, parent) pairs: O(1) per child, unrolled only for the trigger.
        self._lineage: list = []
        self._slots: np.ndarray | None = None        # population slots of the proposed children
        self._candidates: np.ndarray | None = None
        self._candidate_lineage: list = []

    def propose(self, limit: int | None = None) -> np.ndarray:
        if self.population is None:
            images, lineage = self._initial_population()
            slots = np.arange(len(images))
        else:
            slots = np.delete(np.arange(len(self.population)), int(np.argmax(self.fitness)))
            images, lineage = self._children(len(slots))
        if limit is not None:
            images, lineage, slots = images[:limit], lineage[:limit], slots[:limit]
        self._candidates, self._candidate_lineage, self._slots = images, lineage, slots
        return images

    def _mutate(self, image: np.ndarray, lineage):
        index = draw_index(self._rng, len(self._operators))
        self.stats.selected[index] += 1
        return self._operators[index](image, self._rng), (self.operator_names[index], lineage)

    def _initial_population(self):
        mutants = [self._mutate(self._seed, None) for _ in range(self._strategy.population_size)]
        return np.stack([image for image, _ in mutants]), [lineage for _, lineage in mutants]

    def _tournament(self, count: int) -> np.ndarray:
        entrants = self._rng.integers(0, len(self.population), (count, self._strategy.tournament_size))
        return entrants[np.arange(count), np.argmax(self.fitness[entrants], axis=1)]

    def _children(self, count: int):
        first, second = self._tournament(count), self._tournament(count)
        height, width = self.population.shape[1:3]
        take_first = self._rng.random((count, height, width, 1)) < 0.5
        children = np.where(take_first, self.population[first], self.population[second])
        mutate = self._rng.random(count) < self._strategy.mutation_rate
        lineage = []
        for i in range(count):
            crossed = (CROSSOVER, self._lineage[first[i]])
            if mutate[i]:
                children[i], crossed = self._mutate(children[i], crossed)
            lineage.append(crossed)
        return children, lineage

    def observe(self, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        differ = np.flatnonzero(p_original.argmax(axis=1) != p_compressed.argmax(axis=1))
        if len(differ):
            first = int(differ[0])
            self.queries += first + 1
            self._record_trigger(self._candidates[first], p_original[first], p_compressed[first],
                                 _unroll(self._candidate_lineage[first]))
            return
        self.queries += len(self._candidates)
        fitness = -k_uncertainties(p_original, p_compressed, self._strategy.k)
        if self.population is None:
            self.population, self.fitness, self._lineage = self._candidates, fitness, list(self._candidate_lineage)
            return
        self.population[self._slots] = self._candidates
        self.fitness[self._slots] = fitness
        for slot, lineage in zip(self._slots, self._candidate_lineage):
            self._lineage[slot] = lineage


def _unroll(lineage) -> list[str]:
    """Linked (operator, parent) pairs -> operator names from the seed onwards."""
    names = []
    while lineage is not None:
        names.append(lineage[0])
        lineage = lineage[1]
    return names[::-1]
