"""Mutation-operator selection: DFlare's Metropolis-Hastings sampler (Algorithm 2) and a uniform one.

Each operator has a rank value v = successes / (selections + 1e-7), where a success is a mutant
that replaced the current best input. Operators are sorted by v, best first (ties broken at
random). Given the rank k_prev of the previous operator, the sampler repeatedly proposes an
operator of uniformly random rank k and accepts it with probability min(1, (1 - p)^(k - k_prev)),
p = 1 / number of operators. So the next operator's rank has the distribution

    P(k) = a_k / sum_j a_j,   a_k = min(1, (1 - p)^(k - k_prev))

(:func:`rank_distribution`): operators ranked above the previous one are always accepted when
proposed, lower-ranked ones geometrically less often.

The reference code looks the previous operator up by name in a list of objects, never finds it
and uses k_prev = -1 every time, so its choice ignores the previous operator:
P(k) proportional to (1 - p)^k. ``reference_bug=True`` reproduces that.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.fuzz._random import draw_index
#: Keeps the rank value finite for operators never selected (as in the paper).
RANK_EPSILON = 1e-7


@dataclasses.dataclass
class OperatorStats:
    """Per-operator counters of one search: times selected and times the mutant was accepted."""

    selected: np.ndarray
    accepted: np.ndarray

    @classmethod
    def zeros(cls, count: int) -> "OperatorStats":
        return cls(np.zeros(count, np.int64), np.zeros(count, np.int64))

    def rank_values(self) -> np.ndarray:
        """v = accepted / (selected + 1e-7) per operator."""
        return self.accepted / (self.selected + RANK_EPSILON)


#: Proposals drawn per round of the Metropolis-Hastings loop: the first accepted one wins, which
#: has the same distribution as proposing one at a time, with one generator call per round.
_PROPOSALS_PER_ROUND = 8


def ranking(values, rng: np.random.Generator) -> list[int]:
    """Operator indices sorted by value, highest first; equal values in random order."""
    return _ranked(list(values), rng.random(len(values)).tolist())


def _ranked(values: list[float], tie_breaks: list[float]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (-values[i], tie_breaks[i]))


def acceptance_probabilities(count: int, previous_rank: int) -> np.ndarray:
    """a_k = min(1, (1 - 1/count)^(k - previous_rank)) for ranks k = 0..count-1."""
    ranks = np.arange(count)
    return np.minimum(1.0, (1.0 - 1.0 / count) ** (ranks - previous_rank))


def rank_distribution(count: int, previous_rank: int) -> np.ndarray:
    """Closed-form probability of each rank being chosen next (see the module docstring)."""
    accept = acceptance_probabilities(count, previous_rank)
    return accept / accept.sum()


class MetropolisHastingsSelector:
    """DFlare's Algorithm 2: choose the next operator given the previous one and the counters."""

    def __init__(self, count: int, reference_bug: bool = False):
        self.count = count
        self.reference_bug = reference_bug
        # Row k_prev + 1 holds the acceptance probability of each rank given k_prev (-1 .. count-1).
        self._acceptance = [acceptance_probabilities(count, k).tolist() for k in range(-1, count)]

    def first(self, rng: np.random.Generator) -> int:
        """The first operator of a search: uniformly random."""
        return draw_index(rng, self.count)

    def next(self, previous: int, stats: OperatorStats, rng: np.random.Generator) -> int:
        # Plain Python on 7 operators: numpy's per-call overhead would dominate (this runs per query).
        count = self.count
        if count == 1 and self.reference_bug:
            return 0  # k_prev = -1 gives the only rank an acceptance of (1 - 1)^1 = 0: the loop would never end
        draws = rng.random(count + 2 * _PROPOSALS_PER_ROUND).tolist()
        values = [a / (s + RANK_EPSILON) for a, s in zip(stats.accepted.tolist(), stats.selected.tolist())]
        order = _ranked(values, draws[:count])  # the same floats as stats.rank_values()
        previous_rank = -1 if self.reference_bug else order.index(previous)
        acceptance = self._acceptance[previous_rank + 1]
        proposals = draws[count:]
        while True:
            for j in range(0, len(proposals), 2):
                rank = int(proposals[j] * count)
                if proposals[j + 1] < acceptance[rank]:
                    return order[rank]
            proposals = rng.random(2 * _PROPOSALS_PER_ROUND).tolist()


class UniformSelector:
    """DFlare_R's ablation: every operator equally likely, whatever happened before."""

    def __init__(self, count: int):
        self.count = count

    def first(self, rng: np.random.Generator) -> int:
        return draw_index(rng, self.count)

    def next(self, previous: int, stats: OperatorStats, rng: np.random.Generator) -> int:
        return draw_index(rng, self.count)
