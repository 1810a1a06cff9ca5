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
    operator in one call on consecutive rows; the row of each mutation, in the given order.

    A device operator's group is made where it runs (``make_many``) and left there until every group is
    made; then :func:`_bring_back` copies all of them into their rows at once (each copy from a GPU waits
    for it, so a copy per operator made the host wait seven times a step)."""
    groups: dict[int, list[int]] = {}
    for number, mutation in enumerate(mutations):
        groups.setdefault(id(mutation.operator), []).append(number)
    placed = [0] * len(mutations)
    on_device: list[tuple[list[Mutation], int, object, object]] = []
    start = 0
    for members in groups.values():
        group = [mutations[number] for number in members]
        operator = group[0].operator
        if operator.device is not None:  # a device operator (TwoStep.device)
            made, unchanged = operator.make_many([m.source for m in group], [m.drawn for m in group])
            on_device.append((group, start, made, unchanged))
        else:
            block = rows[start:start + len(group)]
            unchanged, _ = operator.apply_many([m.source for m in group], [m.drawn for m in group], block)
            for offset, (mutation, same) in enumerate(zip(group, unchanged.tolist())):
                mutation.row, mutation.unchanged = block[offset], same
        for offset, number in enumerate(members):
            placed[number] = start + offset
        start += len(group)
    if on_device:
        flags = iter(_bring_back(on_device, rows))
        for group, first, made, _ in on_device:
            for offset, mutation in enumerate(group):
                mutation.row, mutation.unchanged = rows[first + offset], next(flags)
                mutation.made, mutation.place = made, offset
    return placed


def _bring_back(on_device: list[tuple[list[Mutation], int, object, object]], rows: np.ndarray) -> list[bool]:
    """The device groups' mutants copied into their rows, one copy per run of consecutive groups (one in all
    when every operator runs on the device); whether each left its source unchanged, in one more copy."""
    import torch

    runs: list[list[tuple[list[Mutation], int, object, object]]] = []
    for entry in on_device:
        if runs and runs[-1][-1][1] + len(runs[-1][-1][0]) == entry[1]:
            runs[-1].append(entry)
        else:
            runs.append([entry])
    for run in runs:
        first, count = run[0][1], sum(len(group) for group, *_ in run)
        made = run[0][2] if len(run) == 1 else torch.cat([entry[2] for entry in run])
        torch.from_numpy(rows[first:first + count]).copy_(made)
    return torch.cat([unchanged for *_, unchanged in on_device]).tolist()


def on_host(image) -> np.ndarray:
    """``image`` as a NumPy array: itself, or the device's copy brought back (a search leaving the population's
    step for its own proposals, under speculation)."""
    return image if isinstance(image, np.ndarray) else image.cpu().numpy()
