"""Run the reproduction experiments and write the markdown report.

    python -m benchmarks.reproduce                 # full configuration -> benchmarks/REPRODUCTION.md
    python -m benchmarks.reproduce --quick         # small version (< 5 min) -> <out>/REPRODUCTION.md
    python -m benchmarks.reproduce --tiny --out D  # seconds, on the digits CNN (for tests)
    python -m benchmarks.reproduce --only dflare_table4 --set fuzz_runs=2
    python -m benchmarks.reproduce --render-only   # re-render the report from saved results

Results are saved per experiment in ``--out`` (``<name>.json``; DFlare campaigns one file each,
reused when run again with the same settings), so an interrupted run (Ctrl-C) keeps what it
finished (SIGTERM counts as Ctrl-C, for runs in the background) and stops: no further experiment
or campaign starts after the signal; the report is written from whatever is there. Exit code 1 if
an experiment failed, 130 if it was interrupted.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pathlib
import shlex
import signal
import sys
import time
import traceback

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow_di  # noqa: E402,F401  (torchvision guard before anything imports torchvision)

from benchmarks.reproduce import EXPERIMENTS  # noqa: E402
from benchmarks.reproduce.config import REPO, Config, default_shared, make_config  # noqa: E402
from benchmarks.reproduce.results import ExperimentResult, Log, checkpoint, now, request_stop  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "reproduce"
FULL_MARKDOWN = REPO / "benchmarks" / "REPRODUCTION.md"
#: Experiments whose ``run`` takes the output folder (they keep partial results or files there).
TAKES_OUT = ("dflare_table4", "dflare_rq4", "idc_rq6")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reproduce", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small version of every experiment (< 5 min)")
    mode.add_argument("--tiny", action="store_true", help="seconds-long run on the digits CNN (tests the harness)")
    parser.add_argument("--out", type=pathlib.Path, help="results folder (default benchmarks/reproduce/results[-MODE])")
    parser.add_argument("--markdown", type=pathlib.Path,
                        help="report path (default: benchmarks/REPRODUCTION.md for full runs, else OUT/REPRODUCTION.md)")
    parser.add_argument("--only", help=f"comma-separated experiments to run (default all: {','.join(EXPERIMENTS)})")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a configuration field, e.g. fuzz_runs=2 or rq2_top_m=6,8 (repeatable)")
    parser.add_argument("--shared", default=str(default_shared()), help="folder with the reference models and data")
    parser.add_argument("--log", type=pathlib.Path, help="also append progress lines to this file")
    parser.add_argument("--render-only", action="store_true", help="only re-render the report from saved results")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser.parse_args(argv)


def parse_overrides(pairs: list[str]) -> dict:
    """``KEY=VALUE`` strings -> typed values, by the type of the field's full-mode default."""
    defaults = make_config("full", shared=".").to_dict()
    overrides = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        if key not in defaults or key in ("mode", "shared"):
            settable = ", ".join(k for k in defaults if k not in ("mode", "shared"))
            raise SystemExit(f"unknown setting '{key}'; settable: {settable}")
        overrides[key] = _typed(text, defaults[key], key)
    return overrides


def _typed(text: str, default, key: str):
    if isinstance(default, tuple):
        kind = type(default[0]) if default else str
        return tuple(kind(v) for v in text.split(",") if v)
    if default is None:  # fuzz_max_queries
        return None if text.lower() in ("", "none") else int(text)
    if isinstance(default, bool):
        return text.lower() in ("1", "true", "yes")
    try:
        return type(default)(text)
    except ValueError:
        raise SystemExit(f"setting '{key}' needs a {type(default).__name__}, got '{text}'") from None


def run_experiment(name: str, config: Config, subjects, out: pathlib.Path, log: Log, command: str) -> ExperimentResult:
    module = importlib.import_module(f"benchmarks.reproduce.{name}")
    started = time.perf_counter()
    kwargs = {"out": out} if name in TAKES_OUT else {}
    if name == "idc_rq3":
        kwargs = {"cache_dir": out / "cache" / "attacks"}
    result = module.run(config, subjects, log, **kwargs)
    checkpoint()  # a result that ran through a stop request may hold cut-short campaigns: not saved
    result.seconds = time.perf_counter() - started
    result.finished = now()
    result.meta["command"] = command
    result.save(out)
    log(f"{name}: done in {result.seconds / 60:.1f} min, saved {out / (name + '.json')}")
    return result


def _interrupt(_signum, _frame):
    request_stop()
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    mode = "quick" if args.quick else "tiny" if args.tiny else "full"
    out = (args.out or RESULTS_DIR / ("results" if mode == "full" else f"results-{mode}")).resolve()
    markdown = (args.markdown or (FULL_MARKDOWN if mode == "full" and args.out is None else out / "REPRODUCTION.md"))
    names = [n.strip() for n in (args.only or ",".join(EXPERIMENTS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise SystemExit(f"unknown experiment(s) {unknown}; choose from {', '.join(EXPERIMENTS)}")
    log = Log(args.log, quiet=args.quiet)
    command = _command(argv if argv is not None else sys.argv[1:])
    failed = []
    if not args.render_only:
        from benchmarks.reproduce.subjects import Subjects

        config = make_config(mode, shared=args.shared, **parse_overrides(args.set))
        log(f"mode {mode}, out {out}, experiments {', '.join(names)}; "
            + ", ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config) if f.name != "shared"))
        subjects = Subjects(config, work_dir=out / "cache")
        try:
            for name in names:
                try:
                    run_experiment(name, config, subjects, out, log, command)
                except KeyboardInterrupt:
                    raise
                except Exception:  # one failed experiment must not cost the others
                    failed.append(name)
                    log(f"{name}: FAILED\n{traceback.format_exc()}")
        except KeyboardInterrupt:
            log.note("interrupted: finished experiments (and finished DFlare campaigns) are saved")
            write_report(out, markdown, command)
            log.note(f"report written to {markdown}")
            return 130
    write_report(out, markdown, command)
    log.note(f"report written to {markdown}")
    return 1 if failed else 0


def _command(argv: list[str]) -> str:
    return "python -m benchmarks.reproduce" + "".join(" " + shlex.quote(a) for a in argv)


def write_report(out: pathlib.Path, markdown: pathlib.Path, command: str) -> None:
    from benchmarks.reproduce.markdown import render
    from benchmarks.results import kept_sections

    results = {name: ExperimentResult.load(out, name) for name in EXPERIMENTS}
    markdown.parent.mkdir(parents=True, exist_ok=True)
    text = render(results, markdown.resolve(), command, out)
    if markdown.exists():  # sections other scripts wrote (e.g. train_reference_lenets) survive a re-render
        text = text.rstrip("\n") + kept_sections(markdown.read_text(), text)
    markdown.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
