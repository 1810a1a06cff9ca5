"""Reading a pt2 (``torch.export``) archive without running code from it.

A pt2 archive is mostly raw tensor bytes and JSON, but ``torch.export.load`` unpickles some
members: sample inputs and legacy state dicts (trying a weights-only load first and, when that
fails, loading the member unrestricted), weights and constants the archive marks ``use_pickle``
(unrestricted at once), and opaque constants (``pickle.loads``). A member crafted to fail the
weights-only load therefore runs its code, though nothing about the file looks like a pickle.

:func:`weights_only_loading` closes both doors for the calling thread while it is active:

* every ``torch.load`` is forced to ``weights_only=True`` (PyTorch's restricted unpickler, which
  builds tensors and plain containers and refuses any other global), and
* any other unpickling that looks up a global (``pickle.loads``, ``torch.load(weights_only=False)``
  reached some other way) is stopped by an audit hook on ``pickle.find_class``, the event every
  unrestricted unpickler raises before it imports anything.

What was refused is a :class:`CodeInArchive`. A plain archive (what ``mlflow.pytorch.log_model``
and ``torch.export.save`` write) loads exactly as before: its pickled members are tensors.
TorchScript objects (``torch._C._pickle_load_obj``) are built by TorchScript's own unpickler,
which creates only registered C++ classes and calls no Python code; they are not affected.
"""
from __future__ import annotations

import contextlib
import re
import sys
import threading

__all__ = ["CodeInArchive", "weights_only_loading"]


class CodeInArchive(Exception):
    """An archive member needs more than a weights-only load: unpickling it could run its code."""


_state = threading.local()  # .active: this thread is inside weights_only_loading; .refused: what was stopped
_patch_lock = threading.Lock()
_patched_depth = 0
_hook_installed = False


def _audit(event: str, args) -> None:
    if event == "pickle.find_class" and getattr(_state, "active", False):
        module, name = args[0], args[1]
        _state.refused = f"a pickle that imports {module}.{name}"
        raise CodeInArchive(_state.refused)


def _forced_weights_only(load):
    def torch_load(*args, **kwargs):
        if not getattr(_state, "active", False):
            return load(*args, **kwargs)
        kwargs["weights_only"] = True
        kwargs.pop("pickle_module", None)
        try:
            return load(*args, **kwargs)
        except CodeInArchive:
            raise
        except Exception as exc:  # noqa: BLE001 - torch's weights-only refusal is an UnpicklingError or RuntimeError
            _state.refused = _refusal_line(exc)
            raise CodeInArchive(_state.refused) from None

    torch_load.__wrapped__ = load
    return torch_load


def _refusal_line(exc: BaseException) -> str:
    """What torch's weights-only refusal refused, in a few words (its message is a dozen lines of advice)."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return f"a pickle that imports {found.group(1)}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else type(exc).__name__)
    return f"a pickle a weights-only load refuses: {detail.removeprefix('WeightsUnpickler error: ')[:160]}"


@contextlib.contextmanager
def weights_only_loading():
    """Within this block the calling thread unpickles weights only; anything more raises :class:`CodeInArchive`.

    Other threads are not restricted (their ``torch.load`` is passed through unchanged), and the
    block may nest. A member torch refused and then retried is still reported: the refusal is
    remembered for the block even when torch catches the exception.
    """
    global _patched_depth, _hook_installed
    import torch

    with _patch_lock:
        if not _hook_installed:
            sys.addaudithook(_audit)  # an audit hook cannot be removed: it acts only inside this block's thread
            _hook_installed = True
        if _patched_depth == 0:
            torch.load = _forced_weights_only(torch.load)
        _patched_depth += 1
    outer = getattr(_state, "active", False), getattr(_state, "refused", None)
    _state.active, _state.refused = True, None
    try:
        yield
        if _state.refused:
            raise CodeInArchive(_state.refused)
    finally:
        _state.active, _state.refused = outer[0], outer[1] or _state.refused
        with _patch_lock:
            _patched_depth -= 1
            if _patched_depth == 0:
                torch.load = torch.load.__wrapped__
