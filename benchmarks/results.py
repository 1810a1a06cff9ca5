"""Keep benchmarks/RESULTS.md current: each benchmark owns one section between its markers."""
from __future__ import annotations

import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str, begin: str, end: str, path: pathlib.Path = RESULTS) -> None:
    """Replace the text between ``begin`` and ``end`` in ``path`` with ``section`` (which carries
    both markers), appending it when the file or the markers are missing."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
