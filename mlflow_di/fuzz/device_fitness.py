"""DFlare's scoring of a step on the operators' device: every row's facts and novelty at once.

When a campaign's mutants are made on a device (:mod:`~mlflow_di.fuzz.device_mutations`), the searches'
per-query scoring is the host's largest remaining share of a query. :func:`step_facts` computes it for all
the searches of a step where the operators run: the two models' probabilities go there once, and the
top-1 labels, NaN checks, each row's two largest values and each row's distance to its search's novelty
memory (:class:`DeviceNoveltyMemory`, kept on the device) come back as one small array per quantity. Each
search then decides as it would alone (:meth:`~mlflow_di.fuzz.dflare.DFlareSearch.observe_all`).

The numbers are those of :mod:`~mlflow_di.fuzz.fitness` (the same two largest values, the same float64
distances) except for the order in which a distance's 2C squared differences are added, which may move its
last bits; a campaign's records on the device differ from its CPU records anyway (the noise operators'
values), and stay reproducible on their device.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.fuzz.fitness import DEFAULT_NOVELTY_THRESHOLD, LIST_SCORING_MAX_CLASSES, RowFacts


class DeviceNoveltyMemory:
    """:class:`~mlflow_di.fuzz.fitness.NoveltyMemory` with its points in a float64 tensor on ``device``: a point
    is novel when its squared L2 distance to every remembered one exceeds ``threshold``. Like the host memory,
    the points live in a buffer that doubles when full, so remembering one is one row's copy (a tensor grown by
    concatenation copied every point remembered so far, each time)."""

    def __init__(self, threshold: float = DEFAULT_NOVELTY_THRESHOLD, device: str = "cpu", capacity: int = 64):
        self.threshold, self.device = threshold, device
        self._buffer = None  # (capacity, 2C) float64 tensor on the device; its first _size rows are remembered
        self._remembered = None  # the view of those rows (kept: a tensor slice costs microseconds per step)
        self._first: np.ndarray | None = None  # the seed's pair, sent to the device with the first step
        self._size = 0
        self._capacity = capacity

    def __len__(self) -> int:
        return self._size

    @property
    def points(self):
        """The remembered points, a (M, 2C) float64 tensor on the device (a view of the buffer)."""
        self._send_first()
        return self._remembered

    def _send_first(self) -> None:
        """The seed's pair, waiting on the host since the search started, into the buffer's first row."""
        if self._first is not None:
            import torch

            first, self._first = self._first, None
            self._write(torch.from_numpy(first).to(self.device), 0)
            self._remembered = self._buffer[:1]

    def observe(self, point) -> bool:
        """True (and remember the point) when it is novel, else False: one point, as the host memory does (the
        seed's pair, which the search observes when it starts, waits on the host for the first step)."""
        point = np.asarray(point, np.float64).reshape(-1)
        if self._size == 0:
            self._first, self._size = point.copy(), 1
            return True
        import torch

        point = torch.from_numpy(point).to(self.device)
        if ((self.points - point) ** 2).sum(dim=1).min().item() <= self.threshold:
            return False
        self.remember(point)
        return True

    def remember(self, point) -> None:
        """Add ``point`` (a float64 row on the device) to the memory."""
        self._send_first()
        self._write(point, self._size)
        self._size += 1
        self._remembered = self._buffer[:self._size]

    def _write(self, point, row: int) -> None:
        """``point`` into the buffer's ``row``, the buffer made or doubled first when needed."""
        import torch

        if self._buffer is None:
            self._buffer = point.new_empty((self._capacity, point.numel()))
        elif row == len(self._buffer):
            self._buffer = torch.cat([self._buffer, torch.empty_like(self._buffer)])
        self._buffer[row] = point


def step_facts(p_original: np.ndarray, p_compressed: np.ndarray, device, memories: list) -> list[RowFacts]:
    """:func:`~mlflow_di.fuzz.fitness.row_facts` of a step's rows computed on ``device``, and for the rows whose
    ``memories[i]`` is a :class:`DeviceNoveltyMemory`, whether the row is novel to it (``novel``) and its
    probability pair there (``pair``, for the memory to keep when the search scores the row).

    Every quantity comes back in one copy (each copy from a GPU waits for it): the labels' disagreement, the
    NaN checks, each row's two largest values (float32, exact in float64) and the novelty distances, packed
    side by side in one float64 vector."""
    import torch

    both = torch.from_numpy(np.stack([p_original, p_compressed])).to(device)  # (2, N, C)
    count = both.shape[1]
    rows, nearest, pairs = _novelty(both, memories)
    parts = [(both[0].argmax(dim=1) != both[1].argmax(dim=1)).to(torch.float64)]
    short = both.shape[2] <= LIST_SCORING_MAX_CLASSES
    if not short:
        parts.append(torch.isnan(both[0].sum(dim=1) + both[1].sum(dim=1)).to(torch.float64))
        parts.append(both.topk(2, dim=2).values.flip(-1).to(torch.float64).reshape(-1))  # [second, first] per row
    parts.append(nearest)
    packed = torch.cat(parts).cpu().numpy()
    differ = (packed[:count] != 0).tolist()
    novel, kept = [None] * count, [None] * count
    for i, distance in zip(rows, packed[len(packed) - len(rows):].tolist()):
        novel[i], kept[i] = distance > memories[i].threshold, pairs[i]
    if short:
        return [RowFacts(d, novel=n, pair=p) for d, n, p in zip(differ, novel, kept)]
    has_nan = (packed[count:2 * count] != 0).tolist()
    top2 = packed[2 * count:6 * count].reshape(2, count, 2).tolist()
    return [RowFacts(*facts) for facts in zip(differ, has_nan, top2[0], top2[1], novel, kept)]


def _novelty(both, memories: list):
    """The rows whose memory can judge novelty, each one's squared distance to its memory's nearest point (a
    float64 tensor on the device, not yet brought back) and every row's pair (float64 rows there; None when
    no row has such a memory)."""
    import torch

    rows = [i for i, memory in enumerate(memories) if isinstance(memory, DeviceNoveltyMemory) and len(memory)]
    if not rows:
        return rows, both.new_empty(0, dtype=torch.float64), None
    pairs = torch.cat([both[0], both[1]], dim=1).to(torch.float64)  # (N, 2C): probability_pair of each row
    remembered = torch.nn.utils.rnn.pad_sequence([memories[i].points for i in rows], batch_first=True,
                                                 padding_value=float("inf"))  # (R, M, 2C); inf: never nearest
    return rows, ((remembered - pairs[rows][:, None]) ** 2).sum(dim=2).min(dim=1).values, pairs
