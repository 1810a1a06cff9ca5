"""The reproduction harness (benchmarks/reproduce) end to end in its tiny mode, so it cannot rot.

The tiny mode runs every experiment on the demo's digits CNN (no ../shared needed) through the
same code paths as ``--quick``/full: importance and relevance, ART attacks, the criteria, ONNX
compression, DFlare campaigns and the report writer.
"""
import json
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ("idc_rq1", "idc_rq2", "idc_paper_era", "idc_sensitivity", "idc_classic", "idc_rq3", "idc_rq5", "idc_rq6",
               "dflare_table4", "dflare_rq4")
TITLES = ("IDC RQ1", "IDC RQ2", "IDC under the paper-era protocol", "IDC sensitivity", "Classic criteria on U_O",
          "IDC RQ3", "IDC RQ5", "IDC RQ6", "DFlare Table 4", "DFlare RQ4")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("art", reason="adversarial-robustness-toolbox (the 'attacks' extra) is not installed")
    out = tmp_path_factory.mktemp("reproduce")
    completed = subprocess.run([sys.executable, "-m", "benchmarks.reproduce", "--tiny", "--out", str(out), "--quiet"],
                               cwd=REPO, capture_output=True, text=True, timeout=180)
    return out, completed


def _section(markdown: str, title: str) -> str:
    start = markdown.index(f"## {title}")
    following = markdown.find("\n## ", start + 1)
    return markdown[start:following if following > 0 else len(markdown)]


def _table_numbers(section: str) -> list[float]:
    """Numbers in the table cells of a section (rows starting with '|', header and rule excluded)."""
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [float(n.replace(",", "")) for row in rows for n in re.findall(r"(?<![\w.])-?\d[\d,]*\.?\d*", row)]


@pytest.mark.slow
def test_tiny_run_writes_every_table_with_numbers(tiny_run):
    out, completed = tiny_run
    assert completed.returncode == 0, completed.stderr[-3000:]
    markdown = (out / "REPRODUCTION.md").read_text()
    for name, title in zip(EXPERIMENTS, TITLES):
        assert (out / f"{name}.json").is_file(), name
        section = _section(markdown, title)
        assert "Not run yet" not in section
        assert "**Trend check" in section
        numbers = _table_numbers(section)
        assert len(numbers) >= 5, (title, section)
    assert (out / "dflare_rq4.png").stat().st_size > 1000


@pytest.mark.slow
def test_tiny_results_hold_measured_values(tiny_run):
    out, completed = tiny_run
    assert completed.returncode == 0, completed.stderr[-3000:]
    rq1 = json.loads((out / "idc_rq1.json").read_text())["rows"][0]
    assert rq1["important_mean"] > 0 and rq1["random_mean"] > 0 and rq1["pixels_flipped"] > 0
    rq2 = json.loads((out / "idc_rq2.json").read_text())["rows"]
    for row in rq2:  # adding inputs never lowers coverage
        assert all(s >= o - 1e-12 and d >= o - 1e-12 for o, s, d in zip(row["U_O"], row["U_O+S"], row["U_O+DI"]))
    for row in json.loads((out / "idc_paper_era.json").read_text())["rows"]:
        assert all(0.0 < v <= 1.0 for stage in ("pooled", "per_class", "reference", "paper_era") for v in row[stage])
        assert len(row["paper_era_per_class"]) == 10
    classic = json.loads((out / "idc_classic.json").read_text())["rows"]
    assert [r["setting"] for r in classic] == ["defaults", "sadl buckets"]  # no reference layer set for the digits CNN
    assert all(0.0 <= v <= 1.0 for r in classic for v in r["coverage"].values())
    rq3 = json.loads((out / "idc_rq3.json").read_text())["rows"]
    assert [r["set"] for r in rq3] == ["U_O", "U_O+fgsm", "U_O+bim", "U_O+jsma", "U_O+cw", "U_O+gauss"]
    assert all(0.0 <= r["success"] <= 1.0 for r in rq3[1:])
    sys.path.insert(0, str(REPO))
    from benchmarks.reproduce.config import STRATEGIES
    table4 = json.loads((out / "dflare_table4.json").read_text())["rows"]
    assert {(r["pair"], r["strategy"]) for r in table4} == {
        (p, s) for p in ("digits-int8-static", "digits-prune-l1") for s in STRATEGIES}
    assert all(r["fuzzed"] + r["already_deviating"] == r["seeds"] for r in table4)
    rq4 = json.loads((out / "dflare_rq4.json").read_text())
    assert sorted({r["percent"] for r in rq4["rows"]}) == [10, 30, 50]


