"""Image grids for reports: fuzzing triggers next to their seeds, and relevance heatmaps.

Both are composed with numpy and Pillow (not matplotlib) so the pixel layout is exact: a small
image is enlarged by an integer nearest-neighbour factor (8×8 digits and 28×28 MNIST become about
112 px) and every cell's position is known (:class:`TriggerGridLayout`), which tests rely on.
"""
from __future__ import annotations

import dataclasses
import textwrap
from typing import Sequence

import matplotlib
import numpy as np
from PIL import Image, ImageDraw

from mlflow_di.reporting.png import font, to_rgb_batch, upscale, upscale_factor

BACKGROUND = (255, 255, 255)
TEXT = (33, 37, 41)
MUTED = (108, 117, 125)
DEVIATION = (192, 28, 40)
RULE = (222, 226, 230)
#: Colour map of the amplified difference: black where seed and trigger agree, light yellow at the largest change.
DIFFERENCE_CMAP = "inferno"
#: Diverging map of relevance: blue against the class, white neutral, red for it.
RELEVANCE_CMAP = "bwr"

PAD = 10
GAP = 8
HEADER_HEIGHT = 22
LINE_HEIGHT = 17
FOOTER_HEIGHT = 22
CAPTION_WIDTH = 210
#: Caption lines a trigger row has room for without growing (title, true label, change, note).
CAPTION_LINES = 4
#: Characters per caption line before an operator summary wraps onto the next line.
CAPTION_WRAP = 44
#: Triggers per picture of :func:`trigger_grid_pages` (a 28×28 page is then about 2,100 px tall).
TRIGGERS_PER_PAGE = 16
#: Widest picture an HTML report page shows at full size (its content column is 880 px minus borders).
MAX_PICTURE_WIDTH = 860


@dataclasses.dataclass(frozen=True)
class TriggerGridLayout:
    """Pixel geometry of a trigger grid: where each row's seed, trigger and difference cells are."""

    rows: int
    cell_height: int
    cell_width: int
    scale: int
    truncated: bool = False
    caption_width: int = CAPTION_WIDTH
    caption_lines: int = CAPTION_LINES

    @property
    def row_height(self) -> int:
        return max(self.cell_height, max(CAPTION_LINES, self.caption_lines) * LINE_HEIGHT)

    @property
    def width(self) -> int:
        return self.caption_left + self.caption_width + PAD

    @property
    def height(self) -> int:
        body = self.rows * self.row_height + max(self.rows - 1, 0) * GAP
        return PAD + HEADER_HEIGHT + body + PAD + (FOOTER_HEIGHT if self.truncated else 0)

    @property
    def caption_left(self) -> int:
        return PAD + 3 * (self.cell_width + GAP)

    def row_top(self, row: int) -> int:
        return PAD + HEADER_HEIGHT + row * (self.row_height + GAP)

    def cell_box(self, row: int, column: int) -> tuple[int, int, int, int]:
        """(top, left, bottom, right) of the image in ``column`` 0 = seed, 1 = trigger, 2 = difference."""
        top = self.row_top(row) + (self.row_height - self.cell_height) // 2
        left = PAD + column * (self.cell_width + GAP)
        return top, left, top + self.cell_height, left + self.cell_width


def trigger_grid_layout(rows: int, image_height: int, image_width: int, truncated: bool = False,
                        caption_width: int = CAPTION_WIDTH, caption_lines: int = CAPTION_LINES) -> TriggerGridLayout:
    """Layout of a trigger grid of ``rows`` rows of image_height×image_width images; ``truncated``
    reserves a footer line, ``caption_lines`` the most caption lines of a row."""
    scale = upscale_factor(image_height, image_width)
    return TriggerGridLayout(rows, image_height * scale, image_width * scale, scale=scale, truncated=truncated,
                             caption_width=caption_width, caption_lines=caption_lines)


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """How far a trigger is from its seed, in raw pixel values (0..255).

    ``changed_pixels``: pixels with any channel changed; ``l2``: Euclidean norm of
    trigger − seed over every pixel and channel; ``linf``: the largest absolute change.
    """

    changed_pixels: int
    l2: float
    linf: int

    def text(self) -> str:
        """e.g. ``12 px changed, L∞ 37, L2 81.2`` (or ``identical to the seed``)."""
        if not self.changed_pixels:
            return "identical to the seed"
        return f"{self.changed_pixels} px changed, L∞ {self.linf}, L2 {self.l2:.1f}"


