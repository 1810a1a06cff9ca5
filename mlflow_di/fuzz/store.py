"""A campaign's output directory, written while the campaign runs.

Layout::

    campaign.json           CampaignConfig (written first; resume checks it)
    records.jsonl           one SeedRecord per line, appended as each seed finishes
    triggers/NNNNNN.npz     per triggering seed: ``trigger`` and ``seed`` (uint8 H, W, C)
    summary.json            CampaignSummary (at the end, or when interrupted)
    triggers.npz            all triggers: ``triggers``, ``seeds``, ``indices`` (at the end)
    neuron_coverage.json    DeepXplore only: NC reached per model (at the end)

A seed's trigger file is complete before its record line is appended, so every record that
says ``success`` has its images even if the process dies right after. A torn last line (the
process died mid-write) is ignored and that seed runs again on resume, as does a seed stopped by
the time safety net (``timeout``): its new record is appended after the old one, which it replaces.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib

import numpy as np

from mlflow_di.errors import UserError
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, CampaignSummary, SeedRecord, Stop

CONFIG = "campaign.json"
RECORDS = "records.jsonl"
TRIGGER_DIR = "triggers"
SUMMARY = "summary.json"
ALL_TRIGGERS = "triggers.npz"
NEURON_COVERAGE = "neuron_coverage.json"


class CampaignStore:
    """Reads and writes one campaign directory (see the module docstring)."""

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)
        self._records_file = None

    @property
    def exists(self) -> bool:
        return (self.directory / CONFIG).exists()

    def create(self, config: CampaignConfig) -> None:
        """Start a new campaign here; refuses a directory that already holds one."""
        if self.exists:
            raise UserError(f"'{self.directory}' already holds a fuzzing campaign; "
                            "resume it (resume=True / --resume) or choose another output directory")
        (self.directory / TRIGGER_DIR).mkdir(parents=True, exist_ok=True)
        _write_atomically(self.directory / CONFIG, config.to_json())
        (self.directory / RECORDS).write_text("")

    def check_resumable(self, config: CampaignConfig) -> None:
        """Raise unless this directory holds a campaign with the same settings as ``config``."""
        if not self.exists:
            raise UserError(f"nothing to resume: '{self.directory}' holds no fuzzing campaign ({CONFIG} missing)")
        stored = self.read_config()
        differing = stored.differences(config)
        if differing:
            raise UserError(f"cannot resume the campaign in '{self.directory}': its {', '.join(differing)} "
                            "differ from this run's; use the same settings or another output directory")

    def extend(self, seed_count: int, seeds_sha256: str, prefix_sha256) -> int:
        """Grow the stored campaign to ``seed_count`` seeds whose fingerprint is ``seeds_sha256``, when its own seeds
        are their first ones (``prefix_sha256(count)``: the fingerprint of the first ``count`` new seeds); returns
        the seed count it grew from. A campaign of other seeds is a one-line UserError."""
        import dataclasses

        stored = self.read_config()
        if stored.seed_count >= seed_count:
            return stored.seed_count
        if prefix_sha256(stored.seed_count) != stored.seeds_sha256:
            raise UserError(f"cannot extend the campaign in '{self.directory}' to {seed_count} seeds: its "
                            f"{stored.seed_count} seeds are not the first of the new ones (other seed data?); use "
                            "the same --seed-data or another output directory")
        _write_atomically(self.directory / CONFIG,
                          dataclasses.replace(stored, seed_count=seed_count, seeds_sha256=seeds_sha256).to_json())
        return stored.seed_count

    def read_config(self) -> CampaignConfig:
        try:
            return CampaignConfig.from_json((self.directory / CONFIG).read_text())
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"'{self.directory / CONFIG}' is not a campaign config: {exc}") from None

    def read_records(self, finished_only: bool = False) -> dict[int, SeedRecord]:
        """Recorded seeds by index (a torn last line is skipped; a seed recorded twice is its last record).
        ``finished_only``: leave out seeds stopped by the time safety net, which ``resume`` searches again."""
        path = self.directory / RECORDS
        records: dict[int, SeedRecord] = {}
        if not path.exists():
            return records
        for line in path.read_text().splitlines():
            try:
                record = SeedRecord.from_json(line)
            except (ValueError, TypeError, KeyError):
                continue  # interrupted mid-write; the seed runs again
            if record.success and not self.trigger_path(record.index).exists():
                continue
            records[record.index] = record
        if finished_only:
            return {index: record for index, record in records.items() if record.stop is not Stop.TIMEOUT}
        return records

    def trigger_path(self, index: int) -> pathlib.Path:
        return self.directory / TRIGGER_DIR / f"{index:06d}.npz"

    def append(self, record: SeedRecord, trigger: np.ndarray | None, seed_image: np.ndarray | None) -> None:
        """Persist one finished seed: its images first (if it triggered; ``seed_image`` is needed only
        then), then its record line."""
        if trigger is not None:
            path = self.trigger_path(record.index)
            with _replacing(path, path.with_suffix(".partial.npz")) as partial:
                np.savez(partial, trigger=trigger, seed=seed_image)
        if self._records_file is None:
            _drop_torn_tail(self.directory / RECORDS)
            self._records_file = open(self.directory / RECORDS, "a", encoding="utf-8")
        end = self._records_file.tell()
        try:
            self._records_file.write(record.to_json() + "\n")
            self._records_file.flush()
        except OSError:  # disk full: cut the torn line, so a resumed campaign appends after whole records
            self._records_file.close()
            self._records_file = None
            with contextlib.suppress(OSError):
                os.truncate(self.directory / RECORDS, end)
            raise

    def read_trigger(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(trigger, seed) images of one triggering seed."""
        with np.load(self.trigger_path(index)) as archive:
            return archive["trigger"], archive["seed"]

    def finish(self, summary: CampaignSummary, triggers: np.ndarray, seeds: np.ndarray, indices: np.ndarray,
               neuron_coverage: dict | None = None) -> None:
        """Write the summary and the consolidated triggers (and DeepXplore's neuron coverage); close the records file."""
        self.close()
        if neuron_coverage is not None:
            _write_atomically(self.directory / NEURON_COVERAGE, json.dumps(neuron_coverage, indent=2, sort_keys=True))
        _write_atomically(self.directory / SUMMARY, summary.to_json())
        with _replacing(self.directory / ALL_TRIGGERS, self.directory / "triggers.partial.npz") as partial:
            np.savez_compressed(partial, triggers=triggers, seeds=seeds, indices=indices)

    def close(self) -> None:
        if self._records_file is not None:
            self._records_file.close()
            self._records_file = None

    def load(self) -> CampaignResult:
        """The campaign as it stands on disk (complete or not)."""
        config = self.read_config()
        records = sorted(self.read_records().values(), key=lambda r: r.index)
        result = assemble_result(config, records, self, complete=len(records) == config.seed_count)
        if (self.directory / NEURON_COVERAGE).exists():
            result.neuron_coverage = json.loads((self.directory / NEURON_COVERAGE).read_text())
        return result


