"""Shared fixtures. Tests that need ../shared (reference models, MNIST) use ``shared_dir``,
which skips with a reason when it is absent (a user's fresh clone has no ../shared)."""
import os
import pathlib

# `import mlflow` would otherwise report telemetry to an outside host; tests talk to 127.0.0.1 only
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _shared_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MLFLOW_DI_SHARED", REPO.parent / "shared")).resolve()


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    """The reference data folder (``$MLFLOW_DI_SHARED`` or ../shared); skips the test if absent."""
    path = _shared_path()
    if not (path / "models").is_dir() or not (path / "data" / "mnist").is_dir():
        pytest.skip(f"reference data not found at {path} (set MLFLOW_DI_SHARED or place shared/ beside the repo)")
    return path


@pytest.fixture(scope="session")
def mnist_spec(shared_dir) -> str:
    """Data spec of the real MNIST test split in ../shared."""
    return f"mnist:{shared_dir / 'data' / 'mnist'}"


@pytest.fixture()
def tracking_uri(tmp_path, monkeypatch) -> str:
    """A fresh, empty local MLflow tracking store for one test (sqlite in tmp_path)."""
    import mlflow

    import mlflow.tracking.fluent as fluent

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(uri)
    fluent._active_experiment_id = None  # MLflow caches the experiment of the previous store
    yield uri
    while mlflow.active_run():
        mlflow.end_run()
    fluent._active_experiment_id = None
    mlflow.set_tracking_uri(None)


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
