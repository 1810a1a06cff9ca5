"""Reports are single self-contained HTML files with escaped text, and the pictures put pixels where they belong."""
import base64
import html
import io
import math
import re

import numpy as np
import pytest
from PIL import Image

import mlflow_di  # noqa: F401  (import guard first, as in every test)
from mlflow_di.reporting import (
    HtmlReport,
    bar_plot,
    coverage_growth_plot,
    format_value,
    operator_summary,
    perturbation_sizes,
    png_data_uri,
    relevance_heatmaps,
    save_png,
    to_png,
    trigger_grid,
    trigger_grid_layout,
    trigger_grid_pages,
)
from mlflow_di.reporting.html import MAX_CELL_CHARS


def _digits(n: int, size: int = 28, channels: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, channels), dtype=np.uint8)


def _embedded_pngs(page: str) -> list[Image.Image]:
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    images = []
    for payload in uris:
        image = Image.open(io.BytesIO(base64.b64decode(payload)))
        image.verify()  # raises on a corrupt PNG
        images.append(Image.open(io.BytesIO(base64.b64decode(payload))))
    return images


def _full_report() -> HtmlReport:
    seeds = _digits(3)
    report = HtmlReport("Fuzzing lenet5", "models:/lenet5/1")
    report.verdict(True, "no deviation found")
    report.section("Summary").metrics({"success_rate": 0.25, "triggers": 3}, percent_keys=["success_rate"])
    report.paragraph("plain text").code("mlflow-di fuzz --seeds digits")
    report.image(trigger_grid(seeds, seeds, [1, 2, 3], [1, 2, 4]), "grid")
    report.image(to_png(bar_plot({"idc": 0.5, "nc": 0.25}, "criteria")), "bars")
    report.table([{"seed": 1, "queries": 10}])
    return report


def test_report_is_self_contained_with_valid_embedded_pngs(tmp_path):
    path = _full_report().save(tmp_path / "sub" / "report.html")
    page = path.read_text(encoding="utf-8")

    for forbidden in ("http://", "https://", 'src="/', "<script", "<link", "@import", "url("):
        assert forbidden not in page
    assert page.count("<img ") == 2
    images = _embedded_pngs(page)
    assert len(images) == 2 and all(image.format == "PNG" for image in images)
    assert page.count("<section>") == page.count("</section>") == 1


def test_user_text_is_escaped_everywhere():
    attack = "<script>alert('x')</script>"
    report = HtmlReport(attack, subtitle=attack).verdict(False, attack).section(attack).paragraph(attack)
    report.code(attack).metrics({attack: attack}, caption=attack).table([{attack: attack}], caption=attack)
    report.image(to_png(np.zeros((2, 2, 3), np.uint8)), caption=attack)
    page = report.render()

    assert "<script" not in page
    # title twice (<title>, <h1>), image caption twice (figcaption, alt), metric and table cell key and value
    # (table text may carry <wbr> line-break hints after "/" and "_": they are ours, not the user's)
    assert page.replace("<wbr>", "").count("&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;") == 15


def test_verdict_banners_say_pass_fail_or_info():
    assert 'class="verdict pass"' in HtmlReport("t").verdict(True, "ok").render()
    assert ">FAIL<" in HtmlReport("t").verdict(False, "bad").render()
    assert ">INFO<" in HtmlReport("t").verdict(None, "note").render()


def test_metrics_format_percentages_integers_and_strings():
    page = HtmlReport("t").metrics({"idc": 0.8531, "idc_total": 12345, "mean_queries": 83.97123, "uri": "models:/a/1"},
                                   percent_keys=["idc"]).render()
    assert ">85.31 %<" in page and ">12,345<" in page and ">83.97<" in page and ">models:/a/1<" in page
    with pytest.raises(ValueError, match="idc"):
        HtmlReport("t").metrics({"nc": 0.1}, percent_keys=["idc"])


def test_format_value():
    assert format_value(np.float32(0.5), percent=True) == "50.00 %"
    assert format_value(np.int64(1234567)) == "1,234,567"
    assert format_value(float("nan")) == "—" and format_value(None) == "—"
    assert format_value(True) == "yes"
    assert format_value(123456.7) == "123,457"


def test_long_table_is_truncated_with_a_note():
    rows = [{"seed": i, "found": i % 2 == 0} for i in range(250)]
    page = HtmlReport("t").table(rows, caption="seeds", max_rows=200).render()
    body = page.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<tr>") == 200
    assert "50 more rows not shown (showing the first 200 of 250)" in page

    short = HtmlReport("t").table(rows[:5], columns=["found"]).render()
    assert "not shown" not in short and "seed" not in short.split("<thead>")[1].split("</thead>")[0]


