"""The exception types the command line turns into exit codes.

A :class:`UserError` carries a single line that says what is wrong and how to fix it. The CLI
prints it without a traceback and exits with code 2; Python callers can catch it.
:class:`Terminated` is SIGTERM made into a ``KeyboardInterrupt``, so every place that keeps
finished work on Ctrl-C does the same when ``timeout``, CI or Kubernetes stops the process.
"""


class UserError(Exception):
    """Bad input from the user (a spec, a URI, a file, a shape): one line, what and how to fix."""


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM: stop like Ctrl-C (finished work kept, run KILLED), exit 143."""


_sigterm = False


def note_sigterm() -> None:
    """Record that SIGTERM arrived (work that swallows the interrupt can still report it as such)."""
    global _sigterm
    _sigterm = True


def received_sigterm() -> bool:
    return _sigterm
