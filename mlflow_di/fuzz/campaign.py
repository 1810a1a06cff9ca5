"""Run a differential fuzzing campaign: many seeds, two black-box models, one strategy.

Lockstep: up to ``batch`` seeds are searched at once. Each iteration asks every active search
for its next inputs, sends all of them through each model in one batched ``predict_proba``
call, and gives every search its own rows back. Each seed has its own generator,
``np.random.default_rng([seed, seed_index])``, so its queries, decisions and result are the
same as when it runs alone (``batch=1``) with the same campaign seed, given a model whose
output for an image does not depend on the rest of the batch.

Time: a seed is charged its own mutation/bookkeeping time plus its share of each batched
model call, in proportion to the inputs it contributed (when several campaigns share the
original, an input is charged the original's cost per distinct image, what it would cost alone).
The per-seed ``timeout`` applies to that charged time, so a seed gets the same compute budget
whether it runs alone or with 63 others, and the seeds' times add up to the campaign's time
(with overlap to more: a shift's model time runs beside the other shift's search time).

Speculation: once fewer than ``batch`` seeds are left, each search may propose several inputs
per call (``depth``, up to :data:`MAX_SPECULATION`), so that the last, slowest seeds still fill
a batched call instead of paying a model call's fixed cost per query. A search uses only the
inputs its algorithm would have queried one at a time (see :class:`~mlflow_di.fuzz.dflare.DFlareSearch`);
results and query counts do not change.

Overlap: a GPU computes a batch while the host waits, then the host mutates and scores the next
batch while the GPU waits, so a query costs the host's work *plus* the models'. With ``overlap``
the seeds form two shifts of up to ``batch`` seeds per campaign; while one shift's inputs go
through the models (in a background thread, which PyTorch's and ONNX Runtime's calls let run
beside Python), the other shift's searches observe their last answer and propose their next
inputs, so a query costs about the larger of the two. While fewer than twice ``batch`` seeds are
left, each shift holds half of them. The models' thread computes on CUDA streams
of its own, so the noise and median operators the searches run on a GPU do not wait behind its
forward passes. The searches never see a model call of another shift, so records stay the same
(as with ``batch``, a model whose output for an image depends on the rest of its batch, such as
ONNX Runtime's int8-dynamic, sees other batches); a seed is charged its shift's model time as before.

Queries: one query is one input through both models; the seed's own check is not counted, nor
are speculative inputs a search dropped unused (they count in ``RunStats.inputs``).
Seeds on which the models already disagree are recorded apart and not searched.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from mlflow_di.progress import progress_bar as tqdm

from mlflow_di.data import ImageSet, fingerprint
from mlflow_di.errors import UserError
from mlflow_di.fuzz.distributed import searches_share_the_models_gpu
from mlflow_di.fuzz.fitness import labels_differ, top1_labels
from mlflow_di.fuzz.realism import distances
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, RunStats, SeedRecord, Stop
from mlflow_di.fuzz.search import Search
from mlflow_di.folder_lock import FolderLock
from mlflow_di.fuzz.store import CampaignStore, assemble_result
from mlflow_di.fuzz.strategies import make_strategy
from mlflow_di.models.device import use_own_cuda_streams


def run_campaign(original, compressed, seeds: ImageSet, strategy="dflare", timeout: float = 180.0,
                 max_queries: int | None = None, batch: int = 64, seed: int = 0, out_dir=None,
                 resume: bool = False, progress: bool = True, executor=None,
                 overlap: bool | None = None) -> CampaignResult:
    """Search each seed for an input on which ``original`` and ``compressed`` disagree.

    ``original``/``compressed``: black boxes with ``predict_proba(uint8 NHWC) -> (N, C)``.
    ``strategy``: a name of :data:`~mlflow_di.fuzz.strategies.STRATEGIES` ('dflare', 'dflare-paper', ...,
    'diffchaser') or a strategy object.
    ``timeout`` (seconds) and ``max_queries`` limit each seed's search. ``batch``: seeds
    searched in lockstep (results do not depend on it). ``out_dir``: where records and
    triggers are saved as seeds finish; ``resume=True`` continues a campaign found there.

    A KeyboardInterrupt stops the campaign early: finished seeds are kept (on disk too) and
    the returned result has ``complete=False``. ``executor`` and ``overlap``: see :func:`run_campaigns`.
    """
    return run_campaigns(original, [compressed], seeds, strategy=strategy, timeout=timeout, max_queries=max_queries,
                         batch=batch, seed=seed, out_dirs=None if out_dir is None else [out_dir], resume=resume,
                         progress=progress, executor=executor, overlap=overlap)[0]


def run_campaigns(original, compressed: list, seeds: ImageSet, strategy="dflare", timeout: float = 180.0,
                  max_queries: int | None = None, batch: int = 64, seed: int = 0, out_dirs: list | None = None,
                  resume: bool = False, progress: bool = True, executor=None,
                  overlap: bool | None = None) -> list[CampaignResult]:
    """One campaign per model in ``compressed``, all against ``original``, sharing its calls.

    Each campaign is the one :func:`run_campaign` would run for that pair (per-seed records are
    the same), but the campaigns advance together: each lockstep iteration sends the inputs of
    every campaign through ``original`` in one call, each distinct image once (the searches of
    one seed against two exports propose the same mutants until their paths part), and each
    campaign's own inputs through its compressed model. ``out_dirs``: one folder per campaign.
    The results' ``run_stats.original_inputs`` say how many images the original evaluated for
    that campaign's share; :attr:`RunStats.shared_original_inputs` how many all campaigns needed.

    ``executor``: None searches here; a :class:`~mlflow_di.fuzz.distributed.RayExecutor` spreads
    chunks of seeds over Ray workers (same per-seed records under ``max_queries``). Either way this
    process alone writes the campaign folders.

    ``overlap``: keep two shifts of up to ``batch`` seeds per campaign and run one shift's model calls in
    a background thread while the other shift's searches mutate and score (see the module docstring).
    None (the default): :func:`overlaps_by_default`, decided from the models this process loaded (as
    :func:`~mlflow_di.fuzz.device_mutations.mutation_device` is). Per-seed records do not change, only
    times do (unless a model's output for an image depends on the rest of its batch, as with ``batch``).
    """
    strategy = make_strategy(strategy)
    if getattr(strategy, "white_box", False):
        raise UserError(f"the {strategy.name} strategy needs white-box PyTorch models and their gradients; "
                        "run it with mlflow_di.fuzz.deepxplore.run_deepxplore (fuzz --strategy deepxplore)")
    if not compressed:
        raise UserError("no compressed model given")
    if out_dirs is not None and len(out_dirs) != len(compressed):
        raise UserError(f"{len(compressed)} compressed models but {len(out_dirs)} output folders")
    check_arguments(seeds, timeout, max_queries, batch, out_dirs, resume, strategy)
    with contextlib.ExitStack() as locks:  # one process per campaign folder (see mlflow_di.folder_lock)
        for folder in out_dirs or ():
            locks.enter_context(FolderLock(folder, "the campaign folder"))
        fingerprint = seed_fingerprint(seeds, progress)
        lanes = []
        for number, model in enumerate(compressed):
            config = CampaignConfig(
                strategy=strategy.name, strategy_options=strategy.options(), timeout=float(timeout),
                max_queries=max_queries, seed=int(seed), data=seeds.name, seed_count=len(seeds),
                seeds_sha256=fingerprint, image_shape=tuple(seeds.image_shape),
                original=_name(original, "original"), compressed=_name(model, "compressed"))
            store = CampaignStore(out_dirs[number]) if out_dirs is not None else None
            done: dict[int, SeedRecord] = {}
            if store is not None and resume:
                store.check_resumable(config)
                done = store.read_records()
            lanes.append(_Lane(model, config, store, done))
        _check_seeds(original, lanes, seeds, progress=progress)
        for lane in lanes:
            if lane.store is not None and not resume:
                lane.store.create(lane.config)
        if overlap is None:
            overlap = overlaps_by_default(original, compressed, executor)
        runner = _Lockstep(original, lanes, seeds, strategy, batch, overlap)
        try:
            runner.run(progress, executor)
        finally:
            for lane in lanes:
                if lane.store is not None:
                    lane.store.close()
        results = []
        for lane in lanes:
            records = sorted({**lane.done, **lane.records}.values(), key=lambda r: r.index)
            result = assemble_result(lane.config, records, lane.store, complete=len(records) == len(seeds),
                                     images=lane.images)
            result.run_stats = lane.stats
            result.run_stats.shared_original_inputs = runner.shared_original_inputs
            if lane.store is not None:
                lane.store.finish(result.summary, result.triggers, result.trigger_seeds, result.trigger_indices)
            results.append(result)
        return results


def check_arguments(seeds: ImageSet, timeout, max_queries, batch, out_dirs, resume, strategy=None) -> None:
    if not isinstance(seeds, ImageSet):
        raise UserError(f"seeds must be an ImageSet (see mlflow_di.data.load_images), got {type(seeds).__name__}")
    if len(seeds) == 0:
        raise UserError("no seed images given")
    constraint = getattr(strategy, "constraint", None)
    if constraint is not None:  # before any file is written: SSIM needs images of at least its window
        constraint.check_seed(seeds.images[0])
    if not timeout or timeout <= 0:
        raise UserError(f"timeout must be a positive number of seconds, got {timeout}")
    if max_queries is not None and max_queries < 1:
        raise UserError(f"max_queries must be at least 1, got {max_queries}")
    if batch < 1:
        raise UserError(f"batch must be at least 1, got {batch}")
    if resume and out_dirs is None:
        raise UserError("resume needs the output directory of the campaign to continue (out_dir=..., or --out-dir on the command line)")


def _name(model, fallback: str) -> str:
    return str(getattr(model, "name", None) or fallback)


#: Seeds read per batch when the seed set is walked (fingerprint, first predictions): a lazy set
#: (folder:, npz:) is decoded this many images at a time, never whole.
SEED_BATCH = 256


def seed_fingerprint(seeds: ImageSet, progress: bool = False) -> str:
    """SHA-256 of every seed's pixels, then the labels (the same digest whether the seeds are lazy or not)."""
    return fingerprint(seeds, SEED_BATCH, progress, desc="seed fingerprint")


def predict_checked(model, images: np.ndarray, role: str) -> np.ndarray:
    """Probabilities, with a one-line UserError when the model cannot take these images."""
    try:
        probabilities = np.asarray(model.predict_proba(images))
    except UserError:
        raise
    except Exception as exc:  # any backend's shape/type complaint becomes one actionable line
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise UserError(f"the {role} model '{_name(model, role)}' cannot classify the seeds "
                        f"(images {'x'.join(map(str, images.shape[1:]))} HxWxC): {first_line}") from None
    if probabilities.ndim != 2 or len(probabilities) != len(images):
        raise UserError(f"the {role} model's predict_proba must return (N, classes) probabilities; "
                        f"got shape {probabilities.shape} for {len(images)} images")
    return probabilities


def _check_seeds(original, lanes: list["_Lane"], seeds: ImageSet, progress: bool = False) -> None:
    """Every model's probabilities on the seeds each campaign still has to run (stored on the
    lanes), after checking that each pair fits. The original sees each seed once."""
    union = sorted(set().union(*(lane.todo_indices(len(seeds)) for lane in lanes)))
    todo = np.asarray(union, dtype=np.int64)
    if len(todo) == 0:
        return
    p_original = np.concatenate([predict_checked(original, seeds.images[todo[start:start + SEED_BATCH]], "original")
                                 for start in tqdm(range(0, len(todo), SEED_BATCH), desc="seed predictions",
                                                   unit="batch", disable=not progress, leave=False)])
    row_of = {int(index): row for row, index in enumerate(todo)}
    for lane in lanes:  # in batches: the seeds may be bigger than memory
        indices = np.asarray(sorted(lane.todo_indices(len(seeds))), dtype=np.int64)
        if len(indices) == 0:
            lane.todo = indices
            continue
        p_compressed = np.concatenate([predict_checked(lane.compressed, seeds.images[indices[start:start + SEED_BATCH]],
                                                "compressed") for start in range(0, len(indices), SEED_BATCH)])
        mine = p_original[[row_of[int(i)] for i in indices]]
        if mine.shape[1] != p_compressed.shape[1]:
            raise UserError(f"the models disagree on the number of classes: original '{_name(original, 'original')}' "
                            f"has {mine.shape[1]}, compressed '{_name(lane.compressed, 'compressed')}' has "
                            f"{p_compressed.shape[1]}; compare a model with its own compressed version")
        fuzzed_before = any(not r.already_deviating for r in lane.done.values())
        if labels_differ(mine, p_compressed).all() and not fuzzed_before:
            raise UserError(f"the two models already disagree on all {len(indices)} seeds, so there is nothing to "
                            f"fuzz (compressed '{_name(lane.compressed, 'compressed')}'); check that the compressed "
                            "model belongs to the original and that both use the right preprocessing")
        lane.todo, lane.p_original, lane.p_compressed = indices, mine, p_compressed


@dataclasses.dataclass
class _Active:
    """A seed being searched: its index, image, search and charged seconds."""

    index: int
    search: Search
    seed_probabilities: tuple[np.ndarray, np.ndarray]
    seed_image: np.ndarray
    seconds: float = 0.0
    model_seconds: float = 0.0


class _Lane:
    """One campaign of a lockstep run: its compressed model, settings, folder, seeds and results."""

    def __init__(self, compressed, config: CampaignConfig, store: CampaignStore | None, done: dict[int, SeedRecord]):
        self.compressed, self.config, self.store, self.done = compressed, config, store, done
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
        #: per lane, how many inputs each of its searches proposed in this iteration
        self.proposals: list[list[int]] = []
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
        fresh array per call pays for its pages (64 inputs at 224 px: 25-42 µs per input copied into a
        new array, 19-21 into a reused one, on a 2-core machine). Growing it keeps its first ``filled``
        rows (the searches' views of the old rows stay valid: they keep the old array alive). The
        models read a batch before this shift's next iteration rewrites it; the other shift has its own."""
        buffer = self._buffers[lane]
        if buffer is None or len(buffer) < count:
            grown = np.empty((count, *image_shape), np.uint8)
            if filled:
                grown[:filled] = buffer[:filled]
            buffer = self._buffers[lane] = grown
        return buffer


class _Lockstep:
    """Runs the searches of one or more campaigns, ``batch`` seeds at a time per campaign and shift, with
    one batched call of the original (each distinct input once) and one of each compressed model per
    iteration of a shift. Without ``overlap`` there is one shift; with it, two, whose model calls run
    in a background thread while the searches of the other shift work (see :func:`run_campaigns`)."""

    def __init__(self, original, lanes: list[_Lane], seeds: ImageSet, strategy, batch: int, overlap: bool = False):
        self.original, self.lanes = original, lanes
        self.seeds, self.strategy, self.batch = seeds, strategy, batch
        self.overlap = overlap
        self._progress = None
        self._clock_start = time.perf_counter()
        self._last_postfix = 0.0
        self._inputs = 0
        #: images the original evaluated (each distinct input of an iteration once)
        self.shared_original_inputs = 0

    def run(self, progress: bool, executor=None) -> None:
        """Search every lane's seeds, here (``executor`` None) or as ``executor.execute(self)`` decides
        (e.g. :class:`~mlflow_di.fuzz.distributed.RayExecutor`), which hands each finished seed to :meth:`save`."""
        self._triggers = sum(r.success for lane in self.lanes for r in lane.done.values())
        finished = sum(len(lane.done) for lane in self.lanes)
        self._progress = tqdm(total=len(self.seeds) * len(self.lanes), initial=finished, disable=not progress,
                              desc=f"fuzz {self.strategy.name}", unit="seed", dynamic_ncols=True)
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
        for lane in self.lanes:
            for row, index in enumerate(lane.todo):
                if labels_differ(lane.p_original[row], lane.p_compressed[row]):
                    self._finish_deviating(lane, int(index), lane.p_original[row], lane.p_compressed[row])
                else:
                    lane.pending.append((int(index), lane.p_original[row], lane.p_compressed[row]))
        shifts = [_Shift(len(self.lanes)) for _ in range(shift_count(self.overlap))]
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

    def _start(self, lane: _Lane, index: int, p_original: np.ndarray, p_compressed: np.ndarray) -> _Active:
        began = time.perf_counter()
        rng = np.random.default_rng([lane.config.seed, index])
        image = self.seeds.images[index]  # read once (a lazy set decodes it), kept while the seed is searched
        search = self.strategy.start(image, p_original, p_compressed, rng)
        return _Active(index, search, (p_original, p_compressed), image, time.perf_counter() - began)

    def _propose(self, shift: _Shift) -> bool:
        """Ask every search of ``shift`` for its next inputs, gathered per lane into one batch; whether
        there are any. Each search is offered the rows its inputs go to (``out``): DFlare writes its
        mutants there, so they are not copied into the batch afterwards; other inputs are copied in."""
        clock = time.perf_counter
        shape = self.seeds.image_shape
        shift.proposals, shift.inputs = [], []
        began = clock()
        for number, (lane, active) in enumerate(zip(self.lanes, shift.active)):
            limit = lane.config.max_queries
            depth = _speculation_depth(len(active), self.batch) if active else 1
            buffer = shift.rows(number, len(active) * depth, shape)
            counts, filled = [], 0
            for position, a in enumerate(active):  # one clock reading per search: its turn ends, the next's begins
                later = depth * (len(active) - position - 1)  # rows kept for the searches after this one
                # grows only after a search proposed more than depth (a generation, copied in below)
                buffer = shift.rows(number, filled + depth + later, shape, filled)
                slot = buffer[filled:filled + depth]
                inputs = a.search.propose(None if limit is None else limit - a.search.queries, depth, out=slot)
                if len(inputs) and not _in_place(inputs, slot):  # the search's own arrays: copied in
                    buffer = shift.rows(number, filled + len(inputs) + later, shape, filled)
                    buffer[filled:filled + len(inputs)] = inputs
                counts.append(len(inputs))
                filled += len(inputs)
                now = clock()
                a.seconds += now - began
                began = now
            shift.proposals.append(counts)
            shift.inputs.append(buffer[:filled])
        return any(len(inputs) for inputs in shift.inputs)

    def _evaluate(self, lane_inputs: list[np.ndarray]) -> _Evaluation:
        """Every lane's inputs through the original (each distinct image once) and through the lane's
        compressed model. With ``overlap`` it runs in the background thread and touches only the models
        and ``lane_inputs`` (the shift's own buffers, which the shift rewrites only after its answer)."""
        p_original, original_seconds, distinct = self._original_probabilities(lane_inputs)
        compressed = []
        for lane, inputs in zip(self.lanes, lane_inputs):
            began = time.perf_counter()
            p_compressed = lane.compressed.predict_proba(inputs) if len(inputs) else None
            compressed.append((p_compressed, time.perf_counter() - began))
        return _Evaluation(p_original, original_seconds, distinct, compressed)

    def _observe(self, shift: _Shift, evaluation: _Evaluation) -> None:
        """Hand each search of ``shift`` its rows of the models' answer, charging it its share of the calls."""
        clock = time.perf_counter
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
            start = 0
            began = clock()
            for a, proposed in zip(active, mine):
                stop = start + proposed
                a.search.observe(lane_original[start:stop], p_compressed[start:stop])
                now = clock()
                a.seconds += now - began + share * proposed
                a.model_seconds += share * proposed
                began = now
                start = stop
            lane.stats.model_seconds += share * count
            lane.stats.calls += 1
            lane.stats.inputs += count
            lane.stats.original_inputs += count * evaluation.distinct / total
        self._refresh_progress()  # also while a few long searches finish alone

    def _original_probabilities(self, lane_inputs: list[np.ndarray]) -> tuple[np.ndarray, float, int]:
        """The original's probabilities for every campaign's inputs (concatenated in lane order), its
        seconds, and how many images it evaluated: with several campaigns, each distinct image once."""
        began = time.perf_counter()
        inputs = np.concatenate(lane_inputs) if len(lane_inputs) > 1 else lane_inputs[0]
        if len(lane_inputs) == 1:
            return self.original.predict_proba(inputs), time.perf_counter() - began, len(inputs)
        first_of: dict[bytes, int] = {}
        rows = np.empty(len(inputs), np.int64)
        for row, image in enumerate(inputs):
            rows[row] = first_of.setdefault(hashlib.blake2b(image.tobytes(), digest_size=16).digest(), len(first_of))
        unique = np.empty(len(first_of), np.int64)
        unique[rows] = np.arange(len(inputs))  # any row of each distinct image will do
        probabilities = np.asarray(self.original.predict_proba(inputs[unique]))[rows]
        return probabilities, time.perf_counter() - began, len(unique)

    def _maybe_finish(self, lane: _Lane, a: _Active) -> bool:
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

    def _finish_deviating(self, lane: _Lane, index: int, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        record = SeedRecord(index=index, label=int(self.seeds.labels[index]), success=False,
                            stop=Stop.ALREADY_DEVIATING, queries=0, seconds=0.0,
                            seed_labels=top1_labels(p_original, p_compressed),
                            seed_probabilities=top1(p_original, p_compressed))
        self.save(lane, record, None, None)  # no trigger: the seed image is not stored

    def save(self, lane: _Lane, record: SeedRecord, trigger: np.ndarray | None, seed_image: np.ndarray | None) -> None:
        """Keep one finished seed: in the lane, in its campaign folder (when it has one), on the progress bar.
        ``seed_image`` is kept with its trigger; without a trigger it may be None."""
        lane.records[record.index] = record
        if trigger is not None:
            lane.images[record.index] = (trigger, seed_image)
            self._triggers += 1
        if lane.store is not None:
            lane.store.append(record, trigger, seed_image)
        self._progress.update(1)
        self._refresh_progress()

    def _refresh_progress(self) -> None:
        """Triggers found and queries per second on the bar, at most twice a second."""
        now = time.perf_counter()
        if now - self._last_postfix > 0.5:
            self._last_postfix = now
            rate = self._inputs / max(now - self._clock_start, 1e-9)
            self._progress.set_postfix(triggers=self._triggers, queries_per_s=f"{rate:.0f}")


#: Most inputs one search may propose per call when few seeds are left. On the LeNet-5 pair,
#: 0.7% of all inputs were dropped unused with this cap (most mutants of a slow seed are
#: rejected, which is what speculation assumes).
MAX_SPECULATION = 16


def _in_place(inputs: np.ndarray, slot: np.ndarray) -> bool:
    """Whether a search returned the first rows of ``slot`` (its inputs written there), not arrays of its own."""
    return (inputs.__array_interface__["data"][0] == slot.__array_interface__["data"][0]
            and inputs.strides == slot.strides)


def off_host(original, compressed: list) -> bool:
    """Whether any of the models runs on a GPU (its ``provider`` names CUDA). A campaign then overlaps
    by default: otherwise the host waits while the device computes a batch, and the device waits while
    the host mutates and scores the next. On a CPU the two would compete for the same cores."""
    return any("cuda" in str(getattr(model, "provider", "")).lower() for model in [original, *compressed])


def overlaps_by_default(original, compressed: list, executor=None) -> bool:
    """Whether a campaign overlaps when not told: when a model runs on a GPU (:func:`off_host`) where the
    searches run, i.e. here, or on Ray workers given a GPU share (which load the models as this process did)."""
    return off_host(original, compressed) and searches_share_the_models_gpu(executor)


def shift_count(overlap: bool) -> int:
    """Shifts of seeds a campaign runs: two with ``overlap`` (one at the models, one searching), else one."""
    return 2 if overlap else 1


def seeds_in_flight(batch: int, overlap: bool) -> int:
    """Seeds searched at once per campaign: ``batch`` per shift (a Ray chunk's default size too)."""
    return batch * shift_count(overlap)


def _speculation_depth(active: int, batch: int) -> int:
    """Inputs per search in this call: 1 while ``batch`` seeds fill the call, more as they finish."""
    return 1 if active >= batch else min(MAX_SPECULATION, -(-batch // active))


def top1(p_original: np.ndarray, p_compressed: np.ndarray) -> tuple[float, float]:
    return float(np.max(p_original)), float(np.max(p_compressed))