def assemble_result(config: CampaignConfig, records: list[SeedRecord], store: "CampaignStore | None",
                    complete: bool, images: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> CampaignResult:
    """A :class:`CampaignResult` from records; trigger images from ``images`` or else the store."""
    images = images or {}
    found = [r.index for r in records if r.success]
    pairs = [images[i] if i in images else store.read_trigger(i) for i in found]
    shape = (0, *config.image_shape)
    return CampaignResult(
        config=config,
        summary=CampaignSummary.from_records(config.strategy, records),
        records=records,
        triggers=np.stack([t for t, _ in pairs]) if pairs else np.zeros(shape, np.uint8),
        trigger_seeds=np.stack([s for _, s in pairs]) if pairs else np.zeros(shape, np.uint8),
        trigger_indices=np.asarray(found, np.int64),
        complete=complete,
    )


def load_campaign(directory) -> CampaignResult:
    """Load a campaign directory written by :func:`~mlflow_di.fuzz.campaign.run_campaign`."""
    store = CampaignStore(directory)
    if not store.exists:
        raise UserError(f"'{directory}' holds no fuzzing campaign ({CONFIG} missing)")
    return store.load()


def _write_atomically(path: pathlib.Path, text: str) -> None:
    with _replacing(path, path.with_name(path.name + ".partial")) as partial:
        partial.write_text(text)


@contextlib.contextmanager
def _replacing(path: pathlib.Path, partial: pathlib.Path):
    """Write ``partial`` in the block, then put it in ``path``'s place; on a failed write (a full
    disk) remove it, so a reader never meets half a file and the campaign folder keeps no debris."""
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def _drop_torn_tail(path: pathlib.Path) -> None:
    """Cut what follows the last newline of a records file (a line torn by a full disk or a kill mid-write),
    so records appended now start on a line of their own and the file holds whole records only."""
    try:
        with open(path, "rb+") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size == 0:
                return
            position = size
            while position > 0:
                step = min(65536, position)
                handle.seek(position - step)
                block = handle.read(step)
                newline = block.rfind(b"\n")
                if newline >= 0:
                    position = position - step + newline + 1
                    break
                position -= step
            if position != size:
                handle.truncate(position)
    except FileNotFoundError:
        return
