"""An installed extension (an entry point of the group mlflow_di.extensions) is imported before the command
line reads its options: its declarations show in --help and run; a broken one is one line naming it."""
import re
import subprocess
import sys
import textwrap

import pytest

PLUGIN = """
from mlflow_di.fuzz import Declaration, register


def _make():
    from mlflow_di.fuzz.dflare import DFlare

    return DFlare(name="plugin-dflare")


register(Declaration("plugin-dflare", "DFlare, declared by an installed extension", _make, "lockstep"))
"""


def _install(folder, module: str, source: str) -> str:
    """A package on ``folder`` with its dist-info naming ``module`` as an mlflow_di extension."""
    (folder / f"{module}.py").write_text(source)
    info = folder / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[mlflow_di.extensions]\ntoy = {module}\n")
    return str(folder)


def _cli(path: str, *args: str) -> subprocess.CompletedProcess:
    code = f"import sys; from mlflow_di.cli import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": path})


def test_an_installed_extensions_strategy_is_in_the_help(tmp_path):
    result = _cli(_install(tmp_path, "toy_extension", PLUGIN), "fuzz", "--help")
    assert result.returncode == 0, result.stderr
    text = re.sub(r"-\s+", "-", " ".join(result.stdout.split()))  # help wraps lines at hyphens
    assert "plugin-dflare (DFlare, declared by an installed extension)" in text


@pytest.mark.parametrize("source", ["raise ImportError('needs libfoo')", "import not_installed_anywhere"])
def test_a_broken_extension_is_one_line(tmp_path, source):
    result = _cli(_install(tmp_path, "broken_extension", textwrap.dedent(source)), "describe", "x.onnx")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "extension 'toy' (broken_extension, from broken_extension) failed to load" in result.stderr


SOURCE_PLUGIN = """
import numpy as np

from mlflow_di.data import DataSource, register_source

register_source(DataSource("ones", "four white 2x2 images", lambda _: (np.ones((4, 2, 2)), [0, 1, 2, 3]), argument=None))
"""


def test_a_process_the_command_line_did_not_start_finds_an_installed_source(tmp_path):
    """A Ray worker or a Python caller reads a spec without the command line: the unknown name makes
    load_images import the installed extensions once."""
    code = "from mlflow_di.data import load_images; data = load_images('ones[1:3]'); print(data.images.max(), len(data))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "PYTHONPATH": _install(tmp_path, "source_extension",
                                                                                    SOURCE_PLUGIN)})
    assert result.returncode == 0 and result.stdout.split() == ["255", "2"], result.stderr
