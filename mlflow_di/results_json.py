"""One JSON round trip for every result dataclass: ``to_dict``/``from_dict``/``to_json``/``from_json``.

Writing (:func:`to_dict`) turns a dataclass, recursively, into what :func:`json.dumps` takes:
nested dataclasses become dicts, tuples become lists, numpy scalars and arrays become Python
numbers and lists, enums become their values, and the non-finite floats JSON lacks become the
strings ``"inf"``, ``"-inf"`` and ``"nan"``.

Reading (:func:`from_dict`) follows the class's type hints back: dicts become the annotated
dataclasses (also inside ``list[...]``, ``dict[str, ...]`` and ``X | None``), lists become
tuples where a tuple is annotated, values become the annotated enums, and the strings above
become floats where a float is annotated (JSON's ``Infinity`` read by :func:`json.loads` stays
accepted). Keys the class does not have are an error (a ``TypeError``, as the constructor
gives); fields left out take their defaults.

Classes get the four methods from :class:`JsonRoundTrip`; ``JSON_DUMPS`` holds the class's
:func:`json.dumps` options (indentation, key order) so the files keep their layout.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import types
import typing

import numpy as np

_NON_FINITE = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan,
               "Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def to_dict(obj) -> dict:
    """A dataclass instance as a JSON-ready dict (see the module docstring)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"to_dict takes a dataclass instance, got {type(obj).__name__}")
    return _plain(obj)


def _plain(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if isinstance(value, JsonRoundTrip):
            return value.to_dict()  # nested too: derived fields added, optional fields left out
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if math.isfinite(number):
            return number
        return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {_key(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    return value


def _key(key):
    if isinstance(key, enum.Enum):
        key = key.value
    return key.item() if isinstance(key, np.generic) else key


def from_dict(cls, values: dict):
    """An instance of dataclass ``cls`` from a dict as :func:`to_dict` writes it."""
    if not isinstance(values, dict):
        raise TypeError(f"{cls.__name__} is read from a JSON object, got {type(values).__name__}")
    hints = _hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(values) - fields
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(sorted(map(str, unknown)))}")
    return cls(**{name: _typed(hints.get(name, typing.Any), value) for name, value in values.items()})


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _typed(hint, value):
    """``value`` (from JSON) as the type ``hint`` describes, as far as JSON loses it."""
    if value is None or hint is typing.Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        for option in options:  # the first option the value fits
            try:
                return _typed(option, value)
            except (TypeError, ValueError):
                continue
        return value
    if origin is typing.ClassVar:
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint.from_dict(value) if issubclass(hint, JsonRoundTrip) else from_dict(hint, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is float:
        if isinstance(value, str):
            if value not in _NON_FINITE:
                raise ValueError(f"'{value}' is not a number")
            return _NON_FINITE[value]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {type(value).__name__}")
        return value
    args = typing.get_args(hint)
    if origin is tuple and isinstance(value, (list, tuple)):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v) for v in value)
        if args and len(args) == len(value):
            return tuple(_typed(a, v) for a, v in zip(args, value))
        return tuple(value)
    if origin is list and isinstance(value, list):
        return [_typed(args[0], v) for v in value] if args else list(value)
    if origin is dict and isinstance(value, dict):
        return {k: _typed(args[1], v) for k, v in value.items()} if args else dict(value)
    return value


def to_json(obj, **dumps) -> str:
    """:func:`to_dict` as JSON text; ``dumps`` goes to :func:`json.dumps` (e.g. ``indent=2``)."""
    return json.dumps(to_dict(obj), **dumps)


def from_json(cls, text: str):
    """An instance of ``cls`` from JSON text (see :func:`from_dict`)."""
    return from_dict(cls, json.loads(text))


class JsonRoundTrip:
    """Mixin for dataclasses: ``to_dict``/``from_dict``/``to_json``/``from_json`` through this module.

    ``JSON_DUMPS`` (a class attribute, not a field) holds the :func:`json.dumps` options of
    ``to_json``. ``JSON_OPTIONAL`` maps fields added after files were written to their default:
    such a field is written only when it differs from it, so files written before keep their
    bytes (reading fills the default in). A class that writes derived values (e.g. a property)
    overrides ``to_dict`` to add them and ``from_dict`` to drop them again.
    """

    JSON_DUMPS: typing.ClassVar[dict] = {}
    JSON_OPTIONAL: typing.ClassVar[dict] = {}

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in self.JSON_OPTIONAL or getattr(self, f.name) != self.JSON_OPTIONAL[f.name]}

    @classmethod
    def from_dict(cls, values: dict):
        return from_dict(cls, values)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), **self.JSON_DUMPS)

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))
