"""What a seed's time safety net is charged: CPU seconds of the work done for it, never wall-clock time.

A seed's budget is work (``--max-queries``); ``--timeout`` is a safety net whose hit makes the run
INCOMPLETE. Even so it should not fire because the machine is busy: wall-clock time moves with the
runner's load several times over, CPU seconds of the same work much less (up to about twice,
benchmarks/RESULTS.md, bench_load):

* a search's own work (mutations, SSIM, bookkeeping) is the CPU time of the thread that runs it
  (:func:`search_clock`, ``time.thread_time``);
* a model call is the CPU time the whole process spends during it (:func:`model_clock`,
  ``time.process_time``), so ONNX Runtime's and PyTorch's worker threads count, less the CPU time of
  the searching thread when the call runs in another thread beside it (the lockstep runner's
  ``overlap``), which that thread charges itself.

Worker threads that spin while they wait (OpenMP's, ONNX Runtime's intra-op pool) would charge their
spinning, many times over on a loaded machine: mlflow-di lets them sleep instead (``mlflow_di/__init__.py``,
:func:`mlflow_di.models.execution.session_options`). What still varies is that a busy core runs the same
instructions a little more slowly. A campaign's records are the same on an idle and a saturated machine
whenever the safety net does not fire (``tests/test_fuzz_load.py``); the seconds in them differ.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

#: CPU seconds of the calling thread: what a search's own step costs.
search_clock: Callable[[], float] = time.thread_time

#: CPU seconds of the whole process: what a seed costs when nothing else runs beside its search
#: (the boundary walk, DeepXplore: one seed or one batch of seeds at a time, models included).
process_seconds: Callable[[], float] = time.process_time


def model_clock(search_thread: int | None = None) -> Callable[[], float]:
    """A clock for a model call: the process's CPU seconds, less those of ``search_thread`` (a
    ``threading.get_ident()``) when the call runs in another thread than the searches."""
    if search_thread is None or search_thread == threading.get_ident():
        return time.process_time
    try:
        searching = time.pthread_getcpuclockid(search_thread)
        time.clock_gettime(searching)
    except (AttributeError, OSError):  # not POSIX, or the thread is gone: count it in
        return time.process_time
    return lambda: time.process_time() - time.clock_gettime(searching)
