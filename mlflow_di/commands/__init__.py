"""One module per ``mlflow-di`` subcommand; each defines ``command`` (a click command)."""
