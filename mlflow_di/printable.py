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


def name_problem(text, forbidden: str = "") -> str | None:
    """Why ``text`` cannot name a registered model or an experiment (None when it can): empty or blank, a
    control character (a newline would split every line that names it, and the registry keeps it), or one
    of the ``forbidden`` characters. Checked before any work, so a bad name never costs a run."""
    text = str(text)
    if not text.strip():
        return "it is empty"
    control = _CONTROL.search(text)
    if control:
        return f"it holds the control character \\x{ord(control.group(0)):02x}"
    if text != text.strip():
        return "it starts or ends with white space"
    bad = sorted({c for c in text if c in forbidden})
    if bad:
        return "it holds " + " and ".join(f"'{c}'" for c in bad)
    return None