def test_image_accepts_arrays_and_rejects_non_png():
    page = HtmlReport("t").image(np.full((4, 5, 3), 200, np.uint8), "array").render()
    (image,) = _embedded_pngs(page)
    assert image.size == (5, 4)
    with pytest.raises(ValueError, match="PNG"):
        HtmlReport("t").image(b"GIF89a...", "not a png")
    with pytest.raises(ValueError, match="PNG"):
        png_data_uri(b"\xff\xd8\xff")


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_trigger_grid_size_grows_by_one_row_pitch_per_row(rows):
    seeds = _digits(rows)
    grid = trigger_grid(seeds, seeds, [0] * rows, [1] * rows)
    layout = trigger_grid_layout(rows, 28, 28)
    one_row = trigger_grid_layout(1, 28, 28)

    assert grid.dtype == np.uint8 and grid.shape == (layout.height, layout.width, 3)
    assert layout.cell_height == layout.cell_width == 112  # 28×28 enlarged 4× for visibility
    assert layout.height - one_row.height == (rows - 1) * (layout.row_top(1) - layout.row_top(0))
    assert layout.row_top(1) - layout.row_top(0) >= 112


def test_small_digits_are_enlarged_with_nearest_neighbour():
    seeds = np.zeros((1, 8, 8, 1), np.uint8)
    seeds[0, 2, 3] = 255
    grid = trigger_grid(seeds, seeds, [1], [1])
    layout = trigger_grid_layout(1, 8, 8)
    top, left, bottom, right = layout.cell_box(0, 0)
    assert layout.scale == 14
    cell = grid[top:bottom, left:right, 0]
    assert (cell[2 * 14:3 * 14, 3 * 14:4 * 14] == 255).all()
    assert cell.sum() == 255 * 14 * 14


def test_trigger_grid_shows_the_difference_where_the_images_differ():
    seeds = np.full((2, 28, 28, 3), 100, np.uint8)
    triggers = seeds.copy()
    triggers[1, 5, 9, 2] = 130  # one changed pixel in the second row
    grid = trigger_grid(seeds, triggers, [7, 7], [7, 3], true_labels=[7, 7])
    layout = trigger_grid_layout(2, 28, 28)

    top, left, bottom, right = layout.cell_box(1, 2)
    difference = grid[top:bottom, left:right].astype(int).sum(axis=2)
    s = layout.scale
    changed = difference[5 * s:6 * s, 9 * s:10 * s]
    rest = difference.copy()
    rest[5 * s:6 * s, 9 * s:10 * s] = -1
    assert changed.min() > 600  # the largest change is drawn near white
    assert rest[rest >= 0].max() < 30  # unchanged pixels stay black
    top, left, bottom, right = layout.cell_box(0, 2)
    assert grid[top:bottom, left:right].astype(int).sum(axis=2).max() < 30  # identical row: all dark
    top, left, bottom, right = layout.cell_box(1, 1)
    assert (grid[top + 5 * s, left + 9 * s] == [100, 100, 130]).all()  # the trigger itself, unscaled colours


def test_trigger_grid_notes_left_out_rows_and_checks_inputs():
    seeds = _digits(20)
    grid = trigger_grid(seeds, seeds, np.zeros(20, int), np.ones(20, int), max_rows=4)
    assert grid.shape[0] == trigger_grid_layout(4, 28, 28, truncated=True).height
    assert trigger_grid_layout(4, 28, 28, truncated=True).height > trigger_grid_layout(4, 28, 28).height
    with pytest.raises(ValueError, match="same shape"):
        trigger_grid(seeds, seeds[:3], [0] * 20, [0] * 20)
    with pytest.raises(ValueError, match="original_labels"):
        trigger_grid(seeds, seeds, [0], [0] * 20)


