"""One process at a time in a folder: an advisory lock file that names its holder's PID.

Why: two processes writing one campaign folder (a ``--resume`` started while the first still runs)
append the same seeds twice and mark each other's live run KILLED; two services on one state
folder run the same jobs. The lock is ``flock`` on a file beside the folder (``.NAME.lock``, so
the folder, whose files are logged as artifacts, holds only its own), removed on release. The
kernel releases an ``flock`` when its holder dies however it dies (a file left by a killed
process blocks nobody), and the lock is re-entrant within a process (a command that locks a
campaign folder can call the engine that locks it again). Where ``flock`` does not exist (Windows) nothing is locked.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import threading

from mlflow_di.errors import UserError

_held: dict[str, list] = {}  # resolved lock path -> [open file, holders in this process]
_guard = threading.Lock()


class FolderLock:
    """The lock on ``folder`` (created if absent). ``what`` names the folder's role in the error
    another process gets; ``advice`` says what that process can do instead; ``lock_file``: where
    the lock lives (default ``.NAME.lock`` beside the folder; removed when released)."""

    def __init__(self, folder, what: str, advice: str = "wait for it to finish or stop it", lock_file=None):
        self.folder = pathlib.Path(folder)
        self.what, self.advice = what, advice
        self.lock_file = pathlib.Path(lock_file) if lock_file else self.folder.parent / f".{self.folder.name}.lock"
        self._key: str | None = None

    def acquire(self) -> "FolderLock":
        """Take the lock, or raise a one-line :class:`UserError` naming the holder's PID."""
        try:
            import fcntl
        except ImportError:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        key = str(self.lock_file.resolve())
        with _guard:
            if key in _held:
                _held[key][1] += 1
                self._key = key
                return self
            while True:
                handle = open(key, "a+")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    handle.seek(0)
                    holder = handle.read().strip() or "?"
                    handle.close()
                    raise UserError(f"another mlflow-di process (pid {holder}) is using {self.what} {self.folder}; "
                                    f"{self.advice}") from None
                if _same_file(handle, key):
                    break
                handle.close()  # its holder removed the file after we opened it: lock the new one
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            _held[key] = [handle, 1]
            self._key = key
        return self

    def release(self) -> None:
        if self._key is None:
            return
        with _guard:
            entry = _held.get(self._key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:  # remove the file while holding it, then release by closing
                    with contextlib.suppress(OSError):
                        os.unlink(self._key)
                    entry[0].close()
                    del _held[self._key]
            self._key = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(handle, path: str) -> bool:
    """Whether ``path`` still names the file ``handle`` has open (a releasing holder unlinks it)."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except OSError:
        return False
