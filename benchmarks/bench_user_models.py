"""Every command on CNNs as users write them, in every form they log them: the table of issue #65.

Each model of :mod:`benchmarks.user_models` is trained on digits[0:1300] (8 epochs, seeded) and logged as
users do (pt2 with MLflow's defaults, pickle, ONNX from torch.onnx.export's default exporter). Then, per
form, through the command line in this process: describe; coverage (IDC and every classic criterion,
digits[1300:], 20 analysis-data resamples); compress (int8-static and prune-l1) and a bounded int8-static
export (disagreement <= 0.05, held out on digits[1550:]); fuzz with dflare (20 seeds, 300 queries) and the
boundary walk (20 seeds inside L-inf 32, 100 queries) against the form's int8-static export; gate; and a
pipeline of a small policy (int8-dynamic, coverage, 10 fuzzed seeds, gate). Each cell gives the exit code
(0; 1/3 for a gate's FAIL/INCONCLUSIVE verdict) and the seconds it took; the coverage column also the paper's
IDC and reachable IDC, so that the forms can be compared. Writes the table into benchmarks/RESULTS.md between its markers.

    .venv/bin/python -m benchmarks.bench_user_models [--models own-cnn,mean-head] [--no-write]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results import publish  # noqa: E402  (after the path insert)
from benchmarks.user_models import MODELS, log_as_users_do, trained  # noqa: E402

BEGIN, END = "<!-- bench_user_models -->", "<!-- /bench_user_models -->"
FORMS = ("pt2", "pickle", "onnx")
COMMANDS = ("describe", "coverage", "compress", "bounded", "fuzz dflare", "fuzz boundary", "gate", "pipeline")


def run(argv: list[str]) -> tuple[int, float, str]:
    """``mlflow-di ARGV`` in this process: (exit code, seconds, its last line of error output)."""
    from mlflow_di.cli import main

    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    lines = err.getvalue().strip().splitlines()
    return code, time.perf_counter() - start, lines[-1] if lines else ""


def commands(name: str, form: str, uri: str, folder: pathlib.Path, resize: list[str]) -> dict[str, list[str]]:
    """The command lines of one model's form, in order."""
    export = f"models:/{name}-{form}-int8-static/1"
    fuzz = ["fuzz", "--original", uri, "--compressed", export, "--seed-data", "digits[1300:1320]",
            *(["--preprocessing-original", "resize=28", "--preprocessing-compressed", "resize=28"] if resize else [])]
    policy = folder / f"{name}-{form}.yaml"
    override = f"preprocessing: {{{name}-{form}: {{resize: 28}}}}\n" if resize else ""
    policy.write_text(override + "compress: {methods: [int8-dynamic], eval_data: 'digits[1300:]'}\n"
                      "coverage: {train_data: 'digits[0:1300]', test_data: ['digits[1300:]'], idc_resamples: 10}\n"
                      "fuzz: {seed_data: 'digits[1300:]', num_seeds: 10, max_queries: 200}\n"
                      "gate: {thresholds: {min_idc: 0.5, max_disagreement_rate: 0.05}}\n"
                      f"trust: {{pickled_models: [{name}-pickle]}}\n")
    return {
        "describe": ["describe", uri, *resize],
        "coverage": ["coverage", "--model-uri", uri, "--train-data", "digits[0:1300]", "--test-data", "digits[1300:]",
                     "--idc-resamples", "20", "--json-out", str(folder / f"{name}-{form}-coverage.json"), *resize],
        "compress": ["compress", "--model-uri", uri, "--method", "int8-static,prune-l1", "--calib-data", "digits[0:300]",
                     "--eval-data", "digits[1300:1550]", "--no-benefit", *resize],
        "bounded": ["compress", "--model-uri", uri, "--method", "int8-static", "--calib-data", "digits[0:300]",
                    "--eval-data", "digits[1300:1550]", "--holdout-data", "digits[1550:]", "--max-disagreement-rate",
                    "0.05", "--register-as", f"{name}-{form}-bounded", "--no-benefit", *resize],
        "fuzz dflare": [*fuzz, "--max-queries", "300", "--out-dir", str(folder / f"{name}-{form}-dflare")],
        "fuzz boundary": [*fuzz, "--strategy", "boundary", "--max-linf", "32", "--max-queries", "100",
                          "--out-dir", str(folder / f"{name}-{form}-boundary")],
        "gate": ["gate", "--model-uri", uri, "--compressed", export, "--min-idc", "0.5", "--max-disagreement-rate",
                 "0.05", "--max-realistic-success-rate", "0.5", "--realism-budget", "linf=32"],
        "pipeline": ["pipeline", "--policy", str(policy), "--model-uri", uri, "--state-dir",
                     str(folder / f"{name}-{form}-state")],
    }


def measure(name: str, folder: pathlib.Path) -> dict:
    uris = log_as_users_do(trained(name), name, folder)
    resize = ["--preprocessing", "resize=28"] if MODELS[name].size != 8 else []
    cells: dict = {}
    for form in FORMS:
        for command, argv in commands(name, form, uris[form], folder, resize).items():
            code, seconds, last = run(argv)
            cells[(form, command)] = {"code": code, "seconds": seconds, "error": last if code == 2 else ""}
            print(name, form, command, code, f"{seconds:.1f}s", last[:160] if code == 2 else "", flush=True)
        covered = folder / f"{name}-{form}-coverage.json"
        if covered.exists():
            summary = json.loads(covered.read_text())
            cells[(form, "coverage")].update(idc=summary.get("idc"), reachable=summary.get("idc_reachable"))
    return cells


def render(results: dict) -> str:
    lines = [BEGIN, "## Models as users write them (bench_user_models)", "",
             "`.venv/bin/python -m benchmarks.bench_user_models`: each model of `benchmarks/user_models.py`, trained "
             "on digits[0:1300] and logged as pt2 (MLflow's default), pickle and ONNX (torch.onnx.export's default "
             "exporter), through every command in its form. A cell: exit code and seconds (0 ok; a gate's or "
             "pipeline's 1 is FAIL, 3 INCONCLUSIVE: a verdict; 2 would be a refusal); coverage adds the paper's IDC / "
             "reachable IDC, equal in every form when the model is the same function.", "",
             "| model | form | " + " | ".join(COMMANDS) + " |", "|---|---|" + "---|" * len(COMMANDS)]
    for name, cells in results.items():
        for form in FORMS:
            row = []
            for command in COMMANDS:
                cell = cells.get((form, command))
                if cell is None:
                    row.append("-")
                    continue
                text = f"{cell['code']} ({cell['seconds']:.0f} s)"
                if command == "coverage" and cell.get("idc") is not None:
                    text += f" {cell['idc']:.3f} / {cell['reachable']:.3f}"
                row.append(text)
            lines.append(f"| {name} | {form} | " + " | ".join(row) + " |")
    refused = [f"{name} {form} {command}: {cell['error']}" for name, cells in results.items()
               for (form, command), cell in cells.items() if cell["code"] == 2]
    lines += ["", "Refused (exit 2): " + ("; ".join(refused) if refused else "none."), END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-user-models-") as scratch:
        folder = pathlib.Path(scratch)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
        os.chdir(folder)
        for name in args.models.split(","):
            results[name] = measure(name, folder)
    section = render(results)
    publish(section, BEGIN, END, write=not args.no_write)


if __name__ == "__main__":
    main()
