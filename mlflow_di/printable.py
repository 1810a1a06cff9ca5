"""Text from users and registries made safe to print: control characters shown, never obeyed.

A registered model may be called ``"a\\x1b[2Jb"`` or ``"line\\nnext"``: printed as it is, the escape
clears the terminal and the newline cuts a one-line error in two. :func:`printable` shows every control
character (C0, DEL, C1) as its ``\\xNN`` escape, as Python's ``repr`` would, and leaves other text alone.
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text, keep: str = "") -> str:
    """``text`` with each control character but those in ``keep`` written as ``\\xNN``."""
    return _CONTROL.sub(lambda match: match.group(0) if match.group(0) in keep else f"\\x{ord(match.group(0)):02x}",
                        str(text))