def perturbation_sizes(seeds: np.ndarray, triggers: np.ndarray) -> list[Perturbation]:
    """One :class:`Perturbation` per (seed, trigger) pair; uint8 N×H×W×C or N×H×W arrays of one shape."""
    seeds, triggers = np.asarray(seeds), np.asarray(triggers)
    if seeds.shape != triggers.shape:
        raise ValueError(f"seeds {seeds.shape} and triggers {triggers.shape} must have the same shape")
    if seeds.ndim == 3:
        seeds, triggers = seeds[..., None], triggers[..., None]
    change = triggers.astype(np.int32) - seeds.astype(np.int32)
    flat = change.reshape(len(change), -1)
    per_pixel = np.abs(change).max(axis=3).reshape(len(change), -1)
    return [Perturbation(int(np.count_nonzero(pixels)), float(np.sqrt(np.dot(row, row))),
                         int(np.abs(row).max()) if row.size else 0)
            for row, pixels in zip(flat, per_pixel)]


def amplified_difference(seed: np.ndarray, trigger: np.ndarray) -> tuple[np.ndarray, int, int]:
    """RGB picture of |trigger − seed| (largest channel per pixel) scaled so the largest change is brightest.

    Returns the picture, the number of changed pixels and the largest change in raw intensity
    (0..255), so the caption can say how big the difference really is despite the scaling.
    """
    change = np.abs(trigger.astype(np.int16) - seed.astype(np.int16)).max(axis=2)
    largest = int(change.max())
    scaled = change / largest if largest else change.astype(np.float64)
    rgb = matplotlib.colormaps[DIFFERENCE_CMAP](scaled)[..., :3]
    return np.round(rgb * 255).astype(np.uint8), int(np.count_nonzero(change)), largest


def _label_text(label, class_names: Sequence[str] | None) -> str:
    if class_names is not None and isinstance(label, (int, np.integer)) and 0 <= int(label) < len(class_names):
        return str(class_names[int(label)])
    return str(int(label)) if isinstance(label, (int, np.integer)) else str(label)


def _check_lengths(n: int, **sequences) -> None:
    for name, sequence in sequences.items():
        if sequence is not None and len(sequence) != n:
            raise ValueError(f"{name} has {len(sequence)} entries but there are {n} images")


def trigger_grid(
    seeds: np.ndarray,
    triggers: np.ndarray,
    original_labels: Sequence,
    compressed_labels: Sequence,
    true_labels: Sequence | None = None,
    max_rows: int = 16,
    class_names: Sequence[str] | None = None,
    notes: Sequence[str] | None = None,
    operators: Sequence[str] | None = None,
) -> np.ndarray:
    """RGB uint8 picture with one row per trigger: seed | trigger | amplified difference | labels.

    ``seeds`` and ``triggers`` are uint8 N×H×W×C (C = 1 or 3) or N×H×W; the labels are both models'
    decisions on the trigger (shown as "orig 7 / comp 3", red when they differ) and optionally the
    true label of the seed; each row also gives the perturbation size (changed pixels, L∞ and L2
    of trigger − seed, see :func:`perturbation_sizes`). ``notes`` adds one short line per row
    (e.g. "85 queries"), ``operators`` one text per row (e.g. :func:`~mlflow_di.reporting.html.operator_summary`
    of the operator chain), wrapped onto as many lines as it needs. Only the first ``max_rows``
    rows are drawn, and the picture then says how many there were; :func:`trigger_grid_pages`
    draws them all.
    """
    seeds, triggers, sizes = _checked_pairs(seeds, triggers, original_labels, compressed_labels=compressed_labels,
                                            true_labels=true_labels, notes=notes, operators=operators)
    total = len(seeds)
    rows = min(total, max(1, int(max_rows)))
    footer = f"showing the first {rows} of {total} triggers" if rows < total else None
    texts = _TriggerTexts(original_labels, compressed_labels, sizes, true_labels=true_labels, class_names=class_names,
                          notes=notes, operators=operators)
    return _draw_trigger_grid(seeds[:rows], triggers[:rows], texts, first=0, footer=footer)


