"""A package's public names imported when first used: ``__getattr__ = lazy_names(__name__, {name: module})``.

What a package's ``__init__`` exports often lives in modules that import torch or the engines; reading
one light name (a declaration, a registry) must not import them all, so ``--help`` answers at once.
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable


def lazy_names(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``exports[name]`` is the module holding ``name`` (absolute, or
    relative to ``package`` without a dot); the value is kept on the package after its first use."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module '{package}' has no attribute {name!r}")
        module = exports[name] if "." in exports[name] else f"{package}.{exports[name]}"
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
