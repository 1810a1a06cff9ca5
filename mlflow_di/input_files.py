"""Files a user names, opened by type: a regular file where a file is expected, read with a byte limit.

``stat`` says how big a regular file is, but not a device (``/dev/zero`` has size 0 and never ends)
or a FIFO (opening it blocks until a writer comes). So a file is checked to be regular before it is
opened, and read with a limit of one byte more than allowed: a file that grows after the check
still cannot take more memory than that.
"""
from __future__ import annotations

import os
import pathlib
import stat

from mlflow_di.errors import UserError


def regular_file(path, what: str) -> pathlib.Path:
    """``path`` when it is an existing regular file (links followed), else a one-line UserError naming ``what``."""
    path = pathlib.Path(path).expanduser()
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"{what} '{path}' does not exist") from None
    except OSError as exc:
        raise UserError(f"cannot read the {what} '{path}': {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise UserError(f"{what} '{path}' is a folder; name the file itself")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise UserError(f"{what} '{path}' is {kind}, not a regular file; save it to a file and name that")
    return path


def read_bounded(path, limit: int, what: str) -> bytes:
    """The bytes of the regular file at ``path``; a UserError when it is not one or holds more than ``limit``."""
    path = regular_file(path, what)
    try:
        with open(path, "rb") as handle:
            content = handle.read(limit + 1)
    except OSError as exc:
        raise UserError(f"cannot read the {what} '{path}': {exc.strerror or exc}") from None
    if len(content) > limit:
        raise UserError(f"the {what} '{path}' holds more than {limit:,} bytes; check that this is the right file")
    return content


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