def test_relevance_heatmaps_centre_zero_on_white_and_sign_on_red_or_blue():
    images = np.repeat(_digits(2), 3, axis=3)  # grey RGB: no red or blue of its own
    relevance = np.zeros((2, 3, 28, 28), np.float32)  # N×C×H×W as the model input
    relevance[0, :, 0, 0] = 1.0
    relevance[0, :, 0, 1] = -1.0
    picture = relevance_heatmaps(images, relevance, labels=[3, 4])
    assert picture.dtype == np.uint8 and picture.ndim == 3
    assert 112 * 2 < picture.shape[1] <= 860

    pixels = picture.reshape(-1, 3).astype(int)
    red = (pixels[:, 0] > 150) & (pixels[:, 2] < 60)
    blue = (pixels[:, 2] > 150) & (pixels[:, 0] < 60)
    assert red.sum() == 4 * 4 and blue.sum() == 4 * 4  # one 4×4 block each: the +1 and the −1 pixel
    same_layout = relevance_heatmaps(images, relevance.transpose(0, 2, 3, 1), labels=[3, 4])
    assert np.array_equal(picture, same_layout)
    with pytest.raises(ValueError, match="does not match"):
        relevance_heatmaps(images, np.zeros((2, 27, 27)))


def test_plots_are_reasonable_pngs(tmp_path):
    growth = coverage_growth_plot({"original": np.linspace(0.1, 0.7, 500),
                                   "original + augmented": np.linspace(0.1, 0.9, 800)})
    bars = bar_plot({"idc": 0.78, "nc": 0.6, "kmnc": 0.41}, "criteria")
    layers = bar_plot({f"layer_with_long_name_{i}": i / 10 for i in range(10)}, "IDC per layer")
    for picture in (growth, bars, layers):
        assert picture.dtype == np.uint8 and picture.shape[2] == 3
        assert 300 <= picture.shape[1] <= 860 and 200 <= picture.shape[0] <= 1000
        assert picture.std() > 10  # not a blank canvas
    save_png(growth, tmp_path / "growth.png")
    with Image.open(tmp_path / "growth.png") as image:
        assert image.size == (growth.shape[1], growth.shape[0])
    with pytest.raises(ValueError):
        coverage_growth_plot({})


def test_bar_plot_draws_a_reference_line_and_leaves_nan_bars_out():
    values = {f"class {c}": (math.nan if c == 3 else c / 10) for c in range(10)}
    plain = bar_plot(values, "IDC per class")
    with_mean = bar_plot(values, "IDC per class", reference=0.45, reference_label="mean")
    assert plain.shape == with_mean.shape and not np.array_equal(plain, with_mean)
    assert np.array_equal(bar_plot(values, "IDC per class", reference=math.nan), plain)  # no mean: no line


OPERATORS = ("gaussian_noise", "salt_and_pepper", "multiplicative_noise", "pixel_change", "average_blur",
             "gaussian_blur", "median_blur")


def _seed_rows(n: int, chain_length: int = 40) -> list[dict]:
    """Rows as the fuzz command builds them, with a long 'a > b > c > ...' operator chain."""
    rng = np.random.default_rng(1)
    return [{"seed": i, "label": i % 10, "success": True, "stop": "trigger", "queries": int(rng.integers(1, 900)),
             "seconds": 0.0123, "original_label": 3, "compressed_label": 5, "original_top1": 0.5123,
             "compressed_top1": 0.6012,
             "operators": " > ".join(OPERATORS[j % 7] for j in rng.integers(0, 7, chain_length))}
            for i in range(n)]


def _cells(page: str) -> list[str]:
    """Text of every table cell as the reader sees it (tags stripped, entities decoded)."""
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in re.findall(r"<td[^>]*>(.*?)</td>", page, re.S)]


def test_a_100_seed_table_is_compact_one_short_line_per_row():
    rows = _seed_rows(100)
    page = HtmlReport("fuzz").table(rows).render()
    body = page.split("<tbody>")[1].split("</tbody>")[0]
    assert body.count("<tr>") == 100
    cells = _cells(body)
    assert len(cells) == 100 * 11
    assert max(len(cell) for cell in cells) <= MAX_CELL_CHARS
    assert all(len(r["operators"]) > 200 for r in rows)  # what made each row ~200 px tall before
    # The whole chain is still there, in the cut cell's tooltip.
    titles = re.findall(r'<td class="cut" title="([^"]*)">', body)
    assert len(titles) == 100 and titles[0] == rows[0]["operators"].replace(">", "&gt;")
    assert "white-space: nowrap" in page and '<div class="table-wrap">' in page and "overflow-x: auto" in page


def test_table_cells_are_cut_at_the_given_length_and_short_ones_kept():
    page = HtmlReport("t").table([{"a": "x" * 30, "b": "short", "n": 123456789012}], max_cell_chars=10).render()
    assert _cells(page) == ["x" * 9 + "…", "short", "123,456,789,012"]  # numbers are never cut
    assert 'title="' + "x" * 30 + '"' in page


