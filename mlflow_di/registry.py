"""Named declarations of one kind (fuzzing strategies, compression methods, coverage criteria, gate checks,
relative checks, model formats, runtimes, data sources): one small registry.

A :class:`Registry` is a live mapping from a declaration's ``name`` (or the attribute ``key`` names, e.g. a
gate check's ``metric``) to the declaration, in declaration order, so whatever reads
the names (an option's choices, a help text, a policy's check) sees a registration at once. Registering
checks the declaration's type; :meth:`Registry.require` is the one-line refusal of an unknown name.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from mlflow_di.errors import UserError


class Registry(Mapping):
    """``{name: declaration}`` of ``what`` (e.g. "compression method"), declared as ``kind`` objects, each
    under its attribute ``key``. ``builtins``: declarations that cannot be unregistered."""

    def __init__(self, what: str, kind: type, key: str = "name", builtins=()):
        self.what, self.kind, self.key = what, kind, key
        self._entries: dict = {}
        self.builtins: tuple = ()
        for declaration in builtins:
            self.register(declaration)
        self.builtins = tuple(self._entries)

    def __getitem__(self, name: str):
        return self._entries[name]

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def register(self, declaration):
        """Add (or replace, in its place) ``declaration`` under its key; returns it."""
        if not isinstance(declaration, self.kind):
            raise UserError(f"a {self.what} is declared with a {self.kind.__name__}, got {type(declaration).__name__}")
        self._entries[getattr(declaration, self.key)] = declaration
        return declaration

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests declare toy ones); nothing when it is not declared or is built in."""
        if name not in self.builtins:
            self._entries.pop(name, None)

    def require(self, name: str, advice: str = "choose one of"):
        """The declaration called ``name``, or a one-line UserError listing the declared names."""
        if name not in self._entries:
            raise UserError(f"unknown {self.what} '{name}'; {advice}: {', '.join(self._entries)}")
        return self._entries[name]

    def view(self, value: Callable) -> Mapping:
        """A live ``{name: value(declaration)}`` over this registry (e.g. each strategy's factory)."""
        return _View(self, value)


class _View(Mapping):
    def __init__(self, registry: Registry, value: Callable):
        self._registry, self._value = registry, value

    def __getitem__(self, name: str):
        return self._value(self._registry[name])

    def __iter__(self):
        return iter(self._registry)

    def __len__(self) -> int:
        return len(self._registry)
