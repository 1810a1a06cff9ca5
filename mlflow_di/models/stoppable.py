"""Calls into ONNX Runtime that a signal or a time limit can stop.

Python runs a signal handler only between bytecodes of its main thread, so SIGTERM or Ctrl-C waits for
a native call to return: a model that never returns (an ONNX ``Loop`` with a huge trip count) kept a
command deaf to SIGTERM for a minute, and only SIGKILL ended it, leaving its runs RUNNING. Each call
made with :func:`run` has its own ``onnxruntime.RunOptions``; a watchdog thread, woken by the signal
itself (``signal.set_wakeup_fd``: the interpreter writes the signal's number there even while the main
thread is inside ONNX Runtime), sets their ``terminate`` flag, so the call returns at ONNX Runtime's
next node (inside a ``Loop`` too) and the command's own handler ends it as usual: one line, the run
KILLED, finished work kept.

The same thread stops a call that runs past a stated limit: ``MLFLOW_DI_MAX_CALL_SECONDS`` (default
300 s), or a command's own safety net (:func:`call_limit`, e.g. fuzz's ``--timeout``), and the call
raises :class:`CallStopped` naming the model and the limit. PyTorch and TFLite calls cannot be
stopped from outside; their models run known layers.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from typing import Callable

from mlflow_di.errors import UserError

#: Seconds one call may run unless MLFLOW_DI_MAX_CALL_SECONDS or a command's safety net says otherwise.
DEFAULT_LIMIT = 300.0
#: How often the watchdog looks at the calls in flight (a limit is kept to within this).
_TICK = 0.25
_STOP_SIGNALS = frozenset({int(signal.SIGINT), int(signal.SIGTERM)})


class CallStopped(UserError):
    """A model call was stopped: it ran past its limit, or a signal asked the command to end."""


class _Call:
    __slots__ = ("options", "started", "limit", "reason")

    def __init__(self, options, limit: float):
        self.options, self.started, self.limit, self.reason = options, time.monotonic(), limit, None


class _Watch:
    """The calls in flight and the thread that stops them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: set[_Call] = set()
        self.thread: threading.Thread | None = None
        self.wakeup: int | None = None  # the read end of the signal wake-up pipe, when it is ours

    def start(self) -> None:
        with self.lock:
            if self.thread is not None:
                return
            self.wakeup = _own_wakeup_pipe()
            self.thread = threading.Thread(target=self._watch, name="mlflow-di-call-watch", daemon=True)
            self.thread.start()

    def _watch(self) -> None:
        while True:
            signalled = False
            if self.wakeup is not None:
                readable, _, _ = select.select([self.wakeup], [], [], _TICK)
                if readable:
                    try:
                        signalled = bool(_STOP_SIGNALS & set(os.read(self.wakeup, 512)))
                    except OSError:
                        pass
            else:
                time.sleep(_TICK)
            now = time.monotonic()
            with self.lock:
                for call in self.calls:
                    if call.reason is None and (signalled or now - call.started > call.limit):
                        call.reason = "signal" if signalled else "limit"
                        call.options.terminate = True


def _own_wakeup_pipe() -> int | None:
    """A pipe the interpreter writes each signal's number to, when no one else (asyncio) took that role and
    this is the main thread; None otherwise (then only limits stop calls)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except (ValueError, OSError):
        previous = None
    if previous != -1:  # taken (or refused): leave it as it was
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return None
    return read_end


_watch = _Watch()
_limits: list[tuple[float, str]] = []  # the safety nets in force, innermost last (process-wide: any thread's calls)


_parsed: dict[str, tuple[float, str]] = {}  # MLFLOW_DI_MAX_CALL_SECONDS's text -> its limit (read on every call)


def default_limit() -> tuple[float, str]:
    """(seconds, what states it): ``MLFLOW_DI_MAX_CALL_SECONDS`` or :data:`DEFAULT_LIMIT`."""
    text = os.environ.get("MLFLOW_DI_MAX_CALL_SECONDS", "")
    if text not in _parsed:
        _parsed[text] = _parse_limit(text.strip())
    return _parsed[text]


def _parse_limit(text: str) -> tuple[float, str]:
    if not text:
        return DEFAULT_LIMIT, "the default limit; set MLFLOW_DI_MAX_CALL_SECONDS to allow more"
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise UserError(f"MLFLOW_DI_MAX_CALL_SECONDS must be a positive number of seconds, got '{text}'")
    return seconds, "MLFLOW_DI_MAX_CALL_SECONDS"


@contextlib.contextmanager
def call_limit(seconds: float, stated_by: str):
    """Within the block, a model call running past ``seconds`` is stopped (``stated_by`` names the option,
    e.g. ``fuzz --timeout 30``); a stricter limit already in force stays."""
    _limits.append((float(seconds), stated_by))
    try:
        yield
    finally:
        _limits.pop()


def current_limit() -> tuple[float, str]:
    """The strictest limit in force: (seconds, what states it)."""
    limit = default_limit()
    for inner in _limits:
        limit = inner if inner[0] < limit[0] else limit
    return limit


def run(session, feeds: dict, name: str, output_names=None) -> list:
    """``session.run(output_names, feeds)`` that a SIGINT/SIGTERM or the current limit stops (see the module)."""
    import onnxruntime as ort

    if _watch.thread is None:
        _watch.start()
    limit, stated_by = current_limit()
    options = ort.RunOptions()
    options.log_severity_level = 4  # ONNX Runtime's own line about the terminate flag: the command says it
    call = _Call(options, limit)
    with _watch.lock:
        _watch.calls.add(call)
    try:
        return session.run(output_names, feeds, options)
    except Exception:
        if call.reason == "limit":
            raise _past_limit(name, limit, stated_by) from None
        if call.reason == "signal":
            _let_the_signal_handler_run()
            raise CallStopped(f"{name}: stopped by a signal") from None
        raise
    finally:
        with _watch.lock:
            _watch.calls.discard(call)


def _past_limit(name: str, limit: float, stated_by: str) -> CallStopped:
    return CallStopped(f"{name}: one call ran for more than {limit:g} s and was stopped ({stated_by}); a model that "
                       "takes this long for one batch cannot be analysed here (an ONNX Loop or Scan that never ends?)")


def wait_stoppable(start: Callable[[], None], wait: Callable[[int], bool], cancel: Callable[[], None],
                   name: str) -> None:
    """An asynchronous call (a runtime's own, e.g. an OpenVINO infer request) that a signal or the current limit
    stops: ``start()`` begins it, ``wait(milliseconds)`` says whether it finished, ``cancel()`` ends it. Waiting in
    short slices lets Python run a signal's handler between them; the call is cancelled before that goes on."""
    limit, stated_by = current_limit()
    started = time.monotonic()
    start()
    try:
        while not wait(int(_TICK * 1000)):
            if time.monotonic() - started > limit:
                raise _past_limit(name, limit, stated_by)
    except BaseException:
        cancel()
        raise


def _let_the_signal_handler_run() -> None:
    """The signal that stopped the call is pending in the interpreter: its handler (KeyboardInterrupt, the
    CLI's Terminated) runs at the next bytecode boundary, which a short sleep provides."""
    for _ in range(20):
        time.sleep(0.01)
