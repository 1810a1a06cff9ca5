"""The files a command writes besides MLflow's (``--json-out``, ``--junit-xml``, reports): written atomically,
so a reader (a CI step) sees the old file or the whole new one, and a failure is one :class:`WriteFailed`
line naming the file, with nothing half-written left behind."""
from __future__ import annotations

import json
import os
import pathlib


class WriteFailed(OSError):
    """An output file could not be written (disk full, permissions, a read-only mount): the CLI's
    one line names the file; nothing half-written is left behind."""

    def __init__(self, target, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause), str(target))


def write_json_out(payload: dict, path: str | None) -> None:
    """Write ``payload`` to ``path`` (the ``--json-out`` option, checked writable when parsed)."""
    write_text_out(json.dumps(payload, indent=2, sort_keys=True, default=str), path)


def write_text_out(text: str, path: str | None) -> None:
    """Write ``text`` to ``path`` (an output option checked writable when parsed; None: not given),
    flushed to the disk and checked: a file that could not be written is a :class:`WriteFailed`.

    A regular file (or a new one) is written atomically: a reader (a CI step) sees the old file or
    the whole new one, never half of it. Anything else that exists (a link such as ``/dev/stdout``,
    a pipe, a device) is written in place: renaming a file over it would replace the link or the
    device itself, and a device's errors (``/dev/full``: no space) show only when the write is flushed."""
    if not path:
        return
    target = pathlib.Path(path)
    if target.is_symlink() or (target.exists() and not target.is_file()):
        try:
            with open(target, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
        except OSError as exc:
            raise WriteFailed(target, exc) from None
        return
    partial = target.with_name(f".{target.name}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, target)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise WriteFailed(target, exc) from None
