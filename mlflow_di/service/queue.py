"""The service's job queue: one sqlite file in the state folder, one row per model version.

Why sqlite: the queue must survive the service being killed at any moment (jobs are the record
of what was promised), and a single file in the state folder needs no other service. WAL mode
lets ``/jobs`` read while a worker writes.

Rules the schema and the methods keep:

- A version is enqueued at most once: ``UNIQUE (model, version)``; enqueueing it again (the
  poller and a webhook both saw it, a webhook delivered twice) changes nothing.
- ``claim()`` is atomic (``BEGIN IMMEDIATE``): two workers, even in two processes, never get the
  same job. It takes the oldest job that is ``queued`` and due (``next_attempt_at``).
- States: ``queued`` -> ``running`` -> ``passed`` | ``failed`` | ``inconclusive`` | ``error`` (final),
  or back to ``queued`` with an exponential backoff for a retry. ``attempts`` counts the runs started.
  A queue file written before ``inconclusive`` existed is migrated when opened.
- :meth:`JobQueue.recover` (at start) puts jobs a dead service left ``running`` back in the queue,
  due at once; the interrupted run does not count as an attempt (the service died, not the job).
  The pipeline's own state file makes the rerun resume where the interrupted one stopped.
- Version tags are written from the queue, not at each transition: :meth:`JobQueue.untagged`
  lists jobs whose state the registry does not show yet, so a registry that is briefly down
  delays the tags but loses none.
"""
from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time

STATES = ("queued", "running", "passed", "failed", "inconclusive", "error")
FINAL = ("passed", "failed", "inconclusive", "error")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'running', 'passed', 'failed', 'inconclusive', 'error')),
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    source TEXT NOT NULL DEFAULT '',
    exit_code INTEGER,
    message TEXT NOT NULL DEFAULT '',
    pid INTEGER,
    tagged TEXT NOT NULL DEFAULT '',
    UNIQUE (model, version)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclasses.dataclass(frozen=True)
class Job:
    id: int
    model: str
    version: str
    state: str
    attempts: int
    next_attempt_at: float
    created_at: float
    updated_at: float
    source: str
    exit_code: int | None
    message: str
    pid: int | None
    tagged: str

    @property
    def key(self) -> str:
        """``NAME/VERSION``, how log lines name the job."""
        return f"{self.model}/{self.version}"

    @property
    def tag_mark(self) -> str:
        """What the version tags must show for this job (compared with ``tagged``)."""
        return f"{self.state}/{self.attempts}"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("tagged")
        return out


def backoff_delay(attempts: int, base: float, cap: float = 3600.0) -> float:
    """Seconds before retry number ``attempts`` (1 after the first failed run): base, 2 base, 4 base, ..."""
    return min(cap, base * 2 ** max(0, attempts - 1))


def outcome(exit_code: int) -> str:
    """What a pipeline's exit code means for its job: ``passed`` (0), ``failed`` (1: the gate said
    no; final), ``error`` (2: bad input, e.g. the version cannot be loaded; final), ``inconclusive``
    (3: the evidence the policy allows could not decide a check; final) or ``retry`` (anything else: a
    crash, a kill, an MLflow outage)."""
    return {0: "passed", 1: "failed", 2: "error", 3: "inconclusive"}.get(exit_code, "retry")


