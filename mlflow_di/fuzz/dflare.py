"""DFlare (Tian et al., TOSEM): Algorithm 1 for one seed, and its two ablations.

    x_max <- x_s; op <- random operator
    repeat until the seed's time or query budget is spent:
        x <- op(x_max)                              one query: x through both models
        if top1(f(x)) != top1(g(x)): return x      a triggering input
        if H(x) >= H(x_max): x_max <- x; op's success count += 1
        op <- select(op)                            Metropolis-Hastings over ranked operators

H(x) = D(x) / delta + O(x): D is the gap between the two models' top-1 probabilities, O is 1
when the pair of probability vectors is unlike every pair seen for this seed so far. The seed's
pair is the first one remembered, and every accepted x_max's pair is in the memory by the
time a mutant is compared with it, so O(x_max) = 0 and the test reads
D(x) / delta + O(x) >= D(x_max) / delta (as in the reference, whose comparison never uses the
incumbent's novelty). The ablations: ``dflare-d`` drops O (H = D / delta), ``dflare-r`` picks
operators uniformly at random.

Differences from the reference code are deliberate and follow the paper: acceptance is
H(x) >= H(x_max) (the reference also accepts a *drop* of D by more than 1e-3), and the
selector uses the true rank of the previous operator (``reference_bug=True`` gives the
reference's k_prev = -1).

So that a seed's search does not depend on which other seeds share its batched model call
(float results differ in the last bits between batch compositions), gaps are compared at
1e-6 resolution and an unchanged mutant is accepted without consulting its re-computed floats.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from mlflow_di.fuzz.fitness import (DEFAULT_DELTA, DEFAULT_NOVELTY_THRESHOLD, NoveltyMemory, dflare_fitness,
                                    labels_differ, probability_pair, top1_gap)
from mlflow_di.fuzz.mutations import Operator, default_operators, operator_names
from mlflow_di.fuzz.search import Search
from mlflow_di.fuzz.selection import MetropolisHastingsSelector, UniformSelector

SELECTIONS = ("metropolis-hastings", "uniform")


@dataclasses.dataclass(frozen=True)
class DFlare:
    """The DFlare strategy and its ablations, as settings of the same loop.

    ``novelty=False`` is DFlare_D, ``selection='uniform'`` is DFlare_R; ``reference_bug=True``
    makes Metropolis-Hastings ignore the previous operator as the reference code does.
    """

    name: str = "dflare"
    novelty: bool = True
    selection: str = "metropolis-hastings"
    reference_bug: bool = False
    delta: float = DEFAULT_DELTA
    novelty_threshold: float = DEFAULT_NOVELTY_THRESHOLD
    operators: tuple[Operator, ...] = dataclasses.field(default_factory=default_operators)

    def __post_init__(self):
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        operator_names(self.operators)

    def options(self) -> dict:
        """The settings that change results, for the campaign's config record."""
        return {"novelty": self.novelty, "selection": self.selection, "reference_bug": self.reference_bug,
                "delta": self.delta, "novelty_threshold": self.novelty_threshold,
                "operators": [repr(op) for op in self.operators]}

    def start(self, seed_image: np.ndarray, p_original: np.ndarray, p_compressed: np.ndarray,
              rng: np.random.Generator) -> "DFlareSearch":
        return DFlareSearch(self, seed_image, p_original, p_compressed, rng)


class DFlareSearch(Search):
    """One seed's DFlare loop; one input per :meth:`propose`."""

    def __init__(self, strategy: DFlare, seed_image: np.ndarray, p_original: np.ndarray,
                 p_compressed: np.ndarray, rng: np.random.Generator):
        super().__init__(operator_names(strategy.operators))
        self._operators: Sequence[Operator] = strategy.operators
        self._delta = strategy.delta
        self._rng = rng
        count = len(self._operators)
        self._selector = (UniformSelector(count) if strategy.selection == "uniform"
                          else MetropolisHastingsSelector(count, strategy.reference_bug))
        self._memory = NoveltyMemory(strategy.novelty_threshold) if strategy.novelty else None
        self.best = seed_image
        self.best_gap = self._score(p_original, p_compressed)[0]
        self._accepted_chain: list[int] = []
        self._operator = self._selector.first(rng)
        self._candidate: np.ndarray | None = None

    def _score(self, p_original: np.ndarray, p_compressed: np.ndarray) -> tuple[float, bool]:
        """D(x), and O(x) (remembering the pair when it is novel)."""
        novel = self._memory.observe(probability_pair(p_original, p_compressed)) if self._memory is not None else False
        return top1_gap(p_original, p_compressed), novel

    def propose(self, limit: int | None = None) -> np.ndarray:
        self._candidate = self._operators[self._operator](self.best, self._rng)
        self.stats.selected[self._operator] += 1
        return self._candidate[None]

    def observe(self, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        p_original, p_compressed = p_original[0], p_compressed[0]
        self.queries += 1
        if self._candidate.tobytes() == self.best.tobytes():
            # An unchanged image (e.g. a 1x1 blur) behaves exactly like x_max: no trigger, H(x) = H(x_max),
            # so it is accepted. Deciding this from the image rather than from re-computed floats keeps
            # the decision independent of the batch the input was computed in (floats can differ in
            # the last bits between batch compositions, which would flip this tie).
            self._accept(self.best_gap)
        elif labels_differ(p_original, p_compressed):
            chain = [self.operator_names[i] for i in self._accepted_chain + [self._operator]]
            self._record_trigger(self._candidate, p_original, p_compressed, chain)
            return
        else:
            gap, novel = self._score(p_original, p_compressed)
            if dflare_fitness(gap, novel, self._delta) >= dflare_fitness(self.best_gap, False, self._delta):
                self._accept(gap)
        self._operator = self._selector.next(self._operator, self.stats, self._rng)

    def _accept(self, gap: float) -> None:
        """The candidate becomes x_max; its operator scores a success."""
        self.best, self.best_gap = self._candidate, gap
        self.stats.accepted[self._operator] += 1
        self._accepted_chain.append(self._operator)
