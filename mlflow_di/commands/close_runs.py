"""``mlflow-di close-runs``: end the runs an earlier command could not end, because its tracking store was failing.

Such a command keeps what it could not log under ``mlflow-di-unlogged/RUN_ID/`` with the status its run
must still be ended with; every command that reaches the store ends those runs first, and this one does
only that (run it in the folder the failed command ran in).
"""
from __future__ import annotations

import click


@click.command("close-runs")
def command() -> None:
    """End the runs an earlier command left RUNNING because the tracking store refused to end them."""
    from mlflow_di.mlflow_edge.run_log import UNLOGGED, close_pending_runs

    ended = close_pending_runs()
    for run_id in ended:
        click.echo(f"ended run {run_id}")
    left = sorted(path.parent.name for path in UNLOGGED.glob("*/end.json")) if UNLOGGED.is_dir() else []
    if left:
        click.echo(f"{len(left)} run(s) still to end (another tracking store, or it still refuses): {', '.join(left)}")
    elif not ended:
        click.echo(f"no run left to end (nothing pending under {UNLOGGED}/)")
