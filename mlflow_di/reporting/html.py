"""A builder of self-contained HTML reports for the MLflow UI.

MLflow shows HTML artifacts in a sandboxed iframe, so a report is one file with everything
inside: a small embedded stylesheet, pictures as ``data:`` URIs, no JavaScript and no external
resources. Every piece of caller text is HTML-escaped; callers never pass markup.
"""
from __future__ import annotations

import collections
import html
import math
import numbers
import os
import pathlib
from typing import Iterable, Mapping, Sequence

import numpy as np

from mlflow_di.reporting.png import as_png, png_data_uri

STYLESHEET = """
:root { --text:#212529; --muted:#6c757d; --rule:#dee2e6; --stripe:#f6f7f9; --accent:#1a5fb4;
        --pass:#1e7e34; --pass-bg:#e7f5ea; --fail:#b02a37; --fail-bg:#fbeaec; --info:#1a5fb4; --info-bg:#e9f0fb; }
* { box-sizing: border-box; }
html { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
body { margin: 0; background: #fff; color: var(--text);
       font: 15px/1.5 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, "DejaVu Sans", sans-serif; }
main { max-width: 1240px; margin: 0 auto; padding: 24px 20px 32px; }
p, .note, figcaption, .verdict .text { max-width: 880px; }
header { border-bottom: 2px solid var(--rule); margin-bottom: 18px; padding-bottom: 10px; }
h1 { font-size: 26px; line-height: 1.25; margin: 0; }
.subtitle { color: var(--muted); margin: 4px 0 0; }
h2 { font-size: 19px; margin: 30px 0 10px; padding-bottom: 4px; border-bottom: 1px solid var(--rule); }
p { margin: 8px 0 12px; }
.verdict { display: flex; align-items: center; gap: 18px; margin: 14px 0 18px; padding: 14px 18px;
           border-radius: 6px; border-left: 8px solid; }
.verdict .word { font-size: 30px; font-weight: 800; letter-spacing: 1.5px; }
.verdict .text { font-size: 16px; }
.verdict.pass { background: var(--pass-bg); border-color: var(--pass); } .verdict.pass .word { color: var(--pass); }
.verdict.fail { background: var(--fail-bg); border-color: var(--fail); } .verdict.fail .word { color: var(--fail); }
.verdict.info { background: var(--info-bg); border-color: var(--info); } .verdict.info .word { color: var(--info); }
.table-wrap { overflow-x: auto; margin: 8px 0 16px; }
table { border-collapse: collapse; font-size: 14px; font-variant-numeric: tabular-nums; }
table.data { min-width: 60%; font: 12px/1.35 ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", monospace; }
table.data th, table.data td { padding: 3px 8px; white-space: normal; overflow-wrap: break-word; }
td.cut { cursor: help; text-decoration: underline dotted var(--muted); }
.gallery { max-height: 1200px; overflow: auto; margin: 12px 0 20px; border: 1px solid var(--rule); border-radius: 4px; }
.gallery figure { margin: 6px; }
.gallery figure img { max-width: none; border: 0; }
caption { caption-side: top; text-align: left; color: var(--muted); font-size: 13px; padding: 0 0 6px; }
th, td { padding: 5px 10px; border-bottom: 1px solid var(--rule); text-align: left; vertical-align: top; }
th { background: var(--stripe); font-weight: 600; border-bottom: 2px solid var(--rule); }
tbody tr:nth-child(even) td { background: #fbfbfc; }
td.num, th.num { text-align: right; white-space: nowrap; }
table.metrics th[scope=row] { background: none; font-weight: 500; border-bottom: 1px solid var(--rule);
                              font-family: ui-monospace, Menlo, Consolas, "DejaVu Sans Mono", monospace;
                              font-size: 13px; padding-right: 28px; }
table.metrics td { font-weight: 600; min-width: 110px; background: none !important; }
.note { color: var(--muted); font-size: 13px; font-style: italic; margin: -8px 0 16px; }
figure { margin: 12px 0 20px; }
figure img { display: block; max-width: 100%; height: auto; border: 1px solid var(--rule); border-radius: 4px; }
figcaption { color: var(--muted); font-size: 13px; margin-top: 6px; }
pre { background: var(--stripe); border: 1px solid var(--rule); border-radius: 4px; padding: 10px 12px;
      overflow-x: auto; font-size: 13px; line-height: 1.45; white-space: pre-wrap; word-break: break-word; }
footer { margin-top: 36px; padding-top: 8px; border-top: 1px solid var(--rule); color: var(--muted); font-size: 12px; }
@media print {
  body { font-size: 11pt; } main { max-width: none; padding: 0; }
  .verdict, figure, table, pre { break-inside: avoid; } h2 { break-after: avoid; }
  .table-wrap, .gallery { overflow: visible; max-height: none; }
}
"""


