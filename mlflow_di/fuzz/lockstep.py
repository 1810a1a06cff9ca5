"""The lockstep runner: the searches of one or more campaigns advanced together, one batched call
of each model per iteration, with speculation and overlap (see :mod:`mlflow_di.fuzz.campaign` for
the time accounting, speculation and overlap rules it implements).

Its public interface is what executes a chunk of seeds anywhere, in this process or on a Ray worker
(:mod:`mlflow_di.fuzz.distributed`): a :class:`Lane` per campaign (its compressed model, config,
optional store, finished records, and the seeds still to search with both models' probabilities
on them), and :class:`Lockstep` over the lanes, whose :meth:`Lockstep.run` (with a progress bar and
an optional executor) or :meth:`Lockstep.search_all` (the searches alone) fills each lane's
``records``, ``images`` and ``stats``.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mlflow_di.data import ImageSet
from mlflow_di.fuzz.charge import model_clock, search_clock
from mlflow_di.fuzz.fitness import labels_differ, top1_labels
from mlflow_di.fuzz.population import apply_mutations, apply_mutations_on_device
from mlflow_di.fuzz.realism import distances
from mlflow_di.fuzz.results import RunStats, SeedRecord, Stop
from mlflow_di.fuzz.search import Search
from mlflow_di.fuzz.seeds import top1
from mlflow_di.fuzz.session import CampaignSession
from mlflow_di.models.classifier import takes_device_batches
from mlflow_di.models.device import use_own_cuda_streams
from mlflow_di.progress import BudgetProgress, budget_share


@dataclasses.dataclass
class _Active:
    """A seed being searched: its index, image, search and charged seconds."""

    index: int
    search: Search
    seed_probabilities: tuple[np.ndarray, np.ndarray]
    seed_image: np.ndarray
    seconds: float = 0.0
    model_seconds: float = 0.0


class Lane:
    """One campaign of a lockstep run: its compressed model, its session (settings, folder, the seeds a previous
    run finished), and this run's seeds and results."""

    def __init__(self, compressed, session: CampaignSession):
        self.compressed, self.session, self.config, self.done = compressed, session, session.config, session.done
        self.records: dict[int, SeedRecord] = {}
        self.images: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.stats = RunStats()
        self.todo = np.zeros(0, np.int64)
        self.p_original = self.p_compressed = np.zeros((0, 0))
        self.pending: collections.deque = collections.deque()

    def todo_indices(self, count: int) -> set[int]:
        return {i for i in range(count) if i not in self.done}


@dataclasses.dataclass
class _Evaluation:
    """One shift's batched model calls: the original's rows for every lane's inputs (in lane order),
    its seconds and the distinct images it evaluated; per lane, the compressed model's rows and seconds."""

    p_original: np.ndarray
    original_seconds: float
    distinct: int
    compressed: list[tuple[np.ndarray, float]]


class _Shift:
    """Seeds whose inputs share one batched call of each model per iteration: per lane, the searches
    being run and a reused buffer for their inputs (written there by the searches or copied in); and
    the shift's call while it is in flight."""

    def __init__(self, lane_count: int):
        self.active: list[list[_Active]] = [[] for _ in range(lane_count)]
        #: per lane, the rows of each of its searches' inputs in this iteration: (first row, how many)
        self.proposals: list[list[tuple[int, int]]] = []
        #: per lane, this iteration's inputs: the first rows of the lane's buffer
        self.inputs: list[np.ndarray] = []
        #: the models' answer to ``inputs``: an _Evaluation, or a Future of one while it is computed
        self.evaluation = None
        self._buffers: list[np.ndarray | None] = [None] * lane_count

    @property
    def busy(self) -> bool:
        return self.evaluation is not None or any(self.active)

    def rows(self, lane: int, count: int, image_shape: tuple, filled: int = 0) -> np.ndarray:
        """A lane's batch buffer with room for at least ``count`` inputs, reused from call to call: a
        fresh array per call pays for its pages on every call, which shows per input at 224 px. Growing it
        keeps its first ``filled`` rows (the searches' views of the old rows stay valid: they keep the old array alive). The
        models read a batch before this shift's next iteration rewrites it; the other shift has its own."""
        buffer = self._buffers[lane]
        if buffer is None or len(buffer) < count:
            grown = np.empty((count, *image_shape), np.uint8)
            if filled:
                grown[:filled] = buffer[:filled]
            buffer = self._buffers[lane] = grown
        return buffer


