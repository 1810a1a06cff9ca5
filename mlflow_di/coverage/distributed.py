"""Coverage passes on Ray Data: ``coverage --workers N``.

:class:`RayPasses` runs a pass's per-batch job (:mod:`mlflow_di.coverage.partials`) with Ray Data:
a dataset of batch ranges ``[a, b)`` (exactly the local path's batches, so every image is computed
in the batch it is computed in locally) goes through ``map_batches`` on a pool of ``workers``
actors with ``cpus_per_worker``/``gpus_per_worker`` Ray resources each (fractions allowed). Each
actor loads the model once (shipped as files, :mod:`mlflow_di.models.shipping`, so workers need
no tracking credentials) and the images once: a data spec the driver names in ``specs`` is read by
the workers themselves (``folder:``/``npz:`` lazily, one batch at a time), anything else goes
through Ray's object store once. A batch's result comes back as one row holding its partial
aggregates; the driver merges them order-independently (``partials.merge_fit``/``merge_score``),
so results equal the local path's bit for bit. Rows the driver's math needs input by input (IDC's
analysis activations, LSC/DSC traces) are Parquet trace files the workers write into
``trace_dir``, which must be a folder every node sees (default: a temporary folder on the driver,
right for a cluster on one machine).

Clustering (IDC), the KDE and nearest neighbours (LSC/DSC) and every report stay on the driver.
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
    """Runs coverage passes on Ray Data actors (``CoverageSuite.fit/score(..., passes=)``); use it as a context
    manager so a cluster it starts (``address="local"``) is stopped at the end.

    ``specs``: data specs (as ``load_images`` takes them) the workers may read themselves: an
    ImageSet whose ``name`` is one of them is re-read by each worker (and passed through the
    model's raw-image step when the driver's images have another shape); other sets travel
    through the object store. ``trace_dir``: where workers write trace files (a shared folder on
    a cluster of several machines). ``progress``: a bar of the batches as they come back.
    ``stats`` (filled in per pass): batches, workers, wall seconds, the workers' seconds inside
    batches, the longest model and data load in a worker, and the batches run by a restarted worker
    (Ray restarts a worker whose process or node was lost; the batches it held run again, and the
    results are the same).
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

    def __enter__(self) -> "RayPasses":
        self._connect()
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def close(self) -> None:
        """Stop the cluster this executor started (a cluster it joined keeps running)."""
        if self._ray is not None and self._started:
            self._ray.shutdown()
        self._ray, self._started = None, False

    def _connect(self):
        if self._ray is None:
            self._ray, self._started = connect(self.address)
            _quiet(self._ray)
        return self._ray

    @contextlib.contextmanager
    def run(self, job, model, images, batch_size: int):
        """Yield the :class:`~mlflow_di.coverage.partials.PassOutput` of ``job`` over ``images`` (an ImageSet)."""
        with self.run_many(job, model, [images], batch_size) as outputs:
            yield outputs[0]

    @contextlib.contextmanager
    def run_many(self, job, model, sets: Sequence, batch_size: int):
        """Yield one :class:`~mlflow_di.coverage.partials.PassOutput` per ImageSet of ``sets``, all from one
        Ray Data execution: one actor pool (and one model load per actor) for all of them."""
        from mlflow_di.coverage.partials import PassOutput, batch_ranges, new_trace_folder
        from mlflow_di.models.shipping import ship

        ray = self._connect()
        began = time.perf_counter()
        items = [{"set": number, "start": a, "stop": b}
                 for number, images in enumerate(sets) for a, b in batch_ranges(len(images), batch_size)]
        outputs = [PassOutput([], new_trace_folder(self.trace_dir)) for _ in sets]
        try:
            workers = min(self.workers, len(items))
            dataset = ray.data.from_items(items, override_num_blocks=len(items))
            results = dataset.map_batches(
                _PassWorker, batch_size=1, compute=ray.data.ActorPoolStrategy(size=workers),
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                # in lists, so Ray hands the actor references and the actor fetches the model and arrays once
                fn_constructor_kwargs={"model": [ray.put(ship(model))], "data": [self._data(ray, s) for s in sets],
                                       "job": job, "traces": [str(output.traces) for output in outputs]})
            from mlflow_di.progress import progress_bar

            try:
                for row in progress_bar(results.iter_rows(), total=len(items), desc=f"batches on {workers} Ray "
                                        f"worker{'s' if workers > 1 else ''}", disable=not self.progress,
                                        leave=False):
                    partial = pickle.loads(row["partial"])
                    if "error" in partial:
                        raise UserError(partial["error"])
                    outputs[int(row["set"])].partials.append(partial)
            except UserError:
                raise
            except Exception as exc:  # a worker failed: its one line, as the local path would say it
                raise UserError(f"a coverage pass failed on Ray: {_cause(exc)}") from None
            for output in outputs:
                output.partials.sort(key=lambda p: p["start"])
            done = [p for output in outputs for p in output.partials]
            self.stats.append({"batches": len(items), "workers": workers, "seconds": time.perf_counter() - began,
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
    """A Ray Data actor: the model and the images loaded once, then the job on each batch range it is given."""

    def __init__(self, model: list, data: list, job, traces: list):
        import ray

        from mlflow_di.models.shipping import unship

        began = time.perf_counter()
        self.model = unship(ray.get(model[0]))
        self.sets = [_worker_data(ray, one, self.model) for one in data]
        self.job, self.traces = job, traces
        self.load_seconds = time.perf_counter() - began

    def __call__(self, batch: dict) -> dict:
        import ray

        partials = []
        for number, start, stop in zip(batch["set"], batch["start"], batch["stop"]):
            number, start, stop = int(number), int(start), int(stop)
            images, labels = self.sets[number]
            began = time.perf_counter()
            try:
                partial = self.job(self.model, images[start:stop], labels[start:stop], start, self.traces[number])
            except UserError as exc:
                partial = {"start": start, "error": str(exc)}
            # a restarted actor (its process or its node lost) runs the batches it held again
            partial.update(seconds=time.perf_counter() - began, load_seconds=self.load_seconds,
                           restarted=bool(ray.get_runtime_context().was_current_actor_reconstructed))
            partials.append(pickle.dumps(partial))
        return {"set": np.asarray(batch["set"]), "partial": np.array(partials, dtype=object)}


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


def _quiet(ray) -> None:
    """No Ray Data progress bars, execution banners or notices in the command's output (errors still show)."""
    import logging

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.enable_operator_progress_bars = False
    context.print_on_execution_start = False
    context.enable_auto_log_stats = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)


def _cause(exc: BaseException) -> str:
    """The innermost cause's first line (Ray wraps a worker's exception in its own)."""
    while getattr(exc, "cause", None) is not None or exc.__cause__ is not None:
        exc = getattr(exc, "cause", None) or exc.__cause__
    return first_line(exc)
