"""One constraints table for a declared thing's own settings: :class:`OptionSpec`.

A strategy's own options (DeepXplore's ``--dx-*``), and every coverage criterion's settings (built-in or registered), are
each declared once as an :class:`OptionSpec`: the command line builds its option from it
(``commands/options.py: declared_option``), and the engine checks a value given in Python with
:meth:`OptionSpec.check`, so the range a user meets is the same on either side and a refusal is always one
:class:`~mlflow_di.errors.UserError` line.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from mlflow_di.errors import UserError


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One setting: the object's ``field``, on the command line ``--PREFIX-FIELD`` (underscores as dashes).
    ``kind`` says what it takes, in click's spirit: ``float`` (finite, within ``low``/``high``, ``open``
    ends excluded), ``int`` (a whole number within ``low``/``high``), ``choice`` (one of ``choices``),
    ``flag`` (on or off; ``--PREFIX-FIELD/--PREFIX-no-FIELD``), ``floats`` (positive numbers; on the
    command line comma-separated, e.g. ``example``) or ``pair`` (two whole numbers of at least ``low``,
    e.g. ``example``). ``what`` names the value in messages."""

    field: str
    help: str
    kind: str
    low: float | None = None
    high: float | None = None
    open: tuple[bool, bool] = (False, False)
    choices: tuple[str, ...] = ()
    what: str = ""
    example: str = ""
    metavar: str | None = None
    #: the value when none is given, for settings held by name (a criterion's); a strategy's defaults are
    #: its dataclass fields'
    default: object = None

    def check(self, value, owner: str):
        """``value`` as this setting holds it (a bool, an int, a float, a tuple of floats, a pair of ints), or
        a one-line UserError naming ``owner``'s setting and what it takes."""
        name = f"{owner}'s {self.field}"
        if self.kind == "flag":
            if not isinstance(value, bool) and type(value).__name__ not in ("bool_", "bool"):
                raise UserError(f"{name} is on or off (True or False), got {value!r}")
            return bool(value)
        if self.kind == "choice":
            if value not in self.choices:
                raise UserError(f"{name} {value!r} is not one of: {', '.join(self.choices)}")
            return value
        if self.kind == "floats":
            values = _items(value)
            if not all(_number(v) and float(v) > 0 for v in values):
                raise UserError(f"each {self.what or 'value'} of {name} must be a positive number, got "
                                f"{', '.join(str(v) for v in values)}")
            return tuple(float(v) for v in values)
        if self.kind == "pair":
            values = _items(value)
            least = int(self.low or 0)
            if len(values) != 2 or not all(_whole(v) and int(v) >= least for v in values):
                raise UserError(f"the {self.what or name} is two whole numbers of at least {least} (rows, columns), "
                                f"got {value}")
            return int(values[0]), int(values[1])
        if self.kind in ("int", "float"):
            return self._in_range(value, name)
        raise UserError(f"{name} is declared with an unknown kind {self.kind!r}")

    def parse(self, text: str, owner: str):
        """The value a command line's ``text`` gives this setting (checked, see :meth:`check`)."""
        text = text.strip()
        try:
            if self.kind == "flag":
                words = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False,
                         "0": False}
                value = words[text.lower()]
            elif self.kind == "int":
                value = int(text)
            elif self.kind == "float":
                value = float(text)
            elif self.kind == "floats":
                value = tuple(float(part) for part in text.split(",") if part.strip())
            elif self.kind == "pair":
                value = tuple(int(part) for part in text.split(","))
            else:
                value = text
        except (KeyError, ValueError):
            raise UserError(f"{owner}'s {self.field} takes {self._takes()}, got {text!r}") from None
        return self.check(value, owner)

    def _takes(self) -> str:
        return {"flag": "true or false", "int": f"a whole number{self.range_text()}",
                "float": f"a number{self.range_text()}", "floats": "positive numbers separated by commas",
                "pair": "two whole numbers separated by a comma", "choice": " or ".join(self.choices)}.get(self.kind, "a value")

    def _in_range(self, value, name: str):
        whole = self.kind == "int"
        if not (_whole(value) if whole else _number(value)):
            raise UserError(f"{name} must be a {'whole' if whole else 'finite'} number{self.range_text()}, got {value!r}")
        number = int(value) if whole else float(value)
        low_open, high_open = self.open
        if self.low is not None and (number < self.low or (low_open and number == self.low)) or \
                self.high is not None and (number > self.high or (high_open and number == self.high)):
            raise UserError(f"{name} must be{self.range_text()}, got {value!r}")
        return number

    def range_text(self) -> str:
        """`` in (0, 1]``-style text of the range (empty without bounds)."""
        if self.low is None and self.high is None:
            return ""
        if self.high is None:
            return f" {'above' if self.open[0] else 'at least'} {self.low:g}"
        if self.low is None:
            return f" {'below' if self.open[1] else 'at most'} {self.high:g}"
        return f" in {'(' if self.open[0] else '['}{self.low:g}, {self.high:g}{')' if self.open[1] else ']'}"


def _number(value) -> bool:
    """A finite real number, Python's or NumPy's (not a bool, not a string)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def _whole(value) -> bool:
    return _number(value) and float(value) == int(value)


def _items(value) -> tuple:
    """A list, tuple or array as a tuple of its items; anything else as a 1-tuple."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    tolist = getattr(type(value), "tolist", None)  # a NumPy array or scalar
    items = value.tolist() if tolist is not None else value
    return tuple(items) if isinstance(items, list) else (items,)
