"""DiffChaser (Xie, Ma, Wang, Li, Liu, Li: "DiffChaser: Detecting Disagreements for Deep Neural
Networks", IJCAI 2019), the genetic-algorithm baseline of the DFlare paper.

No official code was released (the paper says it was implemented on Keras 2.1.3 / TensorFlow
1.5.0 and gives no link; the DFlare repository ships only DiffChaser's *models*, not its code).

What the paper's Algorithm 1 says (verified from the paper's pseudocode), and how it maps here::

    construct an initial population X of m chromosomes from the input x
    while True:
        if timeout or too many iterations: return failed      -> the campaign's timeout / max_queries
        compute the fitness of the chromosomes in X            -> one query per new chromosome
        if some x_d in X is a disagreement: return x_d
        for i in 0..m-1:
            if X[i] has the best fitness: continue               -> elitism: the fittest is kept
            select two chromosomes x1, x2 from X
            X[i] := crossover(x1, x2)
            X[i] := mutate(X[i], r2)                            -> r2: the mutation rate

A chromosome is an image; crossover and mutation act on its pixels; the fitness is the
k-uncertainty across the two models, which the search minimises.

What could not be verified (the paper's body was not retrievable here) and is therefore a
documented guess, chosen before measuring and not tuned:

* **fitness** (:func:`k_uncertainties`): ``|p_f[top-1 of f] - p_g[k-th most likely of g]|``,
  ``k = 2``; the paper names k-uncertainty, a basic and a t-targeted fitness, all of which
  make the input *uncertain* by shrinking a gap between predicted probabilities.
* **mutation** (:class:`PixelNoise`): each pixel value is perturbed with probability ``r2`` by a
  uniform integer in ``[-step, step]`` and kept within ``linf_bound`` of the seed (and 0..255).
  The numbers (r2 = 0.05, step = 0.15 x 0.3 x 255 ~ 11, bound = 0.3 x 255 ~ 77 levels) are those
  of GenAttack (Alzantot et al., GECCO 2019) on MNIST, the closest published black-box image GA
  of the same year; DiffChaser's own values are unknown.
* **initial population**: ``m`` mutants of the seed (mutate(x, r2) each); **m = 100**.
* **selection**: binary tournament on the fitness; **crossover**: uniform, each pixel from
  either parent with probability 1/2. Children are bred from the evaluated generation (the
  pseudocode overwrites X[i] in place, which would let later selections see unevaluated
  children).
* **queries**: only new chromosomes are sent to the models (the elite's outputs are known);
  when a generation holds several disagreements, the first counts, and queries are counted up
  to it, as if the chromosomes were evaluated one by one. Both choices favour DiffChaser.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.fuzz.fitness import GAP_RESOLUTION_DIGITS, labels_differ
from mlflow_di.fuzz.search import Search

CROSSOVER = "crossover"


@dataclasses.dataclass(frozen=True)
class PixelNoise:
    """DiffChaser's mutation: each pixel value, with probability ``rate``, moves by a uniform
    integer in [-step, step]; values stay in 0..255 and within ``linf_bound`` levels of the seed
    (``None``: no bound)."""

    rate: float = 0.05
    step: int = 11
    linf_bound: int | None = 77
    name: str = "pixel_noise"

    def __post_init__(self):
        if not 0.0 < self.rate <= 1.0:
            raise UserError(f"mutation rate must be in (0, 1], got {self.rate}")
        if self.step < 1:
            raise UserError(f"mutation step must be at least 1 pixel level, got {self.step}")
        if self.linf_bound is not None and self.linf_bound < 1:
            raise UserError(f"linf_bound must be at least 1 pixel level (or None), got {self.linf_bound}")

    def limits(self, seed_image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lowest and highest value each pixel may take (int16, the seed's shape)."""
        seed = seed_image.astype(np.int16)
        if self.linf_bound is None:
            return np.zeros_like(seed), np.full_like(seed, 255)
        return np.maximum(seed - self.linf_bound, 0), np.minimum(seed + self.linf_bound, 255)

    def __call__(self, images: np.ndarray, limits: tuple[np.ndarray, np.ndarray],
                 rng: np.random.Generator) -> np.ndarray:
        """Mutate a batch (n, H, W, C) of chromosomes in place and return it."""
        chosen = np.flatnonzero(rng.random(images.size) < self.rate)
        if len(chosen) == 0:
            return images
        flat = images.reshape(-1)
        noise = (rng.random(len(chosen)) * (2 * self.step + 1)).astype(np.int16) - self.step
        position = chosen % limits[0].size  # the pixel within one image, for the seed's limits
        values = flat[chosen].astype(np.int16) + noise
        flat[chosen] = np.clip(values, limits[0].reshape(-1)[position], limits[1].reshape(-1)[position])
        return images


