"""Make ``import torchvision`` work with a CPU-only torch whose torchvision wheel was built for CUDA.

Why: on machines where torch is the CPU build but torchvision comes from PyPI (a CUDA build),
torchvision's compiled extension ``_C`` fails to load. torchvision copes with that for most of
its operators (it skips them), but registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` unconditionally, so ``import torchvision`` dies with
``operator torchvision::nms does not exist``. zennit imports torchvision too, so the whole
white-box side would be unusable.

What: :func:`ensure_torchvision` runs before the first torchvision import: ``mlflow_di/__init__``
installs :class:`_TorchvisionGuard`, an import hook that calls it when something first imports
torchvision (so importing mlflow_di itself stays cheap: no torch until it is needed). If torchvision's extension loads,
it does nothing more: torchvision works as shipped.
If the extension cannot load, it declares those two operator schemas (no kernels), so the import
succeeds and torchvision's pure-Python parts (models, datasets, transforms, utils) work. The
compiled ops themselves (nms, roi_align, ...) stay unavailable and raise torchvision's own
"Couldn't load custom C++ ops" error if called; mlflow-di never calls them.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

#: Operators torchvision registers fake kernels for at import time, whatever its extension did.
_UNCONDITIONAL_OPS = ("nms", "qnms")

#: True once :func:`ensure_torchvision` had to declare the operators itself.
FALLBACK_ACTIVE = False
_library = None  # keeps the torch.library.Library alive: dropping it would unregister the schemas


def _native_extension_loads() -> bool | None:
    """Load torchvision's own ``_C`` extension as torchvision would. None: torchvision not installed."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    package_dir = pathlib.Path(list(spec.submodule_search_locations)[0])
    import torch

    for candidate in sorted(package_dir.glob("_C*.so")) + sorted(package_dir.glob("_C*.pyd")):
        try:
            torch.ops.load_library(str(candidate))
            return True
        except (OSError, RuntimeError):
            return False
    return False


def _declare_operator_schemas() -> None:
    global _library, FALLBACK_ACTIVE
    import torch

    _library = torch.library.Library("torchvision", "DEF")
    for name in _UNCONDITIONAL_OPS:
        _library.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    FALLBACK_ACTIVE = True


def ensure_torchvision() -> None:
    """Make the next ``import torchvision`` succeed on CPU torch; a no-op where it already would.

    Safe to call many times. Does nothing if torchvision is already imported, not installed,
    or its compiled extension loads.
    """
    if FALLBACK_ACTIVE or "torchvision" in sys.modules:
        return
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchvisionGuard)]  # no re-entry
    # importing torch (inside the probe) may itself look torchvision up: check again before declaring
    if _native_extension_loads() is False and not FALLBACK_ACTIVE:
        _declare_operator_schemas()


class _TorchvisionGuard:
    """A ``sys.meta_path`` finder that runs :func:`ensure_torchvision` just before torchvision's
    first import, then steps aside (it finds nothing itself)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            ensure_torchvision()  # removes this finder first
        return None


def install_torchvision_guard() -> None:
    """Arrange for :func:`ensure_torchvision` to run before torchvision is first imported."""
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(finder, _TorchvisionGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionGuard())
