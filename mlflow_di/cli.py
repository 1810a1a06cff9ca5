"""The ``mlflow-di`` command line: parse, call the engines, log, exit.

Exit codes: 0 success, 1 a quality gate failed, 2 bad input (one line on stderr, no
traceback), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). Each subcommand lives in
:mod:`mlflow_di.commands`; a subcommand's module is imported only when it runs or its help is
shown, and heavy libraries (torch, mlflow, onnxruntime) only inside the work, so ``--help`` and
usage errors answer at once.
"""
from __future__ import annotations

import errno
import importlib
import logging
import os
import signal
import sys

import click

from mlflow_di import __version__
from mlflow_di.commands.options import FiniteFloat
from mlflow_di.errors import Terminated, UserError, note_sigterm, received_sigterm

#: Subcommand name -> module in mlflow_di.commands (each defines ``command``), in help order.
COMMANDS = {"demo": "demo", "describe": "describe", "import-keras": "import_keras", "coverage": "coverage",
            "inspect": "inspect", "generate": "generate", "compress": "compress", "fuzz": "fuzz", "repair": "repair",
            "robustness": "robustness",
            "gate": "gate", "pipeline": "pipeline", "serve": "serve", "close-runs": "close_runs"}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when that subcommand is needed."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def resolve_command(self, ctx, args):
        # click drops the subcommand's arguments from ctx before the group callback runs; keep them
        ctx.meta["mlflow_di.args"] = list(args)
        return super().resolve_command(ctx, args)

    def get_command(self, ctx, name):
        module = COMMANDS.get(name)
        if module is None:
            return None
        return importlib.import_module(f"mlflow_di.commands.{module}").command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlflow-di")
@click.option("--tracking-uri", envvar="MLFLOW_TRACKING_URI", default=None,
              help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here).")
@click.option("--tracking-timeout", envvar="MLFLOW_DI_TRACKING_TIMEOUT", type=FiniteFloat(1, 3600), default=30.0,
              show_default=True, help="Seconds a tracking server may take to prove it answers before any work "
                                      "($MLFLOW_DI_TRACKING_TIMEOUT).")
@click.pass_context
def cli(ctx: click.Context, tracking_uri: str | None, tracking_timeout: float) -> None:
    """Coverage (IDC) and differential fuzzing (DFlare) for image classifiers in MLflow."""
    from mlflow_di.mlflow_edge import connection

    rest = ctx.meta.get("mlflow_di.args", [])  # the subcommand and its arguments
    if any(arg in ("-h", "--help") for arg in rest):
        return
    _quiet_library_logs()
    connection.bound_http_retries()
    connection.use_tracking_uri(tracking_uri)
    if os.environ.get("MLFLOW_EXPERIMENT_NAME") is not None:
        from mlflow_di.mlflow_edge.runs import check_experiment_name

        check_experiment_name(os.environ["MLFLOW_EXPERIMENT_NAME"])
    if tracking_uri and _needs_store(ctx.invoked_subcommand, rest):
        connection.check_reachable(tracking_uri, tracking_timeout)


def _needs_store(command: str | None, args: list[str]) -> bool:
    if command == "describe":  # the only command that can work without the store
        from mlflow_di.models.reference import MLFLOW_PREFIXES

        return any(arg.startswith(MLFLOW_PREFIXES) for arg in args)
    return True


class _DropPickleAdvice(logging.Filter):
    """mlflow-di logs PyTorch models as pickles on purpose (white-box analysis needs the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Pickle or CloudPickle" not in record.getMessage()


def _quiet_library_logs() -> None:
    """Keep MLflow's INFO chatter (database set-up, 'Successfully registered model') off the terminal."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is imported (later, lazily)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # it logs every SQL error with a traceback before raising it; the command's own line reports it
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    logging.getLogger("mlflow.pytorch").addFilter(_DropPickleAdvice())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # LiteRT's "Created TensorFlow Lite ... delegate" INFO
    # a progress bar per artifact download (repair reads 60 campaign files: 60 bars); the commands say what they read
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def _on_sigterm(signum, frame):
    note_sigterm()
    raise Terminated()


