"""``mlflow-di compress``'s options that the compression methods' declarations hold: each method's own options as
click options (``--recipe``, a registered method's ``--FIELD``), the ``--help`` headings they and the selective
methods' options stand under, and the settings each chosen method is configured with from their values.

Read when the command's options are (:class:`~mlflow_di.commands.options.DeclaredOptionsCommand`), from the light
declarations (:mod:`mlflow_di.compression.declarations`), so a method registered later brings its options and
``--help`` imports no torch. Names no method: the declarations say which options are whose.
"""
from __future__ import annotations

import click

from mlflow_di.commands.options import declared_option, option_of
from mlflow_di.compression.declarations import METHODS, method_declaration, method_options, methods_that
from mlflow_di.errors import UserError

#: the options of the methods that keep layers in float (``selective`` in their declarations)
SELECTIVE_OPTIONS = ("keep_float", "auto_keep_float", "triggers", "diagnosis_images", "max_accuracy_drop",
                     "max_disagreement_rate", "max_realistic_success_rate", "fuzz_seeds", "holdout_data", "sensitivity")


def help_sections():
    """``--help``'s option groups: the selective methods' options, then each declared method's own."""
    selective = [("Options of the methods that keep layers in float "
                  f"({', '.join(methods_that('selective'))})", lambda param: param.name in SELECTIVE_OPTIONS)]
    return selective + [(f"{name} options", lambda param, fields={spec.field for spec in declared.options}:
                         param.name in fields) for name, declared in METHODS.items() if declared.options]


def method_click_options() -> list:
    """Every declared method's own options, as click options with their declared defaults (live: a method
    registered later brings its options)."""
    return [option_of(declared_option(None, spec)) for _, spec in method_options().values()]


def method_settings(methods, values: dict) -> dict:
    """``{method: its settings object}`` of the chosen methods, from their own options' values; a one-line
    UserError for an option set on the command line, to other than its default, whose method is not among them
    (an ``mlflow run`` entry point passes every option's default whatever the methods)."""
    ctx = click.get_current_context(silent=True)
    for field, (owner, spec) in method_options().items():
        given = ctx is not None and ctx.get_parameter_source(field) == click.core.ParameterSource.COMMANDLINE
        if given and owner not in methods and values.get(field) != spec.default:
            raise UserError(f"--{field.replace('_', '-')} is an option of {owner}; add it to --method (got "
                            f"{','.join(methods)})")
    return {method: method_declaration(method).configure(
        {spec.field: values.get(spec.field) for spec in method_declaration(method).options}) for method in methods}
