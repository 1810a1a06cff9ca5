"""The torchvision guard: torchvision must import on CPU torch, and the guard must stay out of
the way where torchvision's own extension loads."""
import subprocess
import sys

import pytest

from mlflow_di import _compat


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_torchvision_imports_and_works_after_mlflow_di():
    result = _python(
        "import mlflow_di, torch, torchvision\n"
        "from torchvision.models import resnet18\n"
        "from torchvision.utils import make_grid\n"
        "import torchvision.datasets.mnist as mnist\n"
        "import zennit.composites\n"
        "out = resnet18(num_classes=3).eval()(torch.zeros(1, 3, 32, 32))\n"
        "grid = make_grid(torch.zeros(4, 1, 8, 8), nrow=2)  # 2x2 tiles of 8 px, 2 px padding: 22 px\n"
        "print(tuple(out.shape), tuple(grid.shape), callable(mnist.read_image_file))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(1, 3) (3, 22, 22) True"


def test_guard_is_needed_exactly_when_the_native_extension_fails():
    plain = _python("import torchvision")
    guarded = _python("import mlflow_di._compat as c; c.ensure_torchvision(); import torchvision; print(c.FALLBACK_ACTIVE)")
    assert guarded.returncode == 0, guarded.stderr
    if plain.returncode == 0:  # torchvision matches torch here: the guard must not have stepped in
        assert guarded.stdout.strip() == "False"
    else:
        assert "torchvision::nms does not exist" in plain.stderr
        assert guarded.stdout.strip() == "True"


def test_guard_does_nothing_when_the_extension_loads(monkeypatch):
    monkeypatch.setattr(_compat, "FALLBACK_ACTIVE", False)
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # keep the import guard for later tests
    monkeypatch.setattr(_compat, "_native_extension_loads", lambda: True)
    declared = []
    monkeypatch.setattr(_compat, "_declare_operator_schemas", lambda: declared.append(True))
    _compat.ensure_torchvision()
    assert declared == []


def test_guard_does_nothing_once_torchvision_is_imported(monkeypatch):
    pytest.importorskip("torchvision")
    monkeypatch.setattr(_compat, "FALLBACK_ACTIVE", False)
    monkeypatch.setattr(_compat, "_native_extension_loads", lambda: pytest.fail("must not probe again"))
    _compat.ensure_torchvision()