def trigger_grid_pages(
    seeds: np.ndarray,
    triggers: np.ndarray,
    original_labels: Sequence,
    compressed_labels: Sequence,
    true_labels: Sequence | None = None,
    per_page: int = TRIGGERS_PER_PAGE,
    class_names: Sequence[str] | None = None,
    notes: Sequence[str] | None = None,
    operators: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """Every trigger, as :func:`trigger_grid` pictures of at most ``per_page`` rows each.

    Same arguments as :func:`trigger_grid`; rows are numbered across pages (#17 opens page 2 of
    16 per page), and each page of several says which triggers it holds ("triggers 17–32 of 40").
    """
    seeds, triggers, sizes = _checked_pairs(seeds, triggers, original_labels, compressed_labels=compressed_labels,
                                            true_labels=true_labels, notes=notes, operators=operators)
    total, per_page = len(seeds), max(1, int(per_page))
    texts = _TriggerTexts(original_labels, compressed_labels, sizes, true_labels=true_labels, class_names=class_names,
                          notes=notes, operators=operators)
    starts = range(0, total, per_page)
    pages = []
    for number, start in enumerate(starts, 1):
        stop = min(start + per_page, total)
        footer = (f"triggers {start + 1}–{stop} of {total} (page {number} of {len(starts)})"
                  if len(starts) > 1 else None)
        pages.append(_draw_trigger_grid(seeds[start:stop], triggers[start:stop], texts, first=start, footer=footer))
    return pages


def _checked_pairs(seeds, triggers, original_labels, compressed_labels, true_labels, notes, operators):
    """RGB seeds and triggers and the perturbation sizes (of the images as given, before any grey is
    repeated into three channels), after checking every sequence has one entry per trigger."""
    rgb_seeds, rgb_triggers = to_rgb_batch(seeds, "seeds"), to_rgb_batch(triggers, "triggers")
    if rgb_seeds.shape != rgb_triggers.shape:
        raise ValueError(f"seeds {rgb_seeds.shape} and triggers {rgb_triggers.shape} must have the same shape")
    _check_lengths(len(rgb_seeds), original_labels=original_labels, compressed_labels=compressed_labels,
                   true_labels=true_labels, notes=notes, operators=operators)
    if len(rgb_seeds) == 0:
        raise ValueError("no triggers to draw")
    return rgb_seeds, rgb_triggers, perturbation_sizes(seeds, triggers)


@dataclasses.dataclass(frozen=True)
class _TriggerTexts:
    """What each trigger's caption says, one entry per trigger of the whole set: both models' labels, its
    perturbation size, and optionally its true label, note and operators (labels named by ``class_names``)."""

    original_labels: Sequence
    compressed_labels: Sequence
    sizes: Sequence
    true_labels: Sequence | None = None
    class_names: Sequence[str] | None = None
    notes: Sequence[str] | None = None
    operators: Sequence[str] | None = None

    def caption(self, row: int) -> list:
        """The (text, colour, bold) lines of trigger ``row``."""
        def of(values):
            return None if values is None else values[row]

        return _trigger_caption(row, self.original_labels[row], self.compressed_labels[row], true=of(self.true_labels),
                                size=self.sizes[row], class_names=self.class_names, note=of(self.notes),
                                operators=of(self.operators))


def _draw_trigger_grid(seeds, triggers, texts: _TriggerTexts, first: int, footer: str | None) -> np.ndarray:
    """The picture of rows ``first``.. (``seeds``/``triggers`` hold just those rows; ``texts`` covers every
    trigger and is indexed from ``first``)."""
    rows = len(seeds)
    differences = [amplified_difference(seeds[row], triggers[row]) for row in range(rows)]
    captions = [texts.caption(first + row) for row in range(rows)]
    layout = trigger_grid_layout(rows, seeds.shape[1], seeds.shape[2], truncated=footer is not None,
                                 caption_width=max(CAPTION_WIDTH, _caption_width(captions)),
                                 caption_lines=max(len(lines) for lines in captions))
    canvas = Image.new("RGB", (layout.width, layout.height), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    _draw_grid_header(draw, layout)
    for row, ((difference, _, _), lines) in enumerate(zip(differences, captions)):
        for column, picture in enumerate((seeds[row], triggers[row], difference)):
            top, left, _, _ = layout.cell_box(row, column)
            canvas.paste(Image.fromarray(upscale(picture, layout.scale)), (left, top))
        _draw_caption(draw, layout.caption_left, layout.row_top(row) + 2, lines)
        if row:
            y = layout.row_top(row) - GAP // 2 - 1
            draw.line([(PAD, y), (layout.width - PAD, y)], fill=RULE)
    if footer:
        draw.text((PAD, layout.height - PAD - FOOTER_HEIGHT + 4), footer, font=font(12), fill=MUTED)
    return np.asarray(canvas)


def _draw_grid_header(draw: ImageDraw.ImageDraw, layout: TriggerGridLayout) -> None:
    titles = ("seed", "trigger", "|trigger − seed|", "decisions on the trigger")
    lefts = [layout.cell_box(0, column)[1] for column in range(3)] + [layout.caption_left]
    for title, left in zip(titles, lefts):
        draw.text((left, PAD), title, font=font(12, bold=True), fill=MUTED)


def _trigger_caption(row, original, compressed, true, size: Perturbation, class_names, note, operators):
    """(text, colour, bold) lines describing one trigger."""
    deviates = original != compressed
    decision = f"orig {_label_text(original, class_names)} / comp {_label_text(compressed, class_names)}"
    lines = [(f"#{row + 1}  {decision}", DEVIATION if deviates else TEXT, True)]
    if true is not None:
        lines.append((f"true label {_label_text(true, class_names)}", TEXT, False))
    lines.append((size.text(), MUTED, False))
    if note:
        lines.append((str(note), MUTED, False))
    if operators:
        lines.extend((text, MUTED, False) for text in textwrap.wrap(str(operators), CAPTION_WRAP))
    return lines


def _caption_width(captions) -> int:
    """Widest caption line in pixels, so long class names are never cut off."""
    return max(int(np.ceil(font(13, bold=bold).getlength(text))) for lines in captions for text, _, bold in lines)


def _draw_caption(draw: ImageDraw.ImageDraw, left: int, top: int, lines) -> None:
    for index, (text, colour, bold) in enumerate(lines):
        draw.text((left, top + index * LINE_HEIGHT), text, font=font(13, bold=bold), fill=colour)


def _relevance_maps(relevance: np.ndarray, n: int, height: int, width: int) -> np.ndarray:
    """N×H×W relevance per pixel (channels summed) from N×H×W, N×H×W×C or N×C×H×W relevance."""
    array = np.asarray(relevance, dtype=np.float64)
    if array.ndim == 3 and array.shape == (n, height, width):
        return array
    if array.ndim == 4 and array.shape[:3] == (n, height, width):
        return array.sum(axis=3)
    if array.ndim == 4 and array.shape[0] == n and array.shape[2:] == (height, width):
        return array.sum(axis=1)
    raise ValueError(f"relevance of shape {array.shape} does not match {n} images of {height}×{width} "
                     "(expected N×H×W, N×H×W×C or N×C×H×W)")


def relevance_picture(relevance_map: np.ndarray) -> tuple[np.ndarray, float]:
    """RGB picture of one H×W relevance map on a diverging map centred at 0 with limits ±max|R|; and that limit."""
    limit = float(np.nanmax(np.abs(relevance_map))) if relevance_map.size else 0.0
    scaled = 0.5 + 0.5 * (np.nan_to_num(relevance_map) / limit if limit > 0 else np.zeros_like(relevance_map))
    rgb = matplotlib.colormaps[RELEVANCE_CMAP](np.clip(scaled, 0.0, 1.0))[..., :3]
    return np.round(rgb * 255).astype(np.uint8), limit


def relevance_heatmaps(
    images: np.ndarray,
    relevance: np.ndarray,
    labels: Sequence | None = None,
    max_images: int = 8,
    per_row: int | None = None,
    class_names: Sequence[str] | None = None,
) -> np.ndarray:
    """RGB uint8 picture of input | relevance heatmap pairs (red: for the class, blue: against).

    ``images`` are uint8 N×H×W×C or N×H×W; ``relevance`` is the input-pixel relevance in any of
    N×H×W, N×H×W×C or N×C×H×W (channels are summed). Each heatmap uses its own symmetric limits
    ±max|R|, written under it, so weak and strong explanations are both visible. ``per_row`` pairs
    per line (default: as many as fit a report page, 3 for MNIST).
    """
    rgb = to_rgb_batch(images)
    n_all, height, width = rgb.shape[:3]
    maps = _relevance_maps(relevance, n_all, height, width)
    _check_lengths(n_all, labels=labels)
    if n_all == 0:
        raise ValueError("no images to draw")
    n = min(n_all, max(1, int(max_images)))
    scale = upscale_factor(height, width)
    cell_h, cell_w = height * scale, width * scale
    pair_w = 2 * cell_w + 2
    if per_row is None:  # as many pairs as fit the width of a report page without scaling down
        per_row = (MAX_PICTURE_WIDTH - 2 * PAD + 2 * GAP) // (pair_w + 2 * GAP)
    per_row = max(1, min(int(per_row), n))
    caption_h = 2 * LINE_HEIGHT + 4
    pair_h = cell_h + caption_h
    grid_rows = -(-n // per_row)
    footer = FOOTER_HEIGHT if n < n_all else 0
    header = "input | relevance (red: for the class, blue: against)"
    grid_w = 2 * PAD + per_row * pair_w + (per_row - 1) * 2 * GAP
    grid_h = 2 * PAD + HEADER_HEIGHT + grid_rows * pair_h + (grid_rows - 1) * GAP + footer
    canvas = Image.new("RGB", (max(grid_w, 2 * PAD + int(font(12, bold=True).getlength(header)) + 1), grid_h), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    draw.text((PAD, PAD), header, font=font(12, bold=True), fill=MUTED)
    for index in range(n):
        left = PAD + (index % per_row) * (pair_w + 2 * GAP)
        top = PAD + HEADER_HEIGHT + (index // per_row) * (pair_h + GAP)
        heatmap, limit = relevance_picture(maps[index])
        canvas.paste(Image.fromarray(upscale(rgb[index], scale)), (left, top))
        canvas.paste(Image.fromarray(upscale(heatmap, scale)), (left + cell_w + 2, top))
        # A frame, since the heatmap's white (zero relevance) would otherwise merge with the page.
        draw.rectangle([left + cell_w + 1, top - 1, left + 2 * cell_w + 2, top + cell_h], outline=RULE)
        title = f"#{index + 1}" + ("" if labels is None else f"  label {_label_text(labels[index], class_names)}")
        _draw_caption(draw, left, top + cell_h + 3, [(title, TEXT, True), (f"scale ±{limit:.3g}", MUTED, False)])
    if footer:
        draw.text((PAD, canvas.height - PAD - FOOTER_HEIGHT + 4), f"showing the first {n} of {n_all} images",
                  font=font(12), fill=MUTED)
    return np.asarray(canvas)


def labelled_image_rows(rows: Sequence[np.ndarray], captions: Sequence[str], max_rows: int = 24) -> np.ndarray:
    """RGB picture of image rows, each with a caption on its left (e.g. a unit's most activating inputs).

    ``rows`` are uint8 k×H×W[×C] batches of one image size (rows may have fewer images than the longest).
    """
    _check_lengths(len(rows), captions=captions)
    rows, captions = list(rows)[:max_rows], list(captions)[:max_rows]
    if not rows or not any(len(r) for r in rows):
        raise ValueError("no images to draw")
    batches = [to_rgb_batch(r, "row images") for r in rows]
    height, width = next(b for b in batches if len(b)).shape[1:3]
    scale = max(1, upscale_factor(height, width, target=56))
    cell_h, cell_w = height * scale, width * scale
    columns = max(len(b) for b in batches)
    caption_w = min(CAPTION_WIDTH + 80, max(font().getlength(c) for c in captions) + 2 * GAP)
    canvas = Image.new("RGB", (int(2 * PAD + caption_w + columns * (cell_w + GAP)),
                               2 * PAD + len(batches) * (cell_h + GAP)), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for r, (batch, caption) in enumerate(zip(batches, captions)):
        top = PAD + r * (cell_h + GAP)
        draw.text((PAD, top + cell_h // 2 - LINE_HEIGHT // 2), caption, fill=TEXT, font=font())
        for c, image in enumerate(batch):
            canvas.paste(Image.fromarray(upscale(image, scale)), (int(PAD + caption_w + c * (cell_w + GAP)), top))
    return np.asarray(canvas)
