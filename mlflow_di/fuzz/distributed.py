"""Fuzz campaigns on Ray: the lockstep runner on chunks of seeds, in long-lived worker actors.

Roles. The driver (the process that called :func:`~mlflow_di.fuzz.campaign.run_campaigns`)
checks the seeds, splits the seeds still to search into chunks, and is the only process that
writes the campaign folders (and, in the CLI, the only one that talks to MLflow). Each worker is a
Ray actor that loads the original and every compressed model once (shipped as files by
:mod:`mlflow_di.models.shipping`, so it needs no tracking credentials) and runs the same
lockstep search as a local campaign on each chunk it is given, ``batch`` seeds at a time (per shift,
when the campaign overlaps its model calls with its searches).

Same results. A seed's search draws from its own generator, keyed by the campaign seed and the
seed's index, and a chunk carries the driver's first predictions of its seeds; so under
``max_queries`` every seed's record is the one a local campaign writes (only times differ).

Nothing lost, nothing twice. A chunk's records come back only when the whole chunk is finished,
and the driver saves them then. A worker that dies is restarted by Ray and its chunk runs again
from the start (Ray's ``max_restarts``/``max_task_retries``); its records were never saved, so
none is written twice. A chunk that keeps killing its worker stops the campaign with one line
after :attr:`RayExecutor.max_retries` retries; finished chunks stay saved and ``resume`` continues.

Chunk size: smaller chunks lose less work to a dead worker and show progress sooner; chunks of at
least ``batch`` seeds keep the lockstep's batched model calls full. The default is ``batch``, twice
that when the campaign overlaps (two shifts of ``batch`` seeds, see :func:`~mlflow_di.fuzz.campaign.run_campaigns`).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from mlflow_di._ray import LOCAL, check_address, check_workers, connect as _connect, first_line as _first_line
from mlflow_di.errors import UserError

__all__ = ["LOCAL", "RayExecutor", "check_address"]


def searches_share_the_models_gpu(executor) -> bool:
    """Whether the searches run on the GPU the driver loaded a CUDA model on: in this process
    (``executor`` None), or on Ray workers each given a GPU share (``gpus_per_worker`` > 0), which
    load the models with the same device (Ray makes their share their ``cuda:0``). Workers without
    a share run the models on their CPU."""
    return executor is None or getattr(executor, "gpus_per_worker", 0) > 0


@dataclasses.dataclass
class RayExecutor:
    """Runs a campaign's searches on ``workers`` Ray actors (pass it as ``run_campaigns(..., executor=)``).

    ``address``: ``local`` starts Ray on this machine, bound to 127.0.0.1, without its dashboard or
    usage reports (stopped again when the campaign ends); ``auto`` or ``ray://HOST:PORT`` join a
    running cluster. When Ray is already initialised in this process, that cluster is used.
    ``cpus_per_worker``/``gpus_per_worker``: each actor's Ray resources (fractions allowed; a
    worker given a GPU loads PyTorch models with the device the driver asked for, ``auto`` = CUDA).
    ``chunk_size``: seeds per chunk (default: the campaign's ``batch``, twice that when it overlaps).
    """

    workers: int = 2
    address: str | None = LOCAL
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    chunk_size: int | None = None
    max_retries: int = 3
    #: filled in by :meth:`execute`: chunks, workers started, each chunk's seconds inside its worker, the seconds
    #: after the start at which each came back, and how many
    #: chunks a restarted worker ran (among them those it held when its process or node was lost, run again)
    stats: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check_workers(self.workers, self.cpus_per_worker, self.gpus_per_worker, "a fuzz campaign")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise UserError(f"chunk size must be at least 1 seed, got {self.chunk_size}")
        self.address = check_address(self.address)

    def execute(self, runner) -> None:
        """Search ``runner``'s seeds (a :class:`~mlflow_di.fuzz.lockstep.Lockstep`) on the workers;
        each chunk's finished seeds go to ``runner.save`` as the chunk comes back."""
        ray, started = _connect(self.address)
        try:
            self._execute(ray, runner)
        finally:
            if started:
                ray.shutdown()

    def _execute(self, ray, runner) -> None:
        from mlflow_di.models.shipping import ship

        chunks = _chunks(runner, self.chunk_size or runner.seeds_in_flight)
        if not chunks:
            return
        worker_class = ray.remote(_Worker).options(
            num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
            max_restarts=self.max_retries, max_task_retries=self.max_retries)
        # in the object store once; handed to each call inside a list, so Ray does not resolve it per call
        # and a restarted worker loads the models again on its first chunk
        models = [ray.put((ship(runner.original), [ship(lane.compressed) for lane in runner.lanes]))]
        actors = [worker_class.remote(runner.strategy, runner.batch, tuple(runner.seeds.image_shape), runner.overlap)
                  for _ in range(min(self.workers, len(chunks)))]
        queue = list(reversed(chunks))
        running: dict = {}  # object ref -> (actor, chunk)
        began = time.perf_counter()
        self.stats = {"chunks": len(chunks), "workers": len(actors), "chunk_seconds": [], "returned_seconds": [],
                      "chunks_on_restarted_workers": 0}
        try:
            for actor in actors * 2:  # two chunks per worker: the next is there when one finishes
                if queue:
                    chunk = queue.pop()
                    running[actor.search.remote(_payload(runner, chunk), models)] = (actor, chunk)
            while running:
                [ready], _ = ray.wait(list(running), num_returns=1)
                actor, chunk = running.pop(ready)
                try:
                    outcome = ray.get(ready)
                except ray.exceptions.RayTaskError as exc:  # the search itself raised: as it would locally
                    cause = exc.cause
                    raise (UserError(str(cause)) if isinstance(cause, UserError) else cause) from None
                except ray.exceptions.RayError as exc:  # the worker died more often than Ray may restart it
                    raise UserError(f"a Ray worker died on seeds {chunk[0]}..{chunk[-1]} {self.max_retries + 1} "
                                    f"times ({_first_line(exc)}); the seeds finished so far are saved (resume the "
                                    "campaign to continue)") from None
                _save_chunk(runner, outcome)
                self.stats["chunk_seconds"].append(outcome["seconds"])
                self.stats["returned_seconds"].append(time.perf_counter() - began)
                self.stats["chunks_on_restarted_workers"] += int(outcome.get("restarted", False))
                if queue:
                    chunk = queue.pop()
                    running[actor.search.remote(_payload(runner, chunk), models)] = (actor, chunk)
        finally:  # also on Ctrl-C: unfinished chunks are dropped with their workers, finished ones are saved
            for actor in actors:
                ray.kill(actor)


class _Worker:
    """A Ray actor: the models loaded on its first chunk and kept, then the lockstep search of one chunk per call."""

    def __init__(self, strategy, batch: int, image_shape: tuple, overlap: bool = False):
        self.strategy, self.batch, self.image_shape, self.overlap = strategy, batch, image_shape, overlap
        self.original = self.compressed = None

    def search(self, payload: dict, models: list) -> dict:
        import time

        import ray

        from mlflow_di.fuzz.lockstep import Lane, Lockstep
        from mlflow_di.fuzz.session import CampaignSession
        from mlflow_di.models.shipping import unship

        began = time.perf_counter()
        if self.original is None:
            original, compressed = ray.get(models[0])
            self.original, self.compressed = unship(original), [unship(model) for model in compressed]
        seeds = _SeedView(payload["images"], payload["labels"], self.image_shape)
        lanes = []
        for number, (config, todo, p_original, p_compressed) in enumerate(payload["lanes"]):
            lane = Lane(self.compressed[number], CampaignSession(config))  # no folder: the driver writes the seeds
            lane.todo, lane.p_original, lane.p_compressed = todo, p_original, p_compressed
            lanes.append(lane)
        runner = Lockstep(self.original, lanes, seeds, self.strategy, self.batch, self.overlap)
        runner.run(progress=False)
        # a restarted worker (its process or its node lost) runs the chunks it held again from their start
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        return {"lanes": [(lane.records, lane.images, lane.stats) for lane in lanes],
                "shared_original_inputs": runner.shared_original_inputs, "seconds": time.perf_counter() - began,
                "restarted": bool(restarted)}


class _SeedView:
    """The seeds of one chunk, read by their campaign index as the lockstep runner reads a whole set."""

    def __init__(self, images: dict, labels: dict, image_shape: tuple):
        self.images, self.labels, self.image_shape = images, labels, image_shape

    def __len__(self) -> int:
        return len(self.images)


def _chunks(runner, size: int) -> list[np.ndarray]:
    """The seed indices any lane still has to search, in order, ``size`` at a time."""
    todo = sorted(set().union(*(map(int, lane.todo) for lane in runner.lanes)))
    return [np.asarray(todo[start:start + size], np.int64) for start in range(0, len(todo), size)]


def _payload(runner, chunk: np.ndarray) -> dict:
    """What a worker needs for ``chunk``: its seeds' images and labels, and per lane its share of the
    seeds with the driver's first predictions (so a worker never re-checks a seed)."""
    lanes = []
    for lane in runner.lanes:
        rows = np.flatnonzero(np.isin(lane.todo, chunk))
        lanes.append((lane.config, lane.todo[rows], lane.p_original[rows], lane.p_compressed[rows]))
    images = runner.seeds.images[chunk]  # one read of the chunk (a lazy set decodes just these)
    return {"images": {int(index): images[row] for row, index in enumerate(chunk)},
            "labels": {int(index): int(runner.seeds.labels[index]) for index in chunk},
            "lanes": lanes}


def _save_chunk(runner, outcome: dict) -> None:
    """A finished chunk's seeds into the driver's lanes and campaign folders, in seed order."""
    for lane, (records, images, stats) in zip(runner.lanes, outcome["lanes"]):
        for index in sorted(records):
            runner.save(lane, records[index], *images.get(index, (None, None)))  # (trigger, seed) of a trigger
        for field in dataclasses.fields(stats):
            setattr(lane.stats, field.name, getattr(lane.stats, field.name) + getattr(stats, field.name))
    runner.shared_original_inputs += outcome["shared_original_inputs"]
