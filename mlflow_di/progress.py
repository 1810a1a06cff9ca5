"""Progress for long loops: a live bar on a terminal, plain periodic lines in logs and CI.

A tqdm bar redraws with carriage returns, which a log file or CI console shows as one endless
line (or thousands of lines). Off a terminal, :func:`progress_bar` keeps tqdm's counting and
rate but writes one ordinary line at most every :data:`PLAIN_INTERVAL_S` seconds (nothing for a
loop that ends sooner).
"""
from __future__ import annotations

import sys

from tqdm.auto import tqdm

#: Seconds between two progress lines when stderr is not a terminal.
PLAIN_INTERVAL_S = 10.0


class _Lines:
    """A file-like target that turns tqdm's carriage-return redraws into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _PlainBar(tqdm):
    """tqdm off a terminal: postfix changes wait for the next periodic line."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)


def progress_bar(*args, **kwargs) -> tqdm:
    """``tqdm(*args, **kwargs)`` on a terminal; periodic plain lines elsewhere."""
    stream = kwargs.get("file") or sys.stderr
    if kwargs.get("disable") or getattr(stream, "isatty", lambda: False)():
        return tqdm(*args, **kwargs)
    # delay: loops shorter than one interval print nothing at all off a terminal
    kwargs.update(file=_Lines(stream), mininterval=PLAIN_INTERVAL_S, maxinterval=PLAIN_INTERVAL_S, ascii=True,
                  delay=PLAIN_INTERVAL_S)
    return _PlainBar(*args, **kwargs)
