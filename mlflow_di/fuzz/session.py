"""One campaign folder's lifecycle, the same for every runner (the lockstep of black-box searches,
the boundary walk, DeepXplore): a runner supplies only its search.

:class:`CampaignSession` takes the folder's lock (one process per folder: a second one would append
its seeds to the same records), reads on resume the seeds a previous run finished (a seed the time
safety net stopped is searched again), writes a new campaign's settings only once the runner has
checked its seeds (:meth:`~CampaignSession.start`, so a refused campaign leaves no folder behind),
appends each finished seed as it ends (an interrupted run loses none), and at the end merges the
earlier and the new records into one :class:`~mlflow_di.fuzz.results.CampaignResult` and writes its
summary and triggers. Without a folder nothing is written and nothing can be resumed.
"""
from __future__ import annotations

import numpy as np

from mlflow_di.folder_lock import FolderLock
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, RunStats, SeedRecord
from mlflow_di.fuzz.store import CampaignStore, assemble_result


class CampaignSession:
    """The folder ``out_dir`` (None: none) of one campaign with settings ``config``; a context manager
    that holds the folder's lock from entry to exit."""

    def __init__(self, config: CampaignConfig, out_dir=None, resume: bool = False):
        self.config, self.resume = config, resume
        self.store = CampaignStore(out_dir) if out_dir is not None else None
        self._lock = FolderLock(out_dir, "the campaign folder") if out_dir is not None else None
        #: the seeds a previous run finished (resume), by index: the runner searches the others
        self.done: dict[int, SeedRecord] = {}

    def __enter__(self) -> "CampaignSession":
        if self._lock is not None:
            self._lock.acquire()
        try:
            if self.store is not None and self.resume:
                self.store.check_resumable(self.config)
                self.done = self.store.read_records(finished_only=True)
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self._lock is not None:
            self._lock.release()

    def start(self) -> None:
        """Write a new campaign's settings (a resumed one has them): after the runner checked its seeds."""
        if self.store is not None and not self.resume:
            self.store.create(self.config)

    def append(self, record: SeedRecord, trigger: np.ndarray | None, seed_image: np.ndarray) -> None:
        """One finished seed, written at once."""
        if self.store is not None:
            self.store.append(record, trigger, seed_image)

    def close(self) -> None:
        """Close the records file (the searches are over, or were interrupted)."""
        if self.store is not None:
            self.store.close()

    def result(self, records: dict[int, SeedRecord], images: dict, run_stats: RunStats) -> CampaignResult:
        """The earlier and this run's records as one result (complete when every seed has a record); trigger
        images from ``images`` ({index: (trigger, seed)}) or else the folder."""
        self.close()
        merged = sorted({**self.done, **records}.values(), key=lambda record: record.index)
        result = assemble_result(self.config, merged, self.store, complete=len(merged) == self.config.seed_count,
                                 images=images)
        result.run_stats = run_stats
        return result

    def save(self, result: CampaignResult) -> None:
        """Write the result's summary and triggers (and DeepXplore's neuron coverage) to the folder."""
        if self.store is not None:
            self.store.finish(result.summary, result.triggers, result.trigger_seeds, result.trigger_indices,
                              neuron_coverage=result.neuron_coverage)
