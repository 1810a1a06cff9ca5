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
from typing import NamedTuple

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


class _DeviceGroup(NamedTuple):
    """One device operator's mutations of a step, made where it runs: their first row in the batch, the
    mutants and whether each equals its source (tensors on the device, until :func:`_bring_back`)."""

    mutations: list[Mutation]
    first: int
    made: object
    unchanged: object

    @property
    def end(self) -> int:
        return self.first + len(self.mutations)


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
    on_device: list[_DeviceGroup] = []
    start = 0
    for members in groups.values():
        group = [mutations[number] for number in members]
        operator = group[0].operator
        if operator.device is not None:  # a device operator (TwoStep.device)
            on_device.append(_DeviceGroup(group, start, *operator.make_many([m.source for m in group],
                                                                            [m.drawn for m in group])))
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
        for device_group in on_device:
            for offset, mutation in enumerate(device_group.mutations):
                mutation.row, mutation.unchanged = rows[device_group.first + offset], next(flags)
                mutation.made, mutation.place = device_group.made, offset
    return placed


def _bring_back(on_device: list[_DeviceGroup], rows: np.ndarray) -> list[bool]:
    """The device groups' mutants copied into their rows, one copy per run of consecutive groups (one in all
    when every operator runs on the device); whether each left its source unchanged, in one more copy."""
    import torch

    runs: list[list[_DeviceGroup]] = []
    for group in on_device:
        if runs and runs[-1][-1].end == group.first:
            runs[-1].append(group)
        else:
            runs.append([group])
    for run in runs:
        made = run[0].made if len(run) == 1 else torch.cat([group.made for group in run])
        torch.from_numpy(rows[run[0].first:run[-1].end]).copy_(made)
    return torch.cat([group.unchanged for group in on_device]).tolist()


def on_host(image) -> np.ndarray:
    """``image`` as a NumPy array: itself, or the device's copy brought back (a search leaving the population's
    step for its own proposals, under speculation)."""
    return image if isinstance(image, np.ndarray) else image.cpu().numpy()
