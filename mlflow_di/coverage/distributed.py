"""Coverage passes on Ray: ``coverage --workers N``.

:class:`RayPasses` runs a pass's per-batch job (:mod:`mlflow_di.coverage.partials`) on a pool of
``workers`` Ray actors with ``cpus_per_worker``/``gpus_per_worker`` Ray resources each (fractions
allowed), over batch ranges ``[a, b)`` (exactly the local path's batches, so every image is
computed in the batch it is computed in locally).

One pool for every pass. The pool starts at the first pass and serves the fit and every scoring
pass after it until the executor is closed: each actor loads the model once (shipped as files,
:mod:`mlflow_di.models.shipping`, so workers need no tracking credentials). A pass sends its job
(the fitted state the batches need) and its images once through Ray's object store, or names a
data spec the workers read themselves (``folder:``/``npz:`` lazily, one batch at a time); each
batch is one call that returns its partial aggregates. Ray Data's ``map_batches`` was used before:
its actor pool lives for one dataset execution, and the fit and the scoring cannot be one
execution (scoring needs what the fit computed), so every pass paid a pool start: worker
processes, PyTorch imports and a model load (RESULTS, "Coverage on Ray").

The driver merges the partials order-independently (``partials.merge_fit``/``merge_score``), so
results equal the local path's bit for bit. Rows the driver's math needs input by input (IDC's
analysis activations, LSC/DSC traces) are Parquet trace files the workers write into
``trace_dir``, which must be a folder every node sees (default: a temporary folder on the driver,
right for a cluster on one machine). Clustering (IDC), the KDE and nearest neighbours (LSC/DSC)
and every report stay on the driver.

A lost worker (its process, or its node) is restarted by Ray and the batch it held runs again
(``max_restarts``/``max_task_retries``); trace files are written per batch, so a batch run twice
writes the same file again, and each partial comes back once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pickle
import time
from typing import Sequence

import numpy as np

from mlflow_di._ray import LOCAL, check_address, check_workers, connect, first_line
from mlflow_di.errors import UserError


@dataclasses.dataclass
class RayPasses:
    """Runs coverage passes on Ray actors (``CoverageSuite.fit/score(..., passes=)``); use it as a context manager
    so its actors, and a cluster it starts (``address="local"``), are stopped at the end.

    ``specs``: data specs (as ``load_images`` takes them) the workers may read themselves: an
    ImageSet whose ``name`` is one of them is re-read by each worker (and passed through the
    model's raw-image step when the driver's images have another shape); other sets travel
    through the object store. ``trace_dir``: where workers write trace files (a shared folder on
    a cluster of several machines). ``progress``: a bar of the batches as they come back.
    ``stats`` (filled in per pass): batches, workers, wall seconds, the seconds spent starting the
    pool (the first pass only), the workers' seconds inside batches, the longest model and data
    load in a worker, and the batches run by a restarted worker (Ray restarts a worker whose
    process or node was lost; the batches it held run again, and the results are the same).
    """

    workers: int = 2
    address: str | None = LOCAL
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    specs: Sequence[str] = ()
    trace_dir: str | None = None
    progress: bool = True
    stats: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        check_workers(self.workers, self.cpus_per_worker, self.gpus_per_worker, "coverage")
        self.address = check_address(self.address)
        self._ray = None
        self._started = False
        self._actors: list = []
        self._model = self._shipped = None
        self._passes = 0

    def __enter__(self) -> "RayPasses":
        self._connect()
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def close(self) -> None:
        """Stop the pool's actors and the cluster this executor started (a cluster it joined keeps running)."""
        if self._ray is not None:
            for actor in self._actors:
                self._ray.kill(actor)
            if self._started:
                self._ray.shutdown()
        self._ray, self._started, self._actors, self._model, self._shipped = None, False, [], None, None

    def _connect(self):
        if self._ray is None:
            self._ray, self._started = connect(self.address)
        return self._ray

    def _pool(self, ray, model) -> list:
        """The actors, started for ``model`` at the first pass (again only for another model)."""
        if self._model is not model:
            from mlflow_di.models.shipping import ship

            for actor in self._actors:
                ray.kill(actor)
            worker = ray.remote(_PassWorker).options(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                                                     max_restarts=-1, max_task_retries=-1)
            self._shipped = ray.put(ship(model))  # held while the pool lives: a restarted actor loads it again
            self._actors = [worker.remote([self._shipped]) for _ in range(self.workers)]
            ray.get([actor.ready.remote() for actor in self._actors])
            self._model = model
        return self._actors

    @contextlib.contextmanager
    def run(self, job, model, images, batch_size: int):
        """Yield the :class:`~mlflow_di.coverage.partials.PassOutput` of ``job`` over ``images`` (an ImageSet)."""
        with self.run_many(job, model, [images], batch_size) as outputs:
            yield outputs[0]

    @contextlib.contextmanager
    def run_many(self, job, model, sets: Sequence, batch_size: int):
        """Yield one :class:`~mlflow_di.coverage.partials.PassOutput` per ImageSet of ``sets``, all from one pass
        on the pool: each set's images sent (or named) once."""
        from mlflow_di.coverage.partials import PassOutput, batch_ranges, new_trace_folder
        from mlflow_di.progress import progress_bar

        ray = self._connect()
        began = time.perf_counter()
        items = [(number, a, b) for number, images in enumerate(sets) for a, b in batch_ranges(len(images), batch_size)]
        outputs = [PassOutput([], new_trace_folder(self.trace_dir)) for _ in sets]
        try:
            try:
                actors = self._pool(ray, model)
            except Exception as exc:  # noqa: BLE001 - a worker that cannot load the model: its one line
                raise UserError(f"coverage workers could not start on Ray: {_cause(exc)}") from None
            pool_seconds = time.perf_counter() - began
            self._passes += 1
            key = f"pass-{self._passes}"
            shared = {"key": key, "job": [ray.put(job)], "data": [self._data(ray, s) for s in sets],
                      "traces": [str(output.traces) for output in outputs]}
            calls = ray.util.ActorPool(actors).map_unordered(
                lambda actor, item: actor.run.remote(shared, *item), items)
            try:
                for row in progress_bar(calls, total=len(items), desc=f"batches on {len(actors)} Ray "
                                        f"worker{'s' if len(actors) > 1 else ''}", disable=not self.progress,
                                        leave=False):
                    number, partial = row
                    partial = pickle.loads(partial)
                    if "error" in partial:
                        raise UserError(partial["error"])
                    outputs[number].partials.append(partial)
            except UserError:
                raise
            except Exception as exc:  # a worker failed: its one line, as the local path would say it
                raise UserError(f"a coverage pass failed on Ray: {_cause(exc)}") from None
            for output in outputs:
                output.partials.sort(key=lambda p: p["start"])
            done = [p for output in outputs for p in output.partials]
            self.stats.append({"batches": len(items), "workers": len(actors), "seconds": time.perf_counter() - began,
                               "pool_seconds": pool_seconds,
                               "batch_seconds": sum(p["seconds"] for p in done),
                               "load_seconds": max(p["load_seconds"] for p in done),
                               "batches_on_restarted_workers": sum(p["restarted"] for p in done)})
            yield outputs
        finally:
            for output in outputs:
                output.close()

    def _data(self, ray, images) -> dict:
        """How the workers get ``images``: the spec to read, or the arrays in the object store."""
        if images.name in set(self.specs):
            return {"spec": images.name, "image_shape": tuple(images.image_shape), "rows": len(images)}
        return {"images": [ray.put(np.asarray(images.images))], "labels": [ray.put(np.asarray(images.labels))]}


