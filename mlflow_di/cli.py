"""The ``mlflow-di`` command line: parse, call the engines, log, exit.

Exit codes: 0 success, 1 a quality gate failed, 2 bad input (one line on stderr, no
traceback), 130 interrupted. Each subcommand lives in :mod:`mlflow_di.commands`.
"""
from __future__ import annotations

import logging
import sys

import click

from mlflow_di import __version__
from mlflow_di.errors import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlflow-di")
@click.option("--tracking-uri", envvar="MLFLOW_TRACKING_URI", default=None,
              help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here).")
def cli(tracking_uri: str | None) -> None:
    """Coverage (IDC) and differential fuzzing (DFlare) for image classifiers in MLflow."""
    _quiet_mlflow_logs()
    if tracking_uri:
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)


class _DropPickleAdvice(logging.Filter):
    """mlflow-di logs PyTorch models as pickles on purpose (white-box analysis needs the module)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Pickle or CloudPickle" not in record.getMessage()


def _quiet_mlflow_logs() -> None:
    """Keep MLflow's INFO chatter (database set-up, experiment creation) off the terminal."""
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("mlflow.pytorch").addFilter(_DropPickleAdvice())


def _register_commands() -> None:
    from mlflow_di.commands import compress, coverage, demo, describe, fuzz, gate, import_keras

    for module in (demo, describe, import_keras, coverage, compress, fuzz, gate):
        cli.add_command(module.command)


_register_commands()


def main(argv: list[str] | None = None) -> int:
    """Console-script entry: run the CLI and turn bad input into one line and exit code 2."""
    from mlflow.exceptions import MlflowException

    try:
        # without standalone mode click returns ctx.exit()'s code (e.g. the gate's 1) or the command's value
        result = cli.main(args=argv, prog_name="mlflow-di", standalone_mode=False)
    except click.exceptions.Exit as stop:
        return stop.exit_code
    except click.ClickException as exc:  # usage errors: click prints usage and the problem
        exc.show()
        return 2
    except (UserError, MlflowException) as exc:
        message = exc.message if isinstance(exc, MlflowException) else str(exc)
        click.echo(f"mlflow-di: error: {message.strip().splitlines()[0]}", err=True)
        return 2
    except (KeyboardInterrupt, click.Abort):
        click.echo("mlflow-di: interrupted", err=True)
        return 130
    return result if isinstance(result, int) else 0


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
