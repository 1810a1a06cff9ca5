"""A population's step: the mutations its searches drew, made one operator at a time.

Each DFlare search draws its next mutation from its own generator (a :class:`Mutation`: the operator, the
image it mutates and the values drawn) without making the mutant. The lockstep collects the mutations of
every search of a lane and :func:`apply_mutations` makes them into the lane's batch, the mutations of one
operator together (:meth:`~mlflow_di.fuzz.mutations.TwoStep.apply_many`) in consecutive rows, each with
whether it left its source unchanged. On the CPU that is one mutant after another, the same bytes as the
one-call operators. A device operator (:mod:`~mlflow_di.fuzz.device_mutations`) makes all of its group's
mutants in one batched call where the models run and copies them into the batch's rows at once; a search
that accepts its mutant keeps the device's copy (:meth:`Mutation.kept`), so x_max stays on the device
from step to step and the host handles no image. When both models run on that device too, the batch stays
there (:func:`apply_mutations_on_device`): the models take it as it is, and only a trigger's image comes
to the host.

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

    def image(self) -> np.ndarray:
        """The mutant on the host: its row of the batch, or a copy of the device's mutant when the batch stayed
        there (:func:`apply_mutations_on_device`)."""
        return self.row if self.row is not None else self.made[self.place].cpu().numpy()

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
    placed, on_device = _make(mutations, rows)
    if on_device:
        _hand_out(on_device, _bring_back(on_device, rows), rows)
    return placed


def apply_mutations_on_device(mutations: list[Mutation]):
    """:func:`apply_mutations` for a step whose every operator runs on one device, the batch left there for
    models that run there too (:func:`~mlflow_di.models.classifier.takes_device_batches`): the row of each
    mutation, and the batch (a uint8 tensor on the device). Only whether each mutant equals its source comes
    to the host; a mutation's ``row`` stays None, and a search brings back the one image it records
    (:meth:`Mutation.image`)."""
    import torch

    placed, on_device = _make(mutations, None)
    batch = on_device[0].made if len(on_device) == 1 else torch.cat([group.made for group in on_device])
    # the flags' copy waits for the device's work so far, the batch included: a model that runs on its own
    # CUDA stream (an overlapped campaign's thread) then reads a finished batch
    _hand_out(on_device, torch.cat([group.unchanged for group in on_device]).tolist(), None)
    return placed, batch


def _make(mutations: list[Mutation], rows: np.ndarray | None) -> tuple[list[int], list[_DeviceGroup]]:
    """Each operator's mutations made together in consecutive rows (host operators into ``rows``, device ones
    left on their device as groups); the row of each mutation, and the device groups in row order."""
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
            unchanged = operator.apply_many([m.source for m in group], [m.drawn for m in group], block)
            for offset, (mutation, same) in enumerate(zip(group, unchanged.tolist())):
                mutation.row, mutation.unchanged = block[offset], same
        for offset, number in enumerate(members):
            placed[number] = start + offset
        start += len(group)
    return placed, on_device


def _hand_out(on_device: list[_DeviceGroup], flags: list[bool], rows: np.ndarray | None) -> None:
    """Give each device mutation its row of ``rows`` (None: the batch stays on the device), its flag (in the
    groups' order) and where the device holds its mutant."""
    flags = iter(flags)
    for device_group in on_device:
        for offset, mutation in enumerate(device_group.mutations):
            mutation.row = None if rows is None else rows[device_group.first + offset]
            mutation.unchanged, mutation.made, mutation.place = next(flags), device_group.made, offset


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