def _error(message: str) -> None:
    from mlflow_di.printable import printable

    click.echo(f"mlflow-di: error: {printable(message)}", err=True)  # one line, whatever names it holds


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: run the CLI and turn every failure that is the user's into one line."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # users turn it on by setting it to false
    import warnings

    # NumPy's "invalid value encountered in ..." is no message for a user: a model that answers NaN or Inf is
    # one line naming it (models.classifier.check_finite), and the console keeps to its own lines
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"numpy\..*")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        code = _run(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code not in (0, 1) and os.environ.get("MLFLOW_RUN_ID"):  # failed before its run started
        from mlflow_di.mlflow_edge.runs import end_project_run

        end_project_run("KILLED" if code in (130, 143) else "FAILED")
    return code


def _run(argv: list[str] | None) -> int:
    try:
        from mlflow_di.extensions import load_extensions

        load_extensions()  # before any command module reads its declarations (its options, --help)
        # without standalone mode click returns ctx.exit()'s code (e.g. the gate's 1) or the command's value
        result = cli.main(args=argv, prog_name="mlflow-di", standalone_mode=False)
    except click.exceptions.Exit as stop:
        return stop.exit_code
    except click.ClickException as exc:  # usage errors: one line, with where to read more
        command = exc.ctx.command_path if getattr(exc, "ctx", None) else "mlflow-di"
        _error(f"{exc.format_message()} (see `{command} --help`)")
        return 2
    except UserError as exc:
        _error(str(exc).strip() or "bad input")  # a name's newline is shown, not obeyed: the line stays whole
        return getattr(exc, "exit_code", 2)  # 2, or a subclass's own (75: busy, try again later)
    except (KeyboardInterrupt, click.Abort):
        if received_sigterm():  # also when work swallowed the Terminated and re-raised a plain interrupt
            _error("terminated (SIGTERM); finished work is kept")
            return 143
        _error("interrupted; finished work is kept")
        return 130
    except Exception as exc:  # noqa: BLE001 - a write the machine refused, or MLflow's errors about the user's input
        from mlflow_di.mlflow_edge.connection import mlflow_error_line

        line = write_error_line(exc) or mlflow_error_line(exc)
        if line is None:
            raise
        _error(line)
        return 2
    return result if isinstance(result, int) else 0


#: OS errors that mean "this place cannot take the output", not a bug: the machine's state, fixed by the user.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
#: How SQLite (under SQLAlchemy, under MLflow) says the tracking store cannot take a write.
_STORE_FULL = ("database or disk is full", "attempt to write a readonly database", "disk I/O error")
#: ... and that it cannot even open the store's file (a read-only folder or mount, a missing folder).
_STORE_UNOPENED = "unable to open database file"


def write_error_line(exc: BaseException) -> str | None:
    """The one line for a write the machine refused (disk full, permissions, read-only mount or
    store); None for any other error. The run that was writing has already ended FAILED and its
    finished work is kept, so the line says where to make room and to resume."""
    if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
        where = f"'{exc.filename}'" if exc.filename else "the output"
        return (f"cannot write {where}: {exc.strerror or exc}; free space or fix the permissions (or pick another "
                "location) and run again; finished work is kept")
    text = str(exc)
    if _STORE_UNOPENED in text:
        from mlflow_di.mlflow_edge.connection import tracking_uri

        return (f"cannot open the tracking store {tracking_uri()} (SQLite: {_STORE_UNOPENED}); its folder must exist "
                "and be writable: pick another --tracking-uri or fix the folder's permissions")
    reason = next((phrase for phrase in _STORE_FULL if phrase in text), None)
    if reason:
        return (f"the tracking store cannot take a write ({reason}); free space on its disk or fix its permissions "
                "and run again; finished work is kept")
    return None


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