class _PassWorker:
    """A pool actor: the model loaded once; each pass's job and images fetched once (the last pass's kept), then
    the job on each batch range it is given. Plain Python, made an actor by :meth:`RayPasses._pool`."""

    def __init__(self, model: list):
        import ray

        from mlflow_di.models.shipping import unship

        began = time.perf_counter()
        self.model = unship(ray.get(model[0]))
        self.load_seconds = time.perf_counter() - began
        self.key = None

    def ready(self) -> bool:
        return True

    def run(self, shared: dict, number: int, start: int, stop: int) -> tuple[int, bytes]:
        """(set number, the pickled partial of batch ``[start, stop)`` of set ``number``)."""
        import ray

        if shared["key"] != self.key:  # a new pass: its job and images, once
            began = time.perf_counter()
            self.job = ray.get(shared["job"][0])
            self.sets = [_worker_data(ray, one, self.model) for one in shared["data"]]
            self.key, self.load_seconds = shared["key"], self.load_seconds + time.perf_counter() - began
        images, labels = self.sets[number]
        began = time.perf_counter()
        try:
            partial = self.job(self.model, images[start:stop], labels[start:stop], start, shared["traces"][number])
        except UserError as exc:
            partial = {"start": start, "error": str(exc)}
        # a restarted actor (its process or its node lost) runs the batch it held again
        partial.update(seconds=time.perf_counter() - began, load_seconds=self.load_seconds,
                       restarted=bool(ray.get_runtime_context().was_current_actor_reconstructed))
        return number, pickle.dumps(partial)


def _worker_data(ray, data: dict, model):
    """(images, labels) a worker slices its batches from: read from the spec (lazily where the spec is) or fetched."""
    if "spec" not in data:
        return ray.get(data["images"][0]), ray.get(data["labels"][0])
    from mlflow_di.data import load_images

    images = load_images(data["spec"])
    if tuple(images.image_shape) != tuple(data["image_shape"]):
        images = model.preprocessing.prepare(images)
    if len(images) != data["rows"] or tuple(images.image_shape) != tuple(data["image_shape"]):
        raise UserError(f"a Ray worker reads '{data['spec']}' as {len(images)} images of {images.image_shape}, "
                        f"the driver as {data['rows']} of {tuple(data['image_shape'])}; give workers the same files")
    return images.images, images.labels


def _cause(exc: BaseException) -> str:
    """The innermost cause's first line (Ray wraps a worker's exception in its own)."""
    while getattr(exc, "cause", None) is not None or exc.__cause__ is not None:
        exc = getattr(exc, "cause", None) or exc.__cause__
    return first_line(exc)
