"""The per-seed search interface every strategy implements, in TensorFuzz's spirit.

A search owns one seed, its own ``np.random.Generator`` and its own state. It never calls a
model: the campaign runner asks it for inputs (:meth:`Search.propose`), runs the inputs of many
searches through both models in one batched call, and hands each search its rows of the
probabilities (:meth:`Search.observe`). Because a search's decisions depend only on its own
generator and the probabilities of its own inputs, running seeds in lockstep gives the same
per-seed results as running them one at a time.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Sequence

import numpy as np

from mlflow_di.fuzz.selection import OperatorStats

if TYPE_CHECKING:
    from mlflow_di.fuzz.population import Mutation


class Search(abc.ABC):
    """State of one seed's search; subclasses implement one strategy's loop body."""

    def __init__(self, operator_names: Sequence[str]):
        self.operator_names = list(operator_names)
        self.stats = OperatorStats.zeros(len(self.operator_names))
        self.queries = 0
        self.trigger: np.ndarray | None = None
        self.trigger_probabilities: tuple[np.ndarray, np.ndarray] | None = None
        self.trigger_operators: list[str] = []
        #: mutants rejected before being queried because they left the campaign's constraint
        self.constraint_rejections = 0
        #: True once the search can propose nothing more (no mutant within its constraint)
        self.exhausted = False

    @property
    def found(self) -> bool:
        """True once a triggering input was observed; the search then takes no more queries."""
        return self.trigger is not None

    @abc.abstractmethod
    def propose(self, limit: int | None = None, depth: int = 1, out: np.ndarray | None = None) -> np.ndarray:
        """Next inputs to query, uint8 (k, H, W, C) with 1 <= k <= ``limit`` (when given);
        k = 0 only once the search is :attr:`exhausted`.

        ``depth`` is a hint: the runner could use up to that many inputs from this search in
        its next batched call. A search may propose more than its algorithm needs right now
        (speculatively), as long as its queries, decisions and results do not depend on
        ``depth``.

        ``out``: None, or ``depth`` rows of the runner's batch (a C-contiguous uint8 (depth, H, W, C)
        array) where these inputs will go. A search may write its k <= ``depth`` inputs into
        ``out[:k]`` and return exactly that view, saving the runner a copy of each; the runner
        reuses those rows after :meth:`observe`, so an input the search keeps beyond it (its
        incumbent, a trigger) must be copied. Any other array returned is copied in.
        """

    def plan(self) -> "Mutation | None":
        """The next input as a :class:`~mlflow_di.fuzz.population.Mutation`, drawn but not made, when the
        runner should make it with the other searches' of its step (:func:`~mlflow_di.fuzz.population.apply_mutations`)
        before :meth:`observe`; None when the search makes its inputs itself (:meth:`propose`). The same
        queries, decisions and results either way. By default None."""
        return None

    @abc.abstractmethod
    def observe(self, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        """Probabilities (k, C) of both models for the inputs of the last :meth:`propose`.

        ``queries`` grows by the inputs the algorithm actually used, which can be fewer than k.
        """

    @classmethod
    def observe_all(cls, searches: list["Search"], spans: list[tuple[int, int]], p_original: np.ndarray,
                    p_compressed: np.ndarray) -> None:
        """:meth:`observe` for the searches of one step: ``spans[i]`` = (first row, count) of search i's inputs
        in the step's probabilities. A strategy may score its searches' rows together here; by default each
        search observes its rows in turn."""
        for search, (first, count) in zip(searches, spans):
            search.observe(p_original[first:first + count], p_compressed[first:first + count])

    def _record_trigger(self, image: np.ndarray, p_original: np.ndarray, p_compressed: np.ndarray,
                        operators: list[str]) -> None:
        self.trigger = image
        self.trigger_probabilities = (np.asarray(p_original), np.asarray(p_compressed))
        self.trigger_operators = operators
