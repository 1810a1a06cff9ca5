"""Installed extensions: packages that declare their own strategies, compression methods, criteria, gate
checks, model formats, runtimes or data sources, and have the command line know them.

An extension is a module named by an entry point of the group :data:`GROUP` in its package's metadata
(``[options.entry_points] mlflow_di.extensions = toy = my_package.mlflow_di_plugin``). Importing it
registers its declarations (``mlflow_di.fuzz.register``, ``register_method``, ``register_criterion``,
``register_check``, ``register_format``, ``register_runtime``, ``mlflow_di.data.register_source``); the
command line imports every installed one before it reads
any option, so their names appear in ``--help`` and the policy. Nothing is loaded that a person did
not install.
"""
from __future__ import annotations

import importlib.metadata

from mlflow_di.errors import UserError

#: the entry-point group an extension's module is named in
GROUP = "mlflow_di.extensions"

_loaded: list[str] | None = None  # the entry-point names imported, once per process (None: not yet)


def load_extensions() -> list[str]:
    """Import every installed extension once per process; their entry-point names. One that fails to
    import is a one-line UserError naming it and its package (a broken extension must not look like a
    missing strategy later)."""
    global _loaded
    if _loaded is not None:  # scanned already, even when nothing is installed: the scan reads every dist-info
        return list(_loaded)
    names = []
    for point in importlib.metadata.entry_points(group=GROUP):
        try:
            point.load()
        except Exception as exc:  # noqa: BLE001 - whatever the extension's import raised, said in one line
            package = point.dist.name if point.dist is not None else "its package"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"the mlflow-di extension '{point.name}' ({point.value}, from {package}) failed to "
                            f"load: {first}; fix or uninstall {package}") from None
        names.append(point.name)
    _loaded = names
    return list(names)