def test_operator_summary_counts_the_chain():
    chain = ["gaussian_noise", "average_blur", "gaussian_noise", "pixel_change", "average_blur", "gaussian_noise"]
    assert operator_summary(chain) == "gaussian_noise×3, average_blur×2, pixel_change×1"
    assert operator_summary([]) == "—"
    long_chain = [OPERATORS[i % 7] for i in range(300)]
    assert len(operator_summary(long_chain)) < 150  # one entry per operator, however long the chain


def test_perturbation_sizes_are_l2_and_linf_of_trigger_minus_seed():
    seeds = np.zeros((2, 4, 4, 1), np.uint8)
    triggers = seeds.copy()
    triggers[0, 0, 0, 0], triggers[0, 1, 1, 0] = 3, 4
    (moved, same) = perturbation_sizes(seeds, triggers)
    assert (moved.changed_pixels, moved.l2, moved.linf) == (2, 5.0, 4)
    assert (same.changed_pixels, same.l2, same.linf) == (0, 0.0, 0) and same.text() == "identical to the seed"
    assert moved.text() == "2 px changed, L∞ 4, L2 5.0"
    rgb = np.zeros((1, 2, 2, 3), np.uint8)
    assert perturbation_sizes(rgb, rgb + 255)[0].linf == 255
    assert perturbation_sizes(rgb, rgb + 1)[0].l2 == pytest.approx(np.sqrt(12))  # every channel counts once
    assert perturbation_sizes(seeds[..., 0], triggers[..., 0])[0].l2 == 5.0  # grey given as N×H×W


@pytest.mark.parametrize("total, per_page, pages", [(1, 16, 1), (16, 16, 1), (17, 16, 2), (40, 16, 3), (5, 2, 3)])
def test_trigger_grid_pages_cover_every_trigger(total, per_page, pages):
    seeds, triggers = _digits(total), _digits(total, seed=1)
    chains = [operator_summary(OPERATORS[: 1 + i % 2]) for i in range(total)]  # one caption line: rows keep their pitch
    result = trigger_grid_pages(seeds, triggers, [0] * total, [1] * total, true_labels=[2] * total,
                                per_page=per_page, notes=[f"{i} queries" for i in range(total)], operators=chains)
    assert len(result) == pages
    rows = [min(per_page, total - start) for start in range(0, total, per_page)]
    assert sum(rows) == total
    for picture, count in zip(result, rows):
        # Each page is exactly as tall as a grid of its rows (plus the page footer when there are several).
        pitch = trigger_grid_layout(2, 28, 28).row_top(1) - trigger_grid_layout(2, 28, 28).row_top(0)
        one = trigger_grid_layout(1, 28, 28, truncated=pages > 1).height
        assert picture.dtype == np.uint8 and picture.shape[0] == one + (count - 1) * pitch
    # A page's rows show exactly its triggers: the seed cell of page 2's first row is trigger per_page + 1's seed.
    if pages > 1:
        layout = trigger_grid_layout(per_page, 28, 28)
        top, left, bottom, right = layout.cell_box(0, 0)
        s = layout.scale
        np.testing.assert_array_equal(result[1][top:bottom:s, left:right:s, 0], seeds[per_page, ..., 0])


def test_trigger_grid_rows_grow_to_fit_a_wrapped_operator_summary():
    seeds = _digits(2, size=8)
    long = operator_summary([OPERATORS[i % 7] for i in range(20)])
    plain = trigger_grid(seeds, seeds, [0, 0], [1, 1], true_labels=[1, 1], notes=["1 queries"] * 2)
    wrapped = trigger_grid(seeds, seeds, [0, 0], [1, 1], true_labels=[1, 1], notes=["1 queries"] * 2,
                           operators=[long] * 2)
    assert wrapped.shape[0] > plain.shape[0]
    with pytest.raises(ValueError, match="operators has 1 entries"):
        trigger_grid(seeds, seeds, [0, 0], [1, 1], operators=[long])


def test_gallery_embeds_every_page_in_one_scrolling_box():
    pages = trigger_grid_pages(_digits(5), _digits(5, seed=2), [0] * 5, [1] * 5, per_page=2)
    page = HtmlReport("t").gallery(pages, "all 5 triggers").render()
    gallery = page.split('<div class="gallery">')[1].split("</div>")[0]
    assert len(_embedded_pngs(gallery)) == 3 and "overflow: auto" in page
    assert [image.size[1] for image in _embedded_pngs(gallery)] == [p.shape[0] for p in pages]
    with pytest.raises(ValueError):
        HtmlReport("t").gallery([])
