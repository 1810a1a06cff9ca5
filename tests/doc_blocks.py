"""The fenced code blocks of the README and the docs pages, and the command lines in them, for the
tests that check every example against the code (test_docs_examples.py) and run the README in
order (test_readme_walk.py)."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: its language tag, its text, and where it starts (for messages)."""

    language: str
    text: str
    page: pathlib.Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[str]:
        """The block's command lines: backslash continuations joined, blank and comment-only lines left out."""
        joined, pending = [], ""
        for raw in self.text.splitlines():
            line = raw.rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = (pending + line).strip()
            pending = ""
            if line and not line.startswith("#"):
                joined.append(line)
        return joined


def blocks(page: pathlib.Path) -> list[Block]:
    """Every fenced block of ``page`` in order (an unclosed fence is an error: it would hide the rest)."""
    found, language, start, lines = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence and language is None:
            language, start, lines = fence.group(1) or "text", number, []
        elif line.strip() == "```" and language is not None:
            found.append(Block(language, "\n".join(lines), page, start))
            language = None
        elif language is not None:
            lines.append(line)
    if language is not None:
        raise AssertionError(f"{page.relative_to(REPO)}:{start}: a code fence is never closed")
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def argv(command: str, env: dict[str, str]) -> list[str]:
    """``command`` split as the shell would (comments dropped), with ``$VAR``/``${VAR}``/``${VAR:-x}``
    replaced from ``env`` and ``$(...)`` by a placeholder word."""
    command = re.sub(r"\$\([^)]*\)", "substituted", command)

    def value(match: re.Match) -> str:
        name, default = match.group(1) or match.group(3), match.group(2)
        return env.get(name, default if default is not None else "")

    command = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", value, command)
    return shlex.split(command, comments=True)
