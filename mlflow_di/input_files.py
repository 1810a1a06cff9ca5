"""Files a user names, opened by type: a regular file where a file is expected, read with a byte limit.

``stat`` says how big a regular file is, but not a device (``/dev/zero`` has size 0 and never ends)
or a FIFO (opening it blocks until a writer comes). So a file is checked to be regular before it is
opened, and read with a limit of one byte more than allowed: a file that grows after the check
still cannot take more memory than that.

What a file *declares* it holds (an npz member's shape, a model's input shape, an archive's unpacked
size) is checked against :func:`check_allocation` before anything of that size is allocated: one array
may take at most ``MLFLOW_DI_MAX_ARRAY_BYTES`` (default 1 GiB) and never more than half of the memory
available, so a zip bomb or a crafted header is one line, not a machine out of memory.
"""
from __future__ import annotations

import os
import pathlib
import stat

from mlflow_di.errors import UserError


def regular_file(path, what: str, advice: str = "save it to a file and name that") -> pathlib.Path:
    """``path`` when it is an existing regular file (links followed), else a one-line UserError naming ``what``
    (``advice``: what to do about a FIFO, a device or a socket, which is never opened: reading one can block)."""
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
        raise UserError(f"{what} '{path}' is {kind}, not a regular file; {advice}")
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


#: Bytes one array that a file declares may take when it is allocated whole (override: MLFLOW_DI_MAX_ARRAY_BYTES).
MAX_ARRAY_BYTES = 2**30


def array_limit() -> int:
    """The bytes one declared array may take: ``MLFLOW_DI_MAX_ARRAY_BYTES`` (a whole number) or 1 GiB."""
    text = os.environ.get("MLFLOW_DI_MAX_ARRAY_BYTES", "").strip()
    if not text:
        return MAX_ARRAY_BYTES
    try:
        limit = int(text.replace("_", ""))
    except ValueError:
        limit = 0
    if limit < 1:
        raise UserError(f"MLFLOW_DI_MAX_ARRAY_BYTES must be a positive whole number of bytes, got '{text}'")
    return limit


def check_allocation(what: str, needed: int, advice: str) -> None:
    """A one-line UserError, before allocating, when ``what`` (one array a file declares) would take more than
    :func:`array_limit` bytes or more than half the memory available; ``advice`` says what the user can do."""
    limit = array_limit()
    if needed > limit:
        raise UserError(f"{what} would take {amount(needed)}, more than the {amount(limit)} one array may "
                        f"(MLFLOW_DI_MAX_ARRAY_BYTES); {advice}")
    check_memory(what, needed, advice)


def check_memory(what: str, needed: int, advice: str) -> None:
    """A one-line UserError, before reading, when ``what`` (e.g. an archive's unpacked members, as its zip
    directory declares them) would take more than half the memory available."""
    available = available_memory()
    if available is not None and needed > available // 2:
        raise UserError(f"{what} would take {amount(needed)}, more than half of the {amount(available)} of memory "
                        f"available; {advice}")


def amount(size: int) -> str:
    """``size`` bytes as people read it: ``3,136 bytes``, ``12.3 MiB``, ``2.5 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size:,} bytes"