class JobQueue:
    """The queue in the sqlite file at ``path`` (created when absent). Thread-safe; ``clock``
    (seconds, like :func:`time.time`) is replaceable for tests of the backoff."""

    def __init__(self, path, clock=time.time):
        self.path = str(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        with self._lock:
            self._db.executescript(_SCHEMA)
            self._migrate()

    def _migrate(self) -> None:
        """A queue file from before the ``inconclusive`` state: the jobs table rebuilt with the new CHECK (sqlite
        cannot alter one), its rows kept, in one transaction."""
        sql = self._db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'jobs'").fetchone()[0]
        if "'inconclusive'" in sql:
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("ALTER TABLE jobs RENAME TO jobs_before_inconclusive")
            self._db.execute(_SCHEMA.split(";")[0])  # the jobs table (executescript would commit first)
            self._db.execute("INSERT INTO jobs SELECT * FROM jobs_before_inconclusive")
            self._db.execute("DROP TABLE jobs_before_inconclusive")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------------------ writing
    def _write(self, sql: str, args=()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def enqueue(self, model: str, version: str, source: str = "") -> bool:
        """Queue ``model``/``version`` unless it was ever queued; True when this call queued it."""
        now = self._clock()
        cursor = self._write("INSERT OR IGNORE INTO jobs (model, version, state, next_attempt_at, created_at, "
                             "updated_at, source) VALUES (?, ?, 'queued', ?, ?, ?, ?)",
                             (model, str(version), now, now, now, source))
        return cursor.rowcount == 1

    def claim(self) -> Job | None:
        """The oldest due ``queued`` job, now ``running`` with one more attempt; None when none is due."""
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT id FROM jobs WHERE state = 'queued' AND next_attempt_at <= ? "
                                       "ORDER BY id LIMIT 1", (now,)).fetchone()
                if row is not None:
                    self._db.execute("UPDATE jobs SET state = 'running', attempts = attempts + 1, pid = NULL, "
                                     "updated_at = ? WHERE id = ?", (now, row["id"]))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return None if row is None else self.job(row["id"])

    def set_pid(self, job_id: int, pid: int | None) -> None:
        """Record the pipeline subprocess of a running job (so a restart can stop an orphan)."""
        self._write("UPDATE jobs SET pid = ? WHERE id = ?", (pid, job_id))

    def finish(self, job_id: int, state: str, exit_code: int | None = None, message: str = "") -> Job:
        """End a job in the final ``state`` (passed, failed, error)."""
        if state not in FINAL:
            raise ValueError(f"{state!r} is not a final state {FINAL}")
        self._write("UPDATE jobs SET state = ?, exit_code = ?, message = ?, pid = NULL, updated_at = ? WHERE id = ?",
                    (state, exit_code, message, self._clock(), job_id))
        return self.job(job_id)

    def drop_vanished(self, job_id: int, message: str) -> Job:
        """A job whose version was deleted: ``error`` with ``message`` when it was still queued (a
        running one ends by its pipeline's exit code); the job as it is now."""
        self._write("UPDATE jobs SET state = 'error', message = ?, pid = NULL, updated_at = ? "
                    "WHERE id = ? AND state = 'queued'", (message, self._clock(), job_id))
        return self.job(job_id)

    def retry(self, job_id: int, exit_code: int | None, message: str, max_attempts: int, base_delay: float) -> Job:
        """After a run that crashed: queued again after :func:`backoff_delay`, or ``error`` once
        ``max_attempts`` runs were made."""
        job = self.job(job_id)
        if job.attempts >= max_attempts:
            return self.finish(job_id, "error", exit_code, f"{message} (gave up after {job.attempts} attempts)")
        now = self._clock()
        self._write("UPDATE jobs SET state = 'queued', exit_code = ?, message = ?, pid = NULL, next_attempt_at = ?, "
                    "updated_at = ? WHERE id = ?",
                    (exit_code, message, now + backoff_delay(job.attempts, base_delay), now, job_id))
        return self.job(job_id)

    def recover(self) -> list[Job]:
        """Jobs left ``running`` (by a service that died), back to ``queued`` and due now, their
        interrupted attempt not counted. Returns them as they were (``pid``: the pipeline process
        that may still run), for the caller to stop such orphans first."""
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute("SELECT * FROM jobs WHERE state = 'running' ORDER BY id").fetchall()
                self._db.execute("UPDATE jobs SET state = 'queued', attempts = MAX(0, attempts - 1), pid = NULL, "
                                 "next_attempt_at = ?, updated_at = ?, message = 'resumed after a restart' "
                                 "WHERE state = 'running'", (now, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return [Job(**dict(row)) for row in rows]

    def mark_tagged(self, job_id: int, mark: str) -> None:
        """The version tags now show ``mark`` (a :attr:`Job.tag_mark`)."""
        self._write("UPDATE jobs SET tagged = ? WHERE id = ?", (mark, job_id))

    def first_started_at(self) -> float:
        """When a service first used this queue (recorded on the first call): the poller's start line."""
        now = self._clock()
        self._write("INSERT OR IGNORE INTO meta (key, value) VALUES ('first_started_at', ?)", (repr(now),))
        return float(self.meta("first_started_at"))

    # ------------------------------------------------------------------------------ reading
    def meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row["value"]

    def job(self, job_id: int) -> Job:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        return Job(**dict(row))

    def find(self, model: str, version: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE model = ? AND version = ?",
                                   (model, str(version))).fetchone()
        return None if row is None else Job(**dict(row))

    def jobs(self, state: str | None = None) -> list[Job]:
        """Every job (of ``state``), oldest first."""
        with self._lock:
            if state is None:
                rows = self._db.execute("SELECT * FROM jobs ORDER BY id").fetchall()
            else:
                rows = self._db.execute("SELECT * FROM jobs WHERE state = ? ORDER BY id", (state,)).fetchall()
        return [Job(**dict(row)) for row in rows]

    def counts(self) -> dict[str, int]:
        """{state: number of jobs}, every state present."""
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state").fetchall()
        return {**{state: 0 for state in STATES}, **{row["state"]: row["n"] for row in rows}}

    def untagged(self) -> list[Job]:
        """Jobs whose version tags do not show their state and attempts yet."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE tagged != state || '/' || attempts ORDER BY id").fetchall()
        return [Job(**dict(row)) for row in rows]
