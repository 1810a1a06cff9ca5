"""Workers: each takes a job from the queue and runs its pipeline in a subprocess (or, with ``serve
--ray-address``, in an actor on a Ray cluster: :mod:`mlflow_di.service.ray_jobs`).

Why a subprocess: a crash, a leak or an out-of-memory kill in one model's pipeline must not take
the service (and the other jobs) with it. The child runs in its own session (process group), so
stopping it stops everything it started, and a terminal's Ctrl-C reaches only the service, which
then stops its children itself. The pipeline's output is appended to one log file per job, one
header line per attempt.

The child's exit code decides (:func:`mlflow_di.service.queue.outcome`): 0 passed, 1 failed (the
gate said no), 2 error (bad input); anything else is retried with backoff until
``max_attempts``. When the service stops, the child's process group is terminated and the job
stays ``running`` in the queue: the next start puts it back and the pipeline resumes.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import threading
import time
from typing import Callable, Protocol

from mlflow_di import processes
from mlflow_di.service.queue import Job, JobQueue, outcome

#: Seconds a terminated pipeline gets to end its runs before it is killed.
STOP_GRACE_S = 10.0


@dataclasses.dataclass
class Runner:
    """What a worker needs: the queue, how to build a job's command line and log path, the
    retry rules, a stop event, and ``report(job, line)`` for one-line transitions."""

    queue: JobQueue
    argv: Callable[[Job], list[str]]
    log_path: Callable[[Job], pathlib.Path]
    max_attempts: int
    backoff_s: float
    stop: threading.Event
    report: Callable[[Job, str], None]
    env: dict | None = None
    idle_s: float = 0.5
    report_error: Callable[[str], None] = print
    launcher: "Launcher" = dataclasses.field(default_factory=lambda: LocalLauncher())

    def loop(self) -> None:
        """Run jobs until :attr:`stop` is set."""
        while not self.stop.is_set():
            try:
                job = self.queue.claim()
                if job is None:
                    self.stop.wait(self.idle_s)
                    continue
                self.run(job)
            except Exception as exc:  # noqa: BLE001 - e.g. a full disk: say so, keep the worker alive
                self.report_error(f"worker: {type(exc).__name__}: {str(exc).strip()[:300]}")
                self.stop.wait(5.0)

    def run(self, job: Job) -> Job:
        """Run one claimed job's pipeline to its end (or until the service stops); returns the job after."""
        log_path = self.log_path(job)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.report(job, f"running (attempt {job.attempts}, log {log_path})")
        started = time.monotonic()
        with log_path.open("ab") as log:
            log.write(f"\n{ATTEMPT_HEADER}{job.attempts} at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode())
            log.flush()
            try:
                pipeline = self.launcher.start(self.argv(job), self.env, log)
            except (OSError, PipelineLost) as exc:
                return self._after(job, None, f"cannot start the pipeline: {exc}", started)
            if pipeline.pid is not None:
                self.queue.set_pid(job.id, pipeline.pid)
            while True:
                try:
                    code = pipeline.poll()
                except PipelineLost as exc:
                    return self._after(job, None, str(exc), started)
                if code is not None:
                    break
                if self.stop.wait(0.5):
                    pipeline.stop()
                    self.report(job, "stopped with the service; it resumes on the next start")
                    return self.queue.job(job.id)
        cause = last_error_line(log_path)
        return self._after(job, code, f"pipeline exited with code {code}"
                           + (f": {cause}" if cause and code != 0 else ""), started)

    def _after(self, job: Job, code: int | None, message: str, started: float) -> Job:
        seconds = time.monotonic() - started
        result = outcome(code) if code is not None else "retry"
        if result == "retry":
            job = self.queue.retry(job.id, code, message, self.max_attempts, self.backoff_s)
            if job.state == "queued":
                wait = max(0.0, job.next_attempt_at - time.time())
                self.report(job, f"queued again: {message} after {seconds:.1f} s; retry in {wait:.0f} s")
            else:
                self.report(job, f"error: {job.message}")
        else:
            job = self.queue.finish(job.id, result, code, message)
            self.report(job, f"{result} (exit {code}, {seconds:.1f} s)")
        return job


class PipelineLost(Exception):
    """The pipeline's process is gone without an exit code (its Ray actor or node was lost): the job is retried."""


class Launcher(Protocol):
    """Where a job's pipeline runs: :class:`LocalLauncher` (a subprocess here) or
    :class:`mlflow_di.service.ray_jobs.RayLauncher` (an actor on a Ray cluster)."""

    def start(self, argv: list[str], env: dict | None, log) -> "Pipeline":
        """Start ``argv`` (``python -m mlflow_di.cli pipeline ...`` for a job), its output appended to ``log``."""

    def close(self) -> None:
        """Release what the launcher holds (a Ray connection) when the service stops."""


class Pipeline(Protocol):
    """A started pipeline: ``pid`` (on this machine; None elsewhere), ``poll()`` (its exit code, None while it
    runs; raises :class:`PipelineLost`) and ``stop()`` (SIGTERM, then SIGKILL after a grace period)."""

    pid: int | None

    def poll(self) -> int | None: ...

    def stop(self) -> None: ...


class LocalLauncher:
    """Each pipeline a subprocess of the service, in its own session (process group)."""

    def start(self, argv: list[str], env: dict | None, log) -> "LocalPipeline":
        return LocalPipeline(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env, start_new_session=True))

    def close(self) -> None:
        """Nothing to release: each pipeline is stopped by its worker."""


@dataclasses.dataclass
class LocalPipeline:
    """A pipeline subprocess on this machine."""

    child: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.child.pid

    def poll(self) -> int | None:
        return self.child.poll()

    def stop(self) -> None:
        stop_group(self.child)


#: The header :meth:`Runner.run` writes before each attempt's output in a job's log.
ATTEMPT_HEADER = "=== attempt "


def last_error_line(log_path, tail_bytes: int = 16384) -> str:
    """The cause the last attempt's pipeline printed (its ``mlflow-di: error: ...`` line), so ``/jobs``
    and the service's log say why a job ended in error without anyone opening the log file; ''
    if that attempt printed none (a crash: an earlier attempt's cause is not this one's)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - tail_bytes))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    starts = [number for number, line in enumerate(lines) if line.startswith(ATTEMPT_HEADER)]
    prefix = "mlflow-di: error: "
    found = [line[len(prefix):].strip() for line in lines[starts[-1] if starts else 0:] if line.startswith(prefix)]
    return found[-1][:500] if found else ""


def stop_group(child: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(child.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            child.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def stop_orphan(pid: int, marker: str, grace: float = STOP_GRACE_S) -> bool:
    """Stop the process group of ``pid`` when it is still a pipeline of ours (its command line
    contains ``marker``; a recycled pid is left alone). True when one was stopped.

    Reads ``/proc``; where there is none, nothing is stopped (the rerun then waits on nothing and
    the pipeline's state file keeps the two from repeating finished steps)."""
    cmdline = pathlib.Path(f"/proc/{pid}/cmdline")
    try:
        if marker not in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
            return False
    except OSError:
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(pid, signal.SIGCONT)  # a stopped (Ctrl-Z'd, SIGSTOPped) pipeline acts on it too
        except (ProcessLookupError, PermissionError):
            return True
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            if not processes.alive(pid):
                return True
            time.sleep(0.2)
    return True
