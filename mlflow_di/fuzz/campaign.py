"""Run a differential fuzzing campaign: many seeds, two black-box models, one strategy.

Lockstep: up to ``batch`` seeds are searched at once. Each iteration asks every active search
for its next inputs, sends all of them through each model in one batched ``predict_proba``
call, and gives every search its own rows back. Each seed has its own generator,
``np.random.default_rng([seed, seed_index])``, so its queries, decisions and result are the
same as when it runs alone (``batch=1``) with the same campaign seed, given a model whose
output for an image does not depend on the rest of the batch.

Time: a seed is charged its own mutation/bookkeeping time plus its share of each batched
model call, in proportion to the inputs it contributed (when several campaigns share the
original, an input is charged the original's cost per distinct image, what it would cost alone). The per-seed ``timeout`` applies to
that charged time, so a seed gets the same compute budget whether it runs alone or with 63
others, and the seeds' times add up to the campaign's time.

Speculation: once fewer than ``batch`` seeds are left, each search may propose several inputs
per call (``depth``, up to :data:`MAX_SPECULATION`), so that the last, slowest seeds still fill
a batched call instead of paying a model call's fixed cost per query. A search uses only the
inputs its algorithm would have queried one at a time (see :class:`~mlflow_di.fuzz.dflare.DFlareSearch`);
results and query counts do not change.

Queries: one query is one input through both models; the seed's own check is not counted, nor
are speculative inputs a search dropped unused (they count in ``RunStats.inputs``).
Seeds on which the models already disagree are recorded apart and not searched.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
import numpy as np
from mlflow_di.progress import progress_bar as tqdm

from mlflow_di.data import ImageSet, fingerprint
from mlflow_di.errors import UserError
from mlflow_di.fuzz.fitness import labels_differ, top1_labels
from mlflow_di.fuzz.realism import distances
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, RunStats, SeedRecord, Stop
from mlflow_di.fuzz.search import Search
from mlflow_di.fuzz.store import CampaignStore, assemble_result
from mlflow_di.fuzz.strategies import make_strategy


def run_campaign(original, compressed, seeds: ImageSet, strategy="dflare", timeout: float = 180.0,
                 max_queries: int | None = None, batch: int = 64, seed: int = 0, out_dir=None,
                 resume: bool = False, progress: bool = True, executor=None) -> CampaignResult:
    """Search each seed for an input on which ``original`` and ``compressed`` disagree.

    ``original``/``compressed``: black boxes with ``predict_proba(uint8 NHWC) -> (N, C)``.
    ``strategy``: a name of :data:`~mlflow_di.fuzz.strategies.STRATEGIES` ('dflare', 'dflare-paper', ...,
    'diffchaser') or a strategy object.
    ``timeout`` (seconds) and ``max_queries`` limit each seed's search. ``batch``: seeds
    searched in lockstep (results do not depend on it). ``out_dir``: where records and
    triggers are saved as seeds finish; ``resume=True`` continues a campaign found there.

    A KeyboardInterrupt stops the campaign early: finished seeds are kept (on disk too) and
    the returned result has ``complete=False``. ``executor``: see :func:`run_campaigns`.
    """
    return run_campaigns(original, [compressed], seeds, strategy=strategy, timeout=timeout, max_queries=max_queries,
                         batch=batch, seed=seed, out_dirs=None if out_dir is None else [out_dir], resume=resume,
                         progress=progress, executor=executor)[0]


def run_campaigns(original, compressed: list, seeds: ImageSet, strategy="dflare", timeout: float = 180.0,
                  max_queries: int | None = None, batch: int = 64, seed: int = 0, out_dirs: list | None = None,
                  resume: bool = False, progress: bool = True, executor=None) -> list[CampaignResult]:
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
    runner = _Lockstep(original, lanes, seeds, strategy, batch)
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
        self.active: list[_Active] = []
        self._buffer: np.ndarray | None = None

    def stack(self, proposals: list[np.ndarray], image_shape: tuple) -> np.ndarray:
        """This iteration's proposals as one batch, in a buffer the lane reuses: a fresh array per call
        pays for its pages (64 inputs at 224 px: 25-42 µs per input copied into a new array, 19-21 into
        the reused one, on a 2-core machine). The models read the batch before the next iteration
        overwrites it; the searches keep their own arrays."""
        total = sum(len(p) for p in proposals)
        if self._buffer is None or len(self._buffer) < total:
            self._buffer = np.empty((total, *image_shape), np.uint8)
        return np.concatenate(proposals, out=self._buffer[:total]) if proposals else self._buffer[:0]

    def todo_indices(self, count: int) -> set[int]:
        return {i for i in range(count) if i not in self.done}

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.active)


class _Lockstep:
    """Runs the searches of one or more campaigns, ``batch`` seeds at a time per campaign, with one
    batched call of the original (each distinct input once) and one of each compressed model per iteration."""

    def __init__(self, original, lanes: list[_Lane], seeds: ImageSet, strategy, batch: int):
        self.original, self.lanes = original, lanes
        self.seeds, self.strategy, self.batch = seeds, strategy, batch
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
        """Every lane's seeds in this process, ``batch`` at a time per lane (seeds already deviating are recorded at once)."""
        for lane in self.lanes:
            for row, index in enumerate(lane.todo):
                if labels_differ(lane.p_original[row], lane.p_compressed[row]):
                    self._finish_deviating(lane, int(index), lane.p_original[row], lane.p_compressed[row])
                else:
                    lane.pending.append((int(index), lane.p_original[row], lane.p_compressed[row]))
        while any(lane.busy for lane in self.lanes):
            for lane in self.lanes:
                while lane.pending and len(lane.active) < self.batch:
                    lane.active.append(self._start(lane, *lane.pending.popleft()))
            self._step()
            for lane in self.lanes:
                lane.active = [a for a in lane.active if not self._maybe_finish(lane, a)]

    def _start(self, lane: _Lane, index: int, p_original: np.ndarray, p_compressed: np.ndarray) -> _Active:
        began = time.perf_counter()
        rng = np.random.default_rng([lane.config.seed, index])
        image = self.seeds.images[index]  # read once (a lazy set decodes it), kept while the seed is searched
        search = self.strategy.start(image, p_original, p_compressed, rng)
        return _Active(index, search, (p_original, p_compressed), image, time.perf_counter() - began)

    def _step(self) -> None:
        """One lockstep iteration over every campaign: propose, one batched call per model, observe."""
        clock = time.perf_counter
        proposals: list[list[np.ndarray]] = []
        began = clock()
        for lane in self.lanes:
            limit = lane.config.max_queries
            depth = _speculation_depth(len(lane.active), self.batch) if lane.active else 1
            mine = []
            for a in lane.active:  # one clock reading per search: the end of one search's turn starts the next
                mine.append(a.search.propose(None if limit is None else limit - a.search.queries, depth))
                now = clock()
                a.seconds += now - began
                began = now
            proposals.append(mine)
        lane_inputs = [lane.stack(mine, self.seeds.image_shape) for lane, mine in zip(self.lanes, proposals)]
        total = sum(len(inputs) for inputs in lane_inputs)
        if total == 0:  # only exhausted searches this time
            return
        p_original, original_seconds, distinct = self._original_probabilities(lane_inputs)
        # each input is charged what it costs the original alone (per distinct image), so a seed gets
        # the compute budget of a separate campaign; charged times then add up to more than the wall time
        original_share = original_seconds / distinct
        self.shared_original_inputs += distinct
        self._inputs += total
        start_original = 0
        for lane, mine, inputs in zip(self.lanes, proposals, lane_inputs):
            if not len(inputs):
                continue
            began = clock()
            p_compressed = lane.compressed.predict_proba(inputs)
            now = clock()
            compressed_share = (now - began) / len(inputs)
            share = original_share + compressed_share
            lane_original = p_original[start_original:start_original + len(inputs)]
            start_original += len(inputs)
            start = 0
            began = now
            for a, proposal in zip(lane.active, mine):
                stop = start + len(proposal)
                a.search.observe(lane_original[start:stop], p_compressed[start:stop])
                now = clock()
                a.seconds += now - began + share * len(proposal)
                a.model_seconds += share * len(proposal)
                began = now
                start = stop
            lane.stats.model_seconds += share * len(inputs)
            lane.stats.calls += 1
            lane.stats.inputs += len(inputs)
            lane.stats.original_inputs += len(inputs) * distinct / total
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


def _speculation_depth(active: int, batch: int) -> int:
    """Inputs per search in this call: 1 while ``batch`` seeds fill the call, more as they finish."""
    return 1 if active >= batch else min(MAX_SPECULATION, -(-batch // active))


def top1(p_original: np.ndarray, p_compressed: np.ndarray) -> tuple[float, float]:
    return float(np.max(p_original)), float(np.max(p_compressed))
