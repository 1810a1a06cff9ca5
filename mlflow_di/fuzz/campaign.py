"""Run a differential fuzzing campaign: many seeds, two black-box models, one strategy.

Lockstep: up to ``batch`` seeds are searched at once. Each iteration asks every active search
for its next inputs, sends all of them through each model in one batched ``predict_proba``
call, and gives every search its own rows back. Each seed has its own generator,
``np.random.default_rng([seed, seed_index])``, so its queries, decisions and result are the
same as when it runs alone (``batch=1``) with the same campaign seed, given a model whose
output for an image does not depend on the rest of the batch.

Time: a seed is charged its own mutation/bookkeeping time plus its share of each batched
model call, in proportion to the inputs it contributed. The per-seed ``timeout`` applies to
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

from mlflow_di.data import ImageSet
from mlflow_di.errors import UserError
from mlflow_di.fuzz.fitness import labels_differ, top1_labels
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, RunStats, SeedRecord, Stop
from mlflow_di.fuzz.search import Search
from mlflow_di.fuzz.store import CampaignStore, assemble_result
from mlflow_di.fuzz.strategies import make_strategy


def run_campaign(original, compressed, seeds: ImageSet, strategy="dflare", timeout: float = 180.0,
                 max_queries: int | None = None, batch: int = 64, seed: int = 0, out_dir=None,
                 resume: bool = False, progress: bool = True) -> CampaignResult:
    """Search each seed for an input on which ``original`` and ``compressed`` disagree.

    ``original``/``compressed``: black boxes with ``predict_proba(uint8 NHWC) -> (N, C)``.
    ``strategy``: a name of :data:`~mlflow_di.fuzz.strategies.STRATEGIES` ('dflare', 'dflare-paper', ...,
    'diffchaser') or a strategy object.
    ``timeout`` (seconds) and ``max_queries`` limit each seed's search. ``batch``: seeds
    searched in lockstep (results do not depend on it). ``out_dir``: where records and
    triggers are saved as seeds finish; ``resume=True`` continues a campaign found there.

    A KeyboardInterrupt stops the campaign early: finished seeds are kept (on disk too) and
    the returned result has ``complete=False``.
    """
    strategy = make_strategy(strategy)
    _check_arguments(seeds, timeout, max_queries, batch, out_dir, resume)
    config = CampaignConfig(
        strategy=strategy.name, strategy_options=strategy.options(), timeout=float(timeout),
        max_queries=max_queries, seed=int(seed), data=seeds.name, seed_count=len(seeds),
        seeds_sha256=_fingerprint(seeds, progress), image_shape=tuple(seeds.image_shape),
        original=_name(original, "original"), compressed=_name(compressed, "compressed"))
    store = CampaignStore(out_dir) if out_dir is not None else None
    done: dict[int, SeedRecord] = {}
    if store is not None and resume:
        store.check_resumable(config)
        done = store.read_records()
    todo = np.array([i for i in range(len(seeds)) if i not in done], dtype=np.int64)
    p_original, p_compressed = _check_seeds(original, compressed, seeds, todo, fuzzed_before=any(
        not r.already_deviating for r in done.values()), progress=progress)
    if store is not None and not resume:
        store.create(config)
    runner = _Lockstep(original, compressed, seeds, strategy, config, batch, store)
    try:
        runner.run(todo, p_original, p_compressed, done, progress)
    finally:
        if store is not None:
            store.close()
    records = sorted({**done, **runner.records}.values(), key=lambda r: r.index)
    result = assemble_result(config, records, store, complete=len(records) == len(seeds), images=runner.images)
    result.run_stats = runner.stats
    if store is not None:
        store.finish(result.summary, result.triggers, result.trigger_seeds, result.trigger_indices)
    return result


def _check_arguments(seeds: ImageSet, timeout, max_queries, batch, out_dir, resume) -> None:
    if not isinstance(seeds, ImageSet):
        raise UserError(f"seeds must be an ImageSet (see mlflow_di.data.load_images), got {type(seeds).__name__}")
    if len(seeds) == 0:
        raise UserError("no seed images given")
    if not timeout or timeout <= 0:
        raise UserError(f"timeout must be a positive number of seconds, got {timeout}")
    if max_queries is not None and max_queries < 1:
        raise UserError(f"max_queries must be at least 1, got {max_queries}")
    if batch < 1:
        raise UserError(f"batch must be at least 1, got {batch}")
    if resume and out_dir is None:
        raise UserError("resume needs the output directory of the campaign to continue (out_dir=..., or --out-dir on the command line)")


def _name(model, fallback: str) -> str:
    return str(getattr(model, "name", None) or fallback)


#: Seeds read per batch when the seed set is walked (fingerprint, first predictions): a lazy set
#: (folder:, npz:) is decoded this many images at a time, never whole.
SEED_BATCH = 256


def _fingerprint(seeds: ImageSet, progress: bool = False) -> str:
    """SHA-256 of every seed's pixels, then the labels (the same digest whether the seeds are lazy or not)."""
    digest = hashlib.sha256()
    for images in tqdm(seeds.batches(SEED_BATCH), total=-(-len(seeds) // SEED_BATCH), desc="seed fingerprint",
                       unit="batch", disable=not progress, leave=False):
        digest.update(np.ascontiguousarray(images).tobytes())
    digest.update(np.ascontiguousarray(seeds.labels).tobytes())
    return digest.hexdigest()


def _predict(model, images: np.ndarray, role: str) -> np.ndarray:
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


def _check_seeds(original, compressed, seeds: ImageSet, todo: np.ndarray, fuzzed_before: bool, progress: bool = False):
    """Both models' probabilities on the seeds still to run, after checking the pair fits."""
    if len(todo) == 0:
        return np.zeros((0, 0)), np.zeros((0, 0))
    p_original, p_compressed = [], []
    for start in tqdm(range(0, len(todo), SEED_BATCH), desc="seed predictions", unit="batch", disable=not progress,
                      leave=False):  # in batches: the seeds may be bigger than memory
        images = seeds.images[todo[start:start + SEED_BATCH]]
        p_original.append(_predict(original, images, "original"))
        p_compressed.append(_predict(compressed, images, "compressed"))
    p_original, p_compressed = np.concatenate(p_original), np.concatenate(p_compressed)
    if p_original.shape[1] != p_compressed.shape[1]:
        raise UserError(f"the models disagree on the number of classes: original '{_name(original, 'original')}' "
                        f"has {p_original.shape[1]}, compressed '{_name(compressed, 'compressed')}' has "
                        f"{p_compressed.shape[1]}; compare a model with its own compressed version")
    deviating = labels_differ(p_original, p_compressed)
    if deviating.all() and not fuzzed_before:
        raise UserError(f"the two models already disagree on all {len(todo)} seeds, so there is nothing to fuzz; "
                        "check that the compressed model belongs to the original and that both use the "
                        "right preprocessing")
    return p_original, p_compressed


@dataclasses.dataclass
class _Active:
    """A seed being searched: its index, image, search and charged seconds."""

    index: int
    search: Search
    seed_probabilities: tuple[np.ndarray, np.ndarray]
    seed_image: np.ndarray
    seconds: float = 0.0
    model_seconds: float = 0.0


class _Lockstep:
    """Runs searches for many seeds, ``batch`` at a time, one batched model call per iteration."""

    def __init__(self, original, compressed, seeds: ImageSet, strategy, config: CampaignConfig,
                 batch: int, store: CampaignStore | None):
        self.original, self.compressed = original, compressed
        self.seeds, self.strategy, self.config = seeds, strategy, config
        self.batch, self.store = batch, store
        self.records: dict[int, SeedRecord] = {}
        self.images: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._progress = None
        self.stats = RunStats()
        self._clock_start = time.perf_counter()
        self._last_postfix = 0.0

    def run(self, todo: np.ndarray, p_original: np.ndarray, p_compressed: np.ndarray,
            done: dict[int, SeedRecord], progress: bool) -> None:
        self._triggers = sum(r.success for r in done.values())
        self._progress = tqdm(total=len(self.seeds), initial=len(done), disable=not progress,
                              desc=f"fuzz {self.strategy.name}", unit="seed", dynamic_ncols=True)
        pending = collections.deque()
        for row, index in enumerate(todo):
            if labels_differ(p_original[row], p_compressed[row]):
                self._finish_deviating(int(index), p_original[row], p_compressed[row])
            else:
                pending.append((int(index), p_original[row], p_compressed[row]))
        active: list[_Active] = []
        try:
            while pending or active:
                while pending and len(active) < self.batch:
                    active.append(self._start(*pending.popleft()))
                self._step(active)
                active = [a for a in active if not self._maybe_finish(a)]
        except KeyboardInterrupt:
            self._progress.write(f"interrupted: {len(self.records)} seeds finished in this run are saved; "
                                 f"{len(active) + len(pending)} not finished")
        finally:
            self._last_postfix = 0.0  # the final counts, whatever the rate limit
            self._refresh_progress()
            self._progress.close()

    def _start(self, index: int, p_original: np.ndarray, p_compressed: np.ndarray) -> _Active:
        began = time.perf_counter()
        rng = np.random.default_rng([self.config.seed, index])
        image = self.seeds.images[index]  # read once (a lazy set decodes it), kept while the seed is searched
        search = self.strategy.start(image, p_original, p_compressed, rng)
        return _Active(index, search, (p_original, p_compressed), image, time.perf_counter() - began)

    def _step(self, active: list[_Active]) -> None:
        """One lockstep iteration: propose, one batched call per model, observe."""
        limit = self.config.max_queries
        depth = _speculation_depth(len(active), self.batch)
        clock = time.perf_counter
        proposals = []
        began = clock()
        for a in active:  # one clock reading per search: the end of one search's turn starts the next
            proposals.append(a.search.propose(None if limit is None else limit - a.search.queries, depth))
            now = clock()
            a.seconds += now - began
            began = now
        inputs = np.concatenate(proposals) if len(proposals) > 1 else proposals[0]
        p_original = self.original.predict_proba(inputs)
        p_compressed = self.compressed.predict_proba(inputs)
        now = clock()
        model_seconds = now - began
        share = model_seconds / len(inputs)
        start = 0
        began = now
        for a, proposal in zip(active, proposals):
            stop = start + len(proposal)
            a.search.observe(p_original[start:stop], p_compressed[start:stop])
            now = clock()
            a.seconds += now - began + share * len(proposal)
            a.model_seconds += share * len(proposal)
            began = now
            start = stop
        self.stats.model_seconds += model_seconds
        self.stats.calls += 1
        self.stats.inputs += len(inputs)
        self._refresh_progress()  # also while a few long searches finish alone

    def _maybe_finish(self, a: _Active) -> bool:
        search = a.search
        if search.found:
            stop = Stop.TRIGGER
        elif self.config.max_queries is not None and search.queries >= self.config.max_queries:
            stop = Stop.MAX_QUERIES
        elif a.seconds >= self.config.timeout:
            stop = Stop.TIMEOUT
        else:
            return False
        self._save(self._record(a, stop), search.trigger, a.seed_image)
        self.stats.search_seconds += a.seconds - a.model_seconds
        return True

    def _record(self, a: _Active, stop: Stop) -> SeedRecord:
        search = a.search
        p_seed = a.seed_probabilities
        record = SeedRecord(
            index=a.index, label=int(self.seeds.labels[a.index]), success=search.found, stop=stop,
            queries=search.queries, seconds=a.seconds,
            seed_labels=top1_labels(*p_seed), seed_probabilities=_top1(*p_seed),
            operators=list(search.trigger_operators),
            operator_counts={name: [int(s), int(c)] for name, s, c in
                             zip(search.operator_names, search.stats.selected, search.stats.accepted)})
        if search.found:
            record.trigger_labels = top1_labels(*search.trigger_probabilities)
            record.trigger_probabilities = _top1(*search.trigger_probabilities)
        return record

    def _finish_deviating(self, index: int, p_original: np.ndarray, p_compressed: np.ndarray) -> None:
        record = SeedRecord(index=index, label=int(self.seeds.labels[index]), success=False,
                            stop=Stop.ALREADY_DEVIATING, queries=0, seconds=0.0,
                            seed_labels=top1_labels(p_original, p_compressed),
                            seed_probabilities=_top1(p_original, p_compressed))
        self._save(record, None, self.seeds.images[index])

    def _save(self, record: SeedRecord, trigger: np.ndarray | None, seed_image: np.ndarray) -> None:
        self.records[record.index] = record
        if trigger is not None:
            self.images[record.index] = (trigger, seed_image)
            self._triggers += 1
        if self.store is not None:
            self.store.append(record, trigger, seed_image)
        self._progress.update(1)
        self._refresh_progress()

    def _refresh_progress(self) -> None:
        """Triggers found and queries per second on the bar, at most twice a second."""
        now = time.perf_counter()
        if now - self._last_postfix > 0.5:
            self._last_postfix = now
            rate = self.stats.inputs / max(now - self._clock_start, 1e-9)
            self._progress.set_postfix(triggers=self._triggers, queries_per_s=f"{rate:.0f}")


#: Most inputs one search may propose per call when few seeds are left. On the LeNet-5 pair,
#: 0.7% of all inputs were dropped unused with this cap (most mutants of a slow seed are
#: rejected, which is what speculation assumes).
MAX_SPECULATION = 16


def _speculation_depth(active: int, batch: int) -> int:
    """Inputs per search in this call: 1 while ``batch`` seeds fill the call, more as they finish."""
    return 1 if active >= batch else min(MAX_SPECULATION, -(-batch // active))


def _top1(p_original: np.ndarray, p_compressed: np.ndarray) -> tuple[float, float]:
    return float(np.max(p_original)), float(np.max(p_compressed))
