"""What an experiment returns and how it is kept: rows of numbers plus the settings behind them.

Each finished experiment is saved as ``<out>/<name>.json`` right away, so an interrupted run
keeps what it finished and the report can be re-rendered from the files alone.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import statistics
import sys
import threading
import time

import numpy as np


@dataclasses.dataclass
class ExperimentResult:
    """``rows``: one dict per table row (plain numbers and strings); ``meta``: what was run."""

    name: str
    rows: list[dict]
    meta: dict
    config: dict
    seconds: float = 0.0
    finished: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ExperimentResult":
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=_plain)

    @classmethod
    def from_json(cls, text: str) -> "ExperimentResult":
        return cls.from_dict(json.loads(text))

    def save(self, out: pathlib.Path) -> pathlib.Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.name}.json"
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, out: pathlib.Path, name: str) -> "ExperimentResult | None":
        path = out / f"{name}.json"
        return cls.from_json(path.read_text()) if path.is_file() else None


def _plain(value):
    """JSON for numpy scalars/arrays and paths."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, pathlib.Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value); NaN for none."""
    values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


_STOP = threading.Event()


def request_stop() -> None:
    """Ask the harness to stop (its SIGINT/SIGTERM handler does): the next :func:`checkpoint` raises."""
    _STOP.set()


def checkpoint() -> None:
    """Raise ``KeyboardInterrupt`` if a stop was asked. The library's campaigns and searches catch
    an interrupt to keep their finished seeds and return; without this, an experiment would go on
    with its next campaign after the signal (every progress line is a checkpoint)."""
    if _STOP.is_set():
        raise KeyboardInterrupt


class Log:
    """Progress lines with a timestamp, to stderr and (optionally) a log file, flushed at once.
    Calling it is a :func:`checkpoint`; :meth:`note` writes without one (the harness's own last lines)."""

    def __init__(self, path: pathlib.Path | None = None, quiet: bool = False):
        self.path, self.quiet = path, quiet
        self.started = time.perf_counter()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, message: str) -> None:
        checkpoint()
        self.note(message)

    def note(self, message: str) -> None:
        line = f"[{now()} +{time.perf_counter() - self.started:7.0f}s] {message}"
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)
        if self.path is not None:
            with self.path.open("a") as handle:
                handle.write(line + "\n")
