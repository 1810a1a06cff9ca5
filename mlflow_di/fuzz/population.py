"""A population's step: the mutations its searches drew, made one operator at a time.

Each DFlare search draws its next mutation from its own generator (a :class:`Mutation`: the operator, the
image it mutates and the values drawn) without making the mutant. The lockstep collects the mutations of
every search of a lane and :func:`apply_mutations` makes them into the lane's batch, the mutations of one
operator together (:meth:`~mlflow_di.fuzz.mutations.TwoStep.apply_many`) in consecutive rows, each with
whether it left its source unchanged. On the CPU that is one mutant after another, the same bytes as the
one-call operators. A device operator (:mod:`~mlflow_di.fuzz.device_mutations`) makes all of its group's
mutants in one batched call where the models run and copies them into the batch's rows at once; a search
that accepts its mutant keeps the device's copy (:meth:`Mutation.kept`), so x_max stays on the device
from step to step and the host handles no image.

A seed's mutant depends only on its own draws and its own x_max, never on which other seeds share the
step, so records stay those of the seed searched alone.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mlflow_di.fuzz.mutations import TwoStep


@dataclasses.dataclass
class Mutation:
    """One search's next input, drawn but not yet made: ``operator`` applied to ``source`` (its x_max, a
    NumPy image or the device's copy of one) with the values ``drawn``. :func:`apply_mutations` writes the
    mutant into ``row``, sets ``unchanged``, and where the device has the mutant (``made``, ``place``; None on
    the host)."""

    operator: TwoStep
    source: object
    drawn: object
    row: np.ndarray | None = None
    unchanged: bool | None = None
    #: the device's mutants of the operator's group (a tensor) and this one's place among them
    made: object = None
    place: int = 0

    def kept(self):
        """The mutant as its search keeps it past the step (the runner reuses its row): a copy of the row, or
        of the device's mutant, which stays on the device for the next step's mutations."""
        return self.row.copy() if self.made is None else self.made[self.place].clone()


def apply_mutations(mutations: list[Mutation], rows: np.ndarray) -> list[int]:
    """Make every mutation into ``rows`` (as many consecutive rows of the batch as mutations), those of one
    operator in one ``apply_many`` call on consecutive rows; the row of each mutation, in the given order."""
    groups: dict[int, list[int]] = {}
    for number, mutation in enumerate(mutations):
        groups.setdefault(id(mutation.operator), []).append(number)
    placed = [0] * len(mutations)
    start = 0
    for members in groups.values():
        group = [mutations[number] for number in members]
        block = rows[start:start + len(group)]
        unchanged, made = group[0].operator.apply_many([m.source for m in group], [m.drawn for m in group], block)
        for offset, (number, mutation, same) in enumerate(zip(members, group, unchanged.tolist())):
            mutation.row, mutation.unchanged, mutation.made, mutation.place = block[offset], same, made, offset
            placed[number] = start + offset
        start += len(group)
    return placed


def on_host(image) -> np.ndarray:
    """``image`` as a NumPy array: itself, or the device's copy brought back (a search leaving the population's
    step for its own proposals, under speculation)."""
    return image if isinstance(image, np.ndarray) else image.cpu().numpy()