@pytest.mark.slow
def test_saved_campaigns_are_reused_when_run_again(tiny_run):
    out, completed = tiny_run
    assert completed.returncode == 0, completed.stderr[-3000:]
    before = json.loads((out / "dflare_table4.json").read_text())["rows"]
    again = subprocess.run([sys.executable, "-m", "benchmarks.reproduce", "--tiny", "--out", str(out), "--quiet",
                            "--only", "dflare_table4"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads((out / "dflare_table4.json").read_text())["rows"]
    assert [r["wall_seconds"] for r in after] == [r["wall_seconds"] for r in before]  # not re-run: same records


def test_overrides_are_typed_and_checked():
    sys.path.insert(0, str(REPO))
    from benchmarks.reproduce.__main__ import parse_overrides

    assert parse_overrides(["fuzz_runs=2", "rq2_top_m=6,8", "fuzz_max_queries=none", "fuzz_timeout=60"]) == {
        "fuzz_runs": 2, "rq2_top_m": (6, 8), "fuzz_max_queries": None, "fuzz_timeout": 60.0}
    with pytest.raises(SystemExit, match="unknown setting"):
        parse_overrides(["no_such_setting=1"])


def test_a_full_re_render_keeps_the_sections_other_scripts_wrote():
    from benchmarks.results import kept_sections

    old = "# R\n\nold table\n\n<!-- train_x -->\n## Trained\n| a |\n<!-- /train_x -->\n\n<!-- mine -->x<!-- /mine -->\n"
    new = "# R\n\nnew table\n<!-- mine -->y<!-- /mine -->\n"
    assert kept_sections(old, new) == "\n\n<!-- train_x -->\n## Trained\n| a |\n<!-- /train_x -->\n"


def test_rq6_tiny_retrains_three_arms_on_equal_sized_augmentations(tmp_path):
    """RQ6 alone in tiny mode (~10 s): guided and random sets of the same size K, every arm trained with
    every training seed, accuracies in [0, 1], and the section rendered with its difference table."""
    completed = subprocess.run([sys.executable, "-m", "benchmarks.reproduce", "--tiny", "--out", str(tmp_path), "--quiet",
                                "--only", "idc_rq6"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads((tmp_path / "idc_rq6.json").read_text())
    meta, rows = result["meta"], result["rows"]
    seeds = result["config"]["rq6_train_seeds"]
    assert {(r["arm"], r["seed"]) for r in rows} == {(a, s) for a in ("baseline", "random", "guided") for s in seeds}
    k = meta["K"]
    assert k > 0 and sum(meta["generation"]["kept_per_run"]) == k
    sizes = {r["arm"]: r["train_inputs"] for r in rows}
    assert sizes["guided"] == sizes["random"] == sizes["baseline"] + k
    coverage = meta["generation"]["coverage"]
    assert coverage["training_plus_guided"] >= coverage["training_split"] and coverage["guided"] <= coverage["total"]
    for row in rows:
        for key in ("clean", "corrupted", "mutants", "triggers"):
            assert 0.0 <= row[key] <= 1.0, (key, row)
        assert len(row["per_corruption"]) == len(meta["corruptions"]) == 8
    assert meta["triggers"]["triggers"] > 0
    section = _section((tmp_path / "REPRODUCTION.md").read_text(), "IDC RQ6")
    assert "guided - random" in section and "**Trend check" in section and f"K = {k}" in section
    assert len(_table_numbers(section)) >= 20


def test_rq6_random_control_keeps_the_label_and_the_chain_length():
    sys.path.insert(0, str(REPO))
    import numpy as np

    from benchmarks.reproduce.idc_rq6 import random_control

    class Brightest:  # "predicts" 1 for images brighter than 100 on average, else 0
        def classifier(self):
            return self

        def predict(self, images):
            return (np.asarray(images).reshape(len(images), -1).mean(axis=1) > 100).astype(np.int64)

    def brighten(image, rng):
        return np.clip(image.astype(int) + int(rng.integers(0, 80)), 0, 255).astype(np.uint8)

    seeds = np.full((6, 4, 4, 1), 60, np.uint8)
    labels = np.array([0, 0, 0, 1, 1, 1])
    depths = np.array([1, 2, 3, 1, 2, 3])
    mutants, fallbacks = random_control(Brightest(), seeds, labels, depths, [brighten], np.random.default_rng(0))
    assert fallbacks == 0
    assert (Brightest().predict(mutants) == labels).all()
    assert mutants.shape == seeds.shape and (mutants >= seeds).all()


def test_sigterm_stops_the_harness_inside_a_training_and_saves_no_half_trained_row(tmp_path):
    """SIGTERM while RQ6 trains its first model (epochs made endless): the harness stops within
    seconds with exit code 130, starts no other training, saves no row for the interrupted model,
    and still writes the report from what finished. (Before, the training swallowed the interrupt,
    saved the half-trained model's row and the harness went on with the next one.)"""
    import signal
    import time

    process = subprocess.Popen([sys.executable, "-m", "benchmarks.reproduce", "--tiny", "--out", str(tmp_path),
                                "--only", "idc_rq6", "--set", "rq6_epochs=1000000"],
                               cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            if "idc_rq6: training" in line:
                time.sleep(1)
                process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                break
        rest = process.communicate(timeout=60)[1]
    finally:
        process.kill()
    output = "".join(lines) + rest
    assert process.returncode == 130, output[-3000:]
    assert time.monotonic() - signalled < 30
    assert output.count("idc_rq6: training") == 1 and "interrupted:" in output
    assert not list((tmp_path / "idc_rq6").glob("model-*.json")) and not (tmp_path / "idc_rq6.json").exists()
    assert (tmp_path / "REPRODUCTION.md").is_file()