def format_value(value, percent: bool = False) -> str:
    """Readable text of one metric or table value: 12,345 / 0.8531 / 85.31 % / yes / — (missing)."""
    if value is None:
        return "—"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return f"{100 * int(value):,} %" if percent else f"{int(value):,}"
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isnan(number):
            return "—"
        if percent:
            return f"{100 * number:.2f} %"
        if math.isinf(number) or abs(number) < 1e4:
            return f"{number:.4g}"
        return f"{number:,.0f}"
    return str(value)


#: Longest text a table cell shows; longer text is cut with "…" and kept whole in the cell's tooltip.
#: Cells wrap (a registry URI, an operator chain), so a table fits the page without scrolling sideways.
MAX_CELL_CHARS = 200


def operator_summary(operators: Iterable[str]) -> str:
    """A chain of operator names as counts, most used first (ties: first used first), e.g.
    ``gaussian_noise×3, median_blur×2, pixel_change×1``; ``—`` for an empty chain."""
    counts = collections.Counter(str(name) for name in operators)  # Counter keeps first-seen order
    if not counts:
        return "—"
    return ", ".join(f"{name}×{count}" for name, count in sorted(counts.items(), key=lambda nc: -nc[1]))


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


class HtmlReport:
    """Builds one self-contained HTML page: header, verdict banner, sections, tables, pictures.

    Methods append to the page in call order and return the report, so calls can be chained;
    :meth:`render` gives the HTML text and :meth:`save` writes it.
    """

    def __init__(self, title: str, subtitle: str | None = None):
        self.title = str(title)
        self.subtitle = subtitle
        self._parts: list[str] = []
        self._in_section = False

    def verdict(self, passed: bool | None, text: str, word: str | None = None) -> "HtmlReport":
        """A big PASS (True) / FAIL (False) banner, or a neutral one (None: INFO, or ``word``, e.g.
        ERROR for a gate that could not judge), with ``text``."""
        kind, default = {True: ("pass", "PASS"), False: ("fail", "FAIL"), None: ("info", "INFO")}[
            None if passed is None else bool(passed)]
        word = word or default
        self._parts.append(f'<div class="verdict {kind}" role="status"><span class="word">{word}</span>'
                           f'<span class="text">{_escape(text)}</span></div>')
        return self

    def section(self, title: str) -> "HtmlReport":
        """Start a new titled section (everything added next belongs to it)."""
        self._close_section()
        self._parts.append(f"<section><h2>{_escape(title)}</h2>")
        self._in_section = True
        return self

    def paragraph(self, text: str) -> "HtmlReport":
        """A paragraph of plain text (escaped)."""
        self._parts.append(f"<p>{_escape(text)}</p>")
        return self

    def code(self, text: str) -> "HtmlReport":
        """Preformatted text, e.g. a command line or a JSON excerpt."""
        self._parts.append(f"<pre><code>{_escape(text)}</code></pre>")
        return self

    def metrics(self, values: Mapping[str, object], caption: str | None = None,
                percent_keys: Iterable[str] = ()) -> "HtmlReport":
        """A name | value table; values of ``percent_keys`` (fractions 0..1) are shown as percentages.

        Values may be numbers (formatted by :func:`format_value`) or strings already formatted by the caller.
        """
        percent = set(percent_keys)
        unknown = percent - set(values)
        if unknown:
            raise ValueError(f"percent_keys not among the metrics: {sorted(unknown)}")
        rows = "".join(f'<tr><th scope="row">{_escape(key)}</th>'
                       f'<td class="{"num" if _is_number(value) else ""}">'
                       f"{_escape(format_value(value, key in percent))}</td></tr>"
                       for key, value in values.items())
        self._parts.append(f'<div class="table-wrap"><table class="metrics">{_caption(caption)}'
                           f"<tbody>{rows}</tbody></table></div>")
        return self

    def table(self, rows: Sequence[Mapping[str, object]], columns: Sequence[str] | None = None,
              caption: str | None = None, max_rows: int = 200, percent_columns: Iterable[str] = (),
              max_cell_chars: int = MAX_CELL_CHARS) -> "HtmlReport":
        """A compact table of records (one dict per row, small fixed-width font; long text and
        headers wrap, numbers do not); shows the first ``max_rows`` and notes how many were left out.

        ``columns`` picks and orders the columns (default: every key, in first-seen order);
        numbers in ``percent_columns`` (fractions 0..1) are shown as percentages. A text cell
        longer than ``max_cell_chars`` characters shows its start and "…", with the whole text in
        its ``title`` (the tooltip); numbers are never cut.
        """
        rows = list(rows)
        columns = list(columns) if columns is not None else list(dict.fromkeys(k for row in rows for k in row))
        percent = set(percent_columns)
        shown = rows[:max(0, int(max_rows))]
        numeric = {c: all(_is_number(row.get(c)) for row in shown if row.get(c) is not None) and
                   any(row.get(c) is not None for row in shown) for c in columns}
        head = "".join(f'<th scope="col"{_num(numeric[c])}>{_breakable(c)}</th>' for c in columns)
        body = "".join("<tr>" + "".join(_cell(format_value(row.get(c), c in percent), numeric[c], max_cell_chars)
                                        for c in columns) + "</tr>" for row in shown)
        if not rows:
            body = f'<tr><td colspan="{max(len(columns), 1)}">(no rows)</td></tr>'
        self._parts.append(f'<div class="table-wrap"><table class="data">{_caption(caption)}'
                           f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")
        left_out = len(rows) - len(shown)
        if left_out > 0:
            self._parts.append(f'<p class="note">{left_out:,} more row{"s" if left_out != 1 else ""} not shown '
                               f"(showing the first {len(shown):,} of {len(rows):,}).</p>")
        return self

    def image(self, picture: bytes | np.ndarray, caption: str | None = None, alt: str | None = None) -> "HtmlReport":
        """A picture (PNG bytes or an RGB uint8 array) embedded as a data URI, with an optional caption."""
        uri = png_data_uri(as_png(picture))
        alt_text = alt if alt is not None else (caption or "")
        figcaption = f"<figcaption>{_escape(caption)}</figcaption>" if caption else ""
        self._parts.append(f'<figure><img src="{uri}" alt="{_escape(alt_text)}">{figcaption}</figure>')
        return self

    def gallery(self, pictures: Sequence[bytes | np.ndarray], caption: str | None = None,
                alt: str | None = None) -> "HtmlReport":
        """Several pictures (e.g. the pages of :func:`~mlflow_di.reporting.images.trigger_grid_pages`),
        each at full size, one under the other in one box that scrolls when they are taller or
        wider than the page; ``caption`` goes under the box."""
        pictures = list(pictures)
        if not pictures:
            raise ValueError("no pictures for the gallery")
        alt_text = alt if alt is not None else (caption or "")
        figures = "".join(f'<figure><img src="{png_data_uri(as_png(picture))}" '
                          f'alt="{_escape(f"{alt_text} ({number} of {len(pictures)})")}"></figure>'
                          for number, picture in enumerate(pictures, 1))
        note = f'<p class="note">{_escape(caption)}</p>' if caption else ""
        self._parts.append(f'<div class="gallery">{figures}</div>{note}')
        return self

    def render(self) -> str:
        """The whole page as one HTML string."""
        from mlflow_di import __version__

        subtitle = f'<p class="subtitle">{_escape(self.subtitle)}</p>' if self.subtitle else ""
        closing = "</section>" if self._in_section else ""
        return (
            '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_escape(self.title)}</title>\n<style>{STYLESHEET}</style>\n</head>\n<body>\n<main>\n"
            f"<header><h1>{_escape(self.title)}</h1>{subtitle}</header>\n"
            + "\n".join(self._parts) + closing
            + f"\n<footer>Generated by mlflow-di {_escape(__version__)}</footer>\n</main>\n</body>\n</html>\n"
        )

    def fragment(self) -> str:
        """The sections added so far without the page around them, to insert into another report."""
        return "\n".join(self._parts) + ("</section>" if self._in_section else "")

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write the page (UTF-8) to ``path``, creating missing folders; returns the path."""
        target = pathlib.Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.render(), encoding="utf-8")
        return target

    def _close_section(self) -> None:
        if self._in_section:
            self._parts.append("</section>")
            self._in_section = False


def insert_sections(page: str, fragment: str, name: str) -> str:
    """``page`` (a rendered report) with ``fragment`` (from :meth:`HtmlReport.fragment`) before its footer.

    The fragment is marked with ``name``: inserting under the same name again replaces the earlier
    fragment instead of adding a second copy.
    """
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    marked = f"{begin}\n{fragment}\n{end}"
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        return head + marked + rest.split(end, 1)[1]
    marker = "\n<footer>"
    if marker not in page:
        raise ValueError("not an mlflow-di report: no footer to insert before")
    return page.replace(marker, "\n" + marked + marker, 1)


def _escape(text) -> str:
    return html.escape(str(text), quote=True)


def _caption(caption: str | None) -> str:
    return f"<caption>{_escape(caption)}</caption>" if caption else ""


def _breakable(text) -> str:
    """Escaped text with a line-break opportunity after each ``_``, ``/`` and ``,`` (``<wbr>``), so a column
    name such as ``realistic_success_rate`` or a URI wraps at its parts rather than mid-word."""
    escaped = _escape(text)
    for mark in ("_", "/", ","):
        escaped = escaped.replace(mark, mark + "<wbr>")
    return escaped


def _num(numeric: bool) -> str:
    return ' class="num"' if numeric else ""


def _cell(text: str, numeric: bool, max_chars: int) -> str:
    """One ``<td>``: the text, or (never for a number) its first ``max_chars`` - 1 characters and "…"
    with the whole text as title."""
    limit = max(2, int(max_chars))
    if numeric or len(text) <= limit:
        return f"<td{_num(numeric)}>{_escape(text) if numeric else _breakable(text)}</td>"
    return f'<td class="cut" title="{_escape(text)}">{_breakable(text[:limit - 1])}…</td>'
