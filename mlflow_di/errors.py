"""The one exception type for bad input.

A :class:`UserError` carries a single line that says what is wrong and how to fix it. The CLI
prints it without a traceback and exits with code 2; Python callers can catch it.
"""


class UserError(Exception):
    """Bad input from the user (a spec, a URI, a file, a shape): one line, what and how to fix."""
