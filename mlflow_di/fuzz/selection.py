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
import functools

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
        self._acceptance_table = np.array(self._acceptance)

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
        chosen = _first_kept(draws[count:], order, acceptance)
        return chosen if chosen is not None else self._after_first_round(order, acceptance, rng)

    def next_many(self, previous: list[int], stats: list[OperatorStats], rngs: list) -> list[int]:
        """:meth:`next` for several searches at once (each with its own counters and generator): the same
        draws from each generator and the same choices, with the ranking and the first round of proposals
        computed for all of them in a few NumPy calls."""
        count, rows = self.count, len(previous)
        if count == 1 and self.reference_bug:
            return [0] * rows
        draws = np.stack([rng.random(count + 2 * _PROPOSALS_PER_ROUND) for rng in rngs])
        values = np.stack([s.accepted for s in stats]) / (np.stack([s.selected for s in stats]) + RANK_EPSILON)
        order = np.lexsort((draws[:, :count], -values), axis=-1)  # by value, best first; ties by their draw
        every = np.arange(rows)
        previous_rank = (np.full(rows, -1) if self.reference_bug
                         else np.argmax(order == np.asarray(previous)[:, None], axis=1))
        acceptance = self._acceptance_table[previous_rank + 1]
        proposals = draws[:, count:]
        ranks = (proposals[:, 0::2] * count).astype(np.intp)
        accepted = proposals[:, 1::2] < np.take_along_axis(acceptance, ranks, axis=1)
        first = accepted.argmax(axis=1)
        chosen = order[every, ranks[every, first]].tolist()
        for row in np.flatnonzero(~accepted.any(axis=1)).tolist():  # no proposal of the first round kept
            chosen[row] = self._after_first_round(order[row].tolist(), acceptance[row].tolist(), rngs[row])
        return chosen

    @staticmethod
    def _after_first_round(order: list[int], acceptance: list[float], rng: np.random.Generator) -> int:
        """The operator of the first proposal kept in the rounds after the first (drawn round by round)."""
        while True:
            chosen = _first_kept(rng.random(2 * _PROPOSALS_PER_ROUND).tolist(), order, acceptance)
            if chosen is not None:
                return chosen


def _first_kept(proposals: list[float], order: list[int], acceptance: list[float]) -> int | None:
    """The operator of the first (rank, test) pair of a round of ``proposals`` whose rank is kept (its test
    below the rank's acceptance); None when the round keeps none."""
    count = len(order)
    for j in range(0, len(proposals), 2):
        rank = int(proposals[j] * count)
        if proposals[j + 1] < acceptance[rank]:
            return order[rank]
    return None


class UniformSelector:
    """DFlare_R's ablation: every operator equally likely, whatever happened before."""

    def __init__(self, count: int):
        self.count = count

    def first(self, rng: np.random.Generator) -> int:
        return draw_index(rng, self.count)

    def next(self, previous: int, stats: OperatorStats, rng: np.random.Generator) -> int:
        return draw_index(rng, self.count)

    def next_many(self, previous: list[int], stats: list[OperatorStats], rngs: list) -> list[int]:
        return [draw_index(rng, self.count) for rng in rngs]


@functools.cache
def shared_selector(uniform: bool, count: int, reference_bug: bool = False):
    """One selector per kind and operator count, shared by every search that uses it (a selector keeps no
    state of its own), so that a step's searches choose their next operators in one call (``next_many``)."""
    return UniformSelector(count) if uniform else MetropolisHastingsSelector(count, reference_bug)