@dataclasses.dataclass(frozen=True)
class DiffChaser:
    """The DiffChaser strategy: population size, tournament size, k, and the pixel mutation."""

    name: str = "diffchaser"
    population_size: int = 100
    tournament_size: int = 2
    k: int = 2
    mutation: PixelNoise = dataclasses.field(default_factory=PixelNoise)

    def __post_init__(self):
        if self.population_size < 2:
            raise UserError("DiffChaser needs a population of at least 2")
        if self.tournament_size < 1:
            raise UserError("tournament_size must be at least 1")
        if self.k < 1:
            raise UserError("k must be at least 1")

    def options(self) -> dict:
        """The settings that change results, for the campaign's config record."""
        return {"population_size": self.population_size, "tournament_size": self.tournament_size, "k": self.k,
                "mutation": repr(self.mutation)}

    def start(self, seed_image: np.ndarray, p_original: np.ndarray, p_compressed: np.ndarray,
              rng: np.random.Generator) -> "DiffChaserSearch":
        return DiffChaserSearch(self, seed_image, rng)


def k_uncertainties(p_original: np.ndarray, p_compressed: np.ndarray, k: int) -> np.ndarray:
    """Row-wise :func:`~mlflow_di.fuzz.fitness.k_uncertainty` for (n, C) probability arrays,
    rounded to 1e-6 like DFlare's gaps, so that float noise between batch compositions cannot
    decide a tournament (a seed's search stays independent of the seeds it shares a call with)."""
    k = min(k, p_compressed.shape[1])
    kth = np.partition(p_compressed, -k, axis=1)[:, -k]
    return np.round(np.abs(p_original.max(axis=1).astype(np.float64) - kth), GAP_RESOLUTION_DIGITS)


class DiffChaserSearch(Search):
    """One seed's genetic search; proposes a whole generation at a time.

    Operator statistics: 'pixel_noise' counts mutated chromosomes (selected) and never accepts
    a single mutation; a trigger's operator list is its first-parent lineage from the seed,
    'crossover' and 'pixel_noise' per generation.
    """

    def __init__(self, strategy: DiffChaser, seed_image: np.ndarray, rng: np.random.Generator):
        super().__init__([strategy.mutation.name])
        self._strategy = strategy
        self._mutation = strategy.mutation
        self._limits = strategy.mutation.limits(seed_image)
        self._rng = rng
        self._seed = seed_image
        self.population: np.ndarray | None = None   # (m, H, W, C)
        self.fitness: np.ndarray | None = None      # (m,), higher is better (= -k-uncertainty)
        # Lineage as linked (operator, parent) pairs: O(1) per child, unrolled only for the trigger.
        self._lineage: list = []
        self._slots: np.ndarray | None = None        # population slots of the proposed children
        self._candidates: np.ndarray | None = None
        self._candidate_lineage: list = []

    def propose(self, limit: int | None = None, depth: int = 1, out: np.ndarray | None = None) -> np.ndarray:
        # a generation is already a batch: no speculation (``depth`` is ignored); ``out`` is ignored too (the
        # runner copies the generation in)
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

    def _initial_population(self):
        count = self._strategy.population_size
        images = self._mutation(np.repeat(self._seed[None], count, axis=0), self._limits, self._rng)
        self.stats.selected[0] += count
        return images, [(self._mutation.name, None)] * count

    def _tournament(self, count: int) -> np.ndarray:
        entrants = self._rng.integers(0, len(self.population), (count, self._strategy.tournament_size))
        return entrants[np.arange(count), np.argmax(self.fitness[entrants], axis=1)]

    def _children(self, count: int):
        first, second = self._tournament(count), self._tournament(count)
        height, width = self.population.shape[1:3]
        take_first = self._rng.random((count, height, width, 1)) < 0.5
        children = self._mutation(np.where(take_first, self.population[first], self.population[second]),
                                  self._limits, self._rng)
        self.stats.selected[0] += count
        name = self._mutation.name
        lineage = [(name, (CROSSOVER, self._lineage[parent])) for parent in first]
        return children, lineage

    def observe(self, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        differ = np.flatnonzero(labels_differ(p_original, p_compressed))
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