class Lockstep:
    """Runs the searches of one or more campaigns, ``batch`` seeds at a time per campaign and shift, with
    one batched call of the original (each distinct input once) and one of each compressed model per
    iteration of a shift. Without ``overlap`` there is one shift; with it, two, whose model calls run
    in a background thread while the searches of the other shift work (see :func:`run_campaigns`)."""

    def __init__(self, original, lanes: list[Lane], seeds: ImageSet, strategy, batch: int, overlap: bool = False):
        self.original, self.lanes = original, lanes
        self.seeds, self.strategy, self.batch = seeds, strategy, batch
        self.overlap = overlap
        self._progress = None
        self._shifts: list[_Shift] = []  # in this process (none with an executor elsewhere)
        self._clock_start = time.perf_counter()  # wall-clock, for the progress bar's rate only
        self._search_thread: int | None = None  # the searches' thread, alive while they run (set by search_all)
        self._last_postfix = 0.0
        self._inputs = 0
        #: images the original evaluated (each distinct input of an iteration once)
        self.shared_original_inputs = 0

    def run(self, progress: bool, executor=None) -> None:
        """Search every lane's seeds, here (``executor`` None) or as ``executor.execute(self)`` decides
        (e.g. :class:`~mlflow_di.fuzz.distributed.RayExecutor`), which hands each finished seed to :meth:`save`."""
        finished = sum(len(lane.done) for lane in self.lanes)
        self._progress = BudgetProgress(len(self.seeds) * len(self.lanes), finished, f"fuzz {self.strategy.name}",
                                        disable=not progress)
        self._progress.triggers = sum(r.success for lane in self.lanes for r in lane.done.values())
        try:
            if executor is None:
                self.search_all()
            else:
                executor.execute(self)
        except KeyboardInterrupt:
            unfinished = sum(len(lane.todo) - len(lane.records) for lane in self.lanes)
            saved = sum(len(lane.records) for lane in self.lanes)
            self._progress.write(f"interrupted: {saved} seeds finished in this run are saved; {unfinished} not finished")
        finally:
            self._last_postfix = 0.0  # the final counts, whatever the rate limit
            self._refresh_progress()
            self._progress.close()

    def search_all(self) -> None:
        """Every lane's seeds in this process, ``batch`` at a time per lane and shift (seeds already
        deviating are recorded at once). Each shift in turn: take its models' answer, finish its
        seeds that are done, start new ones, propose, and hand the inputs to the models."""
        self._search_thread = threading.get_ident()  # model calls in the overlap thread leave its CPU time out
        for lane in self.lanes:
            for row, index in enumerate(lane.todo):
                if labels_differ(lane.p_original[row], lane.p_compressed[row]):
                    self._finish_deviating(lane, int(index), lane.p_original[row], lane.p_compressed[row])
                else:
                    lane.pending.append((int(index), lane.p_original[row], lane.p_compressed[row]))
        shifts = self._shifts = [_Shift(len(self.lanes)) for _ in range(shift_count(self.overlap))]
        pool = ThreadPoolExecutor(1, thread_name_prefix="mlflow-di-models") if self.overlap else None
        try:
            if pool is not None:
                # The thread starts here, before any model call (so a Ctrl-C while it starts leaves no
                # call behind), and takes CUDA streams of its own, so that the searches' device operators
                # do not queue behind its forward passes; a failure there reaches the caller as it is.
                pool.submit(use_own_cuda_streams, self._cuda_devices()).result()
            while any(lane.pending for lane in self.lanes) or any(shift.busy for shift in shifts):
                for shift in shifts:
                    if shift.evaluation is not None:
                        evaluation, shift.evaluation = shift.evaluation, None
                        self._observe(shift, evaluation if pool is None else evaluation.result())
                    for number, lane in enumerate(self.lanes):
                        shift.active[number] = [a for a in shift.active[number] if not self._maybe_finish(lane, a)]
                        room = self._room(number, shifts)
                        while lane.pending and len(shift.active[number]) < room:
                            shift.active[number].append(self._start(lane, *lane.pending.popleft()))
                    if not self._propose(shift):
                        continue  # only exhausted searches (or none) this time: they finish on the next turn
                    shift.evaluation = (self._evaluate(shift.inputs) if pool is None
                                        else pool.submit(self._evaluate, shift.inputs))
        finally:  # an interrupted or failed campaign leaves no call behind (one batch at most to wait for)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    @property
    def seeds_in_flight(self) -> int:
        """Seeds searched at once per campaign (see :func:`seeds_in_flight`)."""
        return seeds_in_flight(self.batch, self.overlap)

    def _room(self, lane: int, shifts: list[_Shift]) -> int:
        """Seeds one shift may hold for lane number ``lane``: ``batch``, or half of the lane's seeds still to
        finish (rounded up) when two shifts share fewer than twice ``batch``, so that both have work to
        overlap. With one shift this is ``batch`` whenever a seed waits."""
        left = len(self.lanes[lane].pending) + sum(len(shift.active[lane]) for shift in shifts)
        return min(self.batch, -(-left // len(shifts)))

    def _cuda_devices(self) -> list:
        """The CUDA devices the PyTorch models run on (a classifier's ``device``), each once."""
        models = [self.original, *(lane.compressed for lane in self.lanes)]
        devices = {getattr(model, "device", None) for model in models}
        return sorted((d for d in devices if getattr(d, "type", None) == "cuda"), key=str)

    def _start(self, lane: Lane, index: int, p_original: np.ndarray, p_compressed: np.ndarray) -> _Active:
        began = search_clock()
        rng = np.random.default_rng([lane.config.seed, index])
        image = self.seeds.images[index]  # read once (a lazy set decodes it), kept while the seed is searched
        search = self.strategy.start(image, p_original, p_compressed, rng)
        return _Active(index, search, (p_original, p_compressed), image, search_clock() - began)

    def _propose(self, shift: _Shift) -> bool:
        """Ask every search of ``shift`` for its next inputs, gathered per lane into one batch; whether
        there are any. A search that draws its mutation (``plan``) gets it made with the others of its
        operator (:func:`~mlflow_di.fuzz.population.apply_mutations`), in rows after the other inputs. The
        others are offered the rows their inputs go to (``out``): DFlare writes its mutants there, so they
        are not copied into the batch afterwards; other inputs are copied in."""
        shape = self.seeds.image_shape
        shift.proposals, shift.inputs = [], []
        for number, (lane, active) in enumerate(zip(self.lanes, shift.active)):
            began = search_clock()
            limit = lane.config.max_queries
            depth = _speculation_depth(len(active), self.batch) if active else 1
            buffer = shift.rows(number, len(active) * depth, shape)
            spans: list[tuple[int, int]] = [(0, 0)] * len(active)  # each search's rows: (first, count)
            filled, planned = 0, []
            for position, a in enumerate(active):
                mutation = a.search.plan() if depth == 1 else None
                if mutation is not None:  # drawn now, made below with the others of its operator
                    planned.append((position, mutation))
                    continue
                later = depth * (len(active) - position - 1)  # rows kept for the searches after this one
                # grows only after a search proposed more than depth (a generation, copied in below)
                buffer = shift.rows(number, filled + depth + later, shape, filled)
                slot = buffer[filled:filled + depth]
                inputs = a.search.propose(None if limit is None else limit - a.search.queries, depth, out=slot)
                if len(inputs) and not _in_place(inputs, slot):  # the search's own arrays: copied in
                    buffer = shift.rows(number, filled + len(inputs) + later, shape, filled)
                    buffer[filled:filled + len(inputs)] = inputs
                spans[position] = (filled, len(inputs))
                filled += len(inputs)
            if planned:
                mutations = [mutation for _, mutation in planned]
                if filled == 0 and self._batch_stays_on_device(lane, mutations):
                    rows, buffer = apply_mutations_on_device(mutations)  # the models take it where it is
                else:
                    buffer = shift.rows(number, filled + len(planned), shape, filled)
                    rows = apply_mutations(mutations, buffer[filled:filled + len(planned)])
                for (position, _), row in zip(planned, rows):
                    spans[position] = (filled + row, 1)
                filled += len(planned)
            _charge(active, [count for _, count in spans], search_clock() - began)
            shift.proposals.append(spans)
            shift.inputs.append(buffer[:filled])
        return any(len(inputs) for inputs in shift.inputs)

    def _batch_stays_on_device(self, lane: Lane, mutations: list) -> bool:
        """Whether a lane's step of ``mutations`` (all of its inputs) stays on the device as the models' batch:
        every operator runs on one device, both models run there (a campaign of PyTorch models on a GPU), and
        the campaign has one lane (several lanes share the original's calls, matched by the images' bytes)."""
        devices = {mutation.operator.device for mutation in mutations}
        if len(self.lanes) > 1 or len(devices) > 1 or None in devices:
            return False
        device = devices.pop()
        return takes_device_batches(self.original, device) and takes_device_batches(lane.compressed, device)

    def _evaluate(self, lane_inputs: list[np.ndarray]) -> _Evaluation:
        """Every lane's inputs through the original (each distinct image once) and through the lane's
        compressed model. With ``overlap`` it runs in the background thread and touches only the models
        and ``lane_inputs`` (the shift's own buffers, which the shift rewrites only after its answer)."""
        clock = model_clock(self._search_thread)  # this thread's: the searches' own, or the overlap thread's
        p_original, original_seconds, distinct = self._original_probabilities(lane_inputs, clock)
        compressed = []
        for lane, inputs in zip(self.lanes, lane_inputs):
            began = clock()
            p_compressed = _probabilities(lane.compressed, inputs) if len(inputs) else None
            compressed.append((p_compressed, clock() - began))
        return _Evaluation(p_original, original_seconds, distinct, compressed)

    def _observe(self, shift: _Shift, evaluation: _Evaluation) -> None:
        """Hand each search of ``shift`` its rows of the models' answer, charging it its share of the calls."""
        counts = [len(inputs) for inputs in shift.inputs]
        total = sum(counts)
        # each input is charged what it costs the original alone (per distinct image), so a seed gets
        # the compute budget of a separate campaign; charged times then add up to more than the wall time
        original_share = evaluation.original_seconds / evaluation.distinct
        self.shared_original_inputs += evaluation.distinct
        self._inputs += total
        start_original = 0
        for lane, active, mine, count, (p_compressed, compressed_seconds) in zip(
                self.lanes, shift.active, shift.proposals, counts, evaluation.compressed):
            if not count:
                continue
            share = original_share + compressed_seconds / count
            lane_original = evaluation.p_original[start_original:start_original + count]
            start_original += count
            began = search_clock()
            kinds: dict[type, list[int]] = {}  # the searches of one type observe together (observe_all)
            for position, a in enumerate(active):
                kinds.setdefault(type(a.search), []).append(position)
                a.seconds += share * mine[position][1]
                a.model_seconds += share * mine[position][1]
            for kind, positions in kinds.items():
                kind.observe_all([active[p].search for p in positions], [mine[p] for p in positions],
                                 lane_original, p_compressed)
            _charge(active, [proposed for _, proposed in mine], search_clock() - began)
            lane.stats.model_seconds += share * count
            lane.stats.calls += 1
            lane.stats.inputs += count
            lane.stats.original_inputs += count * evaluation.distinct / total
        self._refresh_progress()  # also while a few long searches finish alone

    def _original_probabilities(self, lane_inputs: list[np.ndarray], clock) -> tuple[np.ndarray, float, int]:
        """The original's probabilities for every campaign's inputs (concatenated in lane order), its
        CPU seconds, and how many images it evaluated: with several campaigns, each distinct image once."""
        began = clock()
        inputs = np.concatenate(lane_inputs) if len(lane_inputs) > 1 else lane_inputs[0]
        if len(lane_inputs) == 1:
            return _probabilities(self.original, inputs), clock() - began, len(inputs)
        first_of: dict[bytes, int] = {}
        rows = np.empty(len(inputs), np.int64)
        for row, image in enumerate(inputs):
            rows[row] = first_of.setdefault(hashlib.blake2b(image.tobytes(), digest_size=16).digest(), len(first_of))
        unique = np.empty(len(first_of), np.int64)
        unique[rows] = np.arange(len(inputs))  # any row of each distinct image will do
        probabilities = np.asarray(self.original.predict_proba(inputs[unique]))[rows]
        return probabilities, clock() - began, len(unique)

    def _maybe_finish(self, lane: Lane, a: _Active) -> bool:
        search = a.search
        if search.found:
            stop = Stop.TRIGGER
        elif lane.config.max_queries is not None and search.queries >= lane.config.max_queries:
            stop = Stop.MAX_QUERIES
        elif search.exhausted:
            stop = Stop.CONSTRAINED
        elif a.seconds >= lane.config.timeout:
            stop = Stop.TIMEOUT
        else:
            return False
        self.save(lane, self._record(a, stop), search.trigger, a.seed_image)
        lane.stats.search_seconds += a.seconds - a.model_seconds
        return True

    def _record(self, a: _Active, stop: Stop) -> SeedRecord:
        search = a.search
        p_seed = a.seed_probabilities
        record = SeedRecord(
            index=a.index, label=int(self.seeds.labels[a.index]), success=search.found, stop=stop,
            queries=search.queries, seconds=a.seconds,
            seed_labels=top1_labels(*p_seed), seed_probabilities=top1(*p_seed),
            operators=list(search.trigger_operators),
            operator_counts={name: [int(s), int(c)] for name, s, c in
                             zip(search.operator_names, search.stats.selected, search.stats.accepted)},
            constraint_rejections=int(search.constraint_rejections))
        if search.found:
            record.trigger_labels = top1_labels(*search.trigger_probabilities)
            record.trigger_probabilities = top1(*search.trigger_probabilities)
            record.trigger_distances = distances(search.trigger, a.seed_image)
        return record

    def _finish_deviating(self, lane: Lane, index: int, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        record = SeedRecord(index=index, label=int(self.seeds.labels[index]), success=False,
                            stop=Stop.ALREADY_DEVIATING, queries=0, seconds=0.0,
                            seed_labels=top1_labels(p_original, p_compressed),
                            seed_probabilities=top1(p_original, p_compressed))
        self.save(lane, record, None, None)  # no trigger: the seed image is not stored

    def save(self, lane: Lane, record: SeedRecord, trigger: np.ndarray | None, seed_image: np.ndarray | None) -> None:
        """Keep one finished seed: in the lane, in its campaign folder (when it has one), on the progress bar.
        ``seed_image`` is kept with its trigger; without a trigger it may be None."""
        lane.records[record.index] = record
        if trigger is not None:
            lane.images[record.index] = (trigger, seed_image)
        lane.session.append(record, trigger, seed_image)
        self._progress.finish(budget_share(record.queries, record.seconds, lane.config.max_queries,
                                           lane.config.timeout), trigger is not None)
        self._refresh_progress()

    def _refresh_progress(self) -> None:
        """The bar, at most twice a second: budget spent (see :class:`~mlflow_di.progress.BudgetProgress`),
        triggers found, queries per second."""
        now = time.perf_counter()
        if now - self._last_postfix > 0.5:
            self._last_postfix = now
            running = sum(budget_share(a.search.queries, a.seconds, lane.config.max_queries, lane.config.timeout)
                          for shift in self._shifts for lane, active in zip(self.lanes, shift.active) for a in active
                          if a.index not in lane.records)  # one finishing now is counted as finished
            self._progress.show(running, self._inputs / max(now - self._clock_start, 1e-9))


#: Most inputs one search may propose per call when few seeds are left. On the LeNet-5 pair,
#: 0.7% of all inputs were dropped unused with this cap (most mutants of a slow seed are
#: rejected, which is what speculation assumes).
MAX_SPECULATION = 16


def _probabilities(model, inputs) -> np.ndarray:
    """``model``'s probabilities for a lane's batch: a host array, or a tensor the models' device holds
    (:func:`~mlflow_di.fuzz.population.apply_mutations_on_device`)."""
    return model.predict_proba(inputs) if isinstance(inputs, np.ndarray) else model.predict_device_batch(inputs)


def _charge(active: list, counts: list[int], seconds: float) -> None:
    """Charge the searches of one lane ``seconds`` of their own work, in proportion to the inputs each handled (at
    least one share each). One clock reading per lane and turn, not per search: a thread's CPU clock is a system
    call, which 64 searches had paid twice each per iteration (benchmarks/RESULTS.md, bench_scale --floor-only)."""
    weights = [max(1, count) for count in counts]
    total = sum(weights)
    for a, weight in zip(active, weights):
        a.seconds += seconds * weight / total


def _in_place(inputs: np.ndarray, slot: np.ndarray) -> bool:
    """Whether a search returned the first rows of ``slot`` (its inputs written there), not arrays of its own."""
    return (inputs.__array_interface__["data"][0] == slot.__array_interface__["data"][0]
            and inputs.strides == slot.strides)


def shift_count(overlap: bool) -> int:
    """Shifts of seeds a campaign runs: two with ``overlap`` (one at the models, one searching), else one."""
    return 2 if overlap else 1


def seeds_in_flight(batch: int, overlap: bool) -> int:
    """Seeds searched at once per campaign: ``batch`` per shift (a Ray chunk's default size too)."""
    return batch * shift_count(overlap)


def _speculation_depth(active: int, batch: int) -> int:
    """Inputs per search in this call: 1 while ``batch`` seeds fill the call, more as they finish."""
    return 1 if active >= batch else min(MAX_SPECULATION, -(-batch // active))
