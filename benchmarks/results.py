"""Keep benchmarks/RESULTS.md current: each benchmark owns one section between its markers."""
from __future__ import annotations

import pathlib
import re

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


def publish(section: str, begin: str, end: str, write: bool = True) -> None:
    """Print a benchmark's section and, unless told not to (``--no-write``), put it in RESULTS.md."""
    print(section)
    if write:
        write_section(section, begin, end)


def kept_sections(old: str, new: str) -> str:
    """The marked sections (``<!-- name -->`` ... ``<!-- /name -->``) of ``old`` that ``new`` lacks,
    each on its own paragraph: a renderer that rewrites a whole file keeps what other scripts wrote."""
    kept = [match.group(0) for match in re.finditer(r"<!-- ([\w .-]+) -->.*?<!-- /\1 -->", old, re.S)
            if f"<!-- {match.group(1)} -->" not in new]
    return "".join("\n\n" + section + "\n" for section in kept)
