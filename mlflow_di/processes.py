"""Whether a process on this host still runs, by its PID: what a lock asks before it takes over from a
holder that may have died, and what the service asks while it stops a pipeline it left behind."""
from __future__ import annotations

import os
import pathlib


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs here. A zombie (killed, not yet reaped by its parent) is gone.
    Reads ``/proc/PID/stat``; where there is no ``/proc`` (not Linux) it asks the kernel with signal 0,
    and a process it may not signal counts as running."""
    try:
        status = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if pathlib.Path("/proc/self/stat").exists():
            return False  # Linux, and no such process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
    return status.rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie is gone (its parent died; init reaps it)
