"""Shared fixtures. Tests that need ../shared (reference models, MNIST) use ``shared_dir``,
which skips with a reason when it is absent (a user's fresh clone has no ../shared)."""
import contextlib
import os
import pathlib

# `import mlflow` would otherwise report telemetry to an outside host; tests talk to 127.0.0.1 only
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _shared_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MLFLOW_DI_SHARED", REPO.parent / "shared")).resolve()


#: Files that take about a minute or more here (seconds per file in ``make test``, 2026-11-28, before the shared
#: stores and smaller campaigns of 2026-11-29: readme_walk 558, mlflow_native 305, mlproject 298, torchvision
#: 282, serve 187, rough_edges 184, disk_full 166, server_dies 166, compress_command 151, fuzz_command 140,
#: reproduce 134, coverage_ray 132, user_models 117, stoppable 102, fuzz_load 91, server 89, browser 88, ...):
#: collected first, so that with the two workers of ``make test`` (pytest-xdist, ``--dist loadfile``) neither
#: ends alone on a long file while the other idles. ``make test`` passes ``--no-loadscope-reorder``: by default
#: xdist sends the files with the most tests first, which put the one-test README walk and MLproject files last
#: (a 4-minute tail). Longest first (as they are now); only the order changes, never which tests run.
LONG_FILES = ("test_readme_walk.py", "test_mlproject.py", "test_torchvision_families.py", "test_mlflow_native.py",
              "test_serve.py", "test_server_dies.py", "test_reproduce.py", "test_user_models.py",
              "test_compress_command.py", "test_coverage_ray.py", "test_disk_full.py", "test_stoppable.py",
              "test_fuzz_command.py", "test_rough_edges.py", "test_server.py", "test_browser.py",
              "test_bad_input_battery.py", "test_version_lock.py", "test_pipeline.py", "test_fuzz_load.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: a file's tests keep their order


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


@pytest.fixture(autouse=True)
def no_leaked_mlflow_context():
    """mlflow.set_experiment() exports MLFLOW_EXPERIMENT_ID to os.environ; without this, later tests
    and the `mlflow run` subprocesses they start would inherit an experiment of another store."""
    yield
    for name in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def empty_store_file(tmp_path_factory) -> pathlib.Path:
    """An initialised, empty sqlite tracking store, created once per session and copied by
    :func:`tracking_uri` (creating a store runs MLflow's migrations: seconds each time)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.getbasetemp() / "mlflow-template" / "mlflow.db"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture()
def tracking_uri(empty_store_file, tmp_path, monkeypatch) -> str:
    """A fresh, empty sqlite tracking store in ``tmp_path`` (also the current folder and
    $MLFLOW_TRACKING_URI) for one test."""
    import shutil

    import mlflow
    import mlflow.tracking.fluent as fluent

    shutil.copy(empty_store_file, tmp_path / "mlflow.db")
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
def mlflow_client(tracking_uri):
    """The client of the fresh store of :func:`tracking_uri`."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri)


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


#: the weights of :func:`briefly_trained_cnn`, trained once per test process (xdist worker)
_TRAINED_CNN_STATE: dict = {}


def briefly_trained_cnn():
    """A fresh digits-cnn module (seed 0) trained briefly: 5 epochs on digits[0:600].

    Training is deterministic (seeded batches, no dropout, one thread: mlflow_di.models.training), so
    it runs once per test process and every later call gets a new module with a copy of those weights:
    the same model the fixtures trained each time before, without 4-5 s of training per test."""
    import torch

    from mlflow_di.models import zoo

    if not _TRAINED_CNN_STATE:
        from mlflow_di.data import load_images
        from mlflow_di.models.torch_model import TorchModel
        from mlflow_di.models.training import train_classifier

        model = TorchModel(zoo.build("digits-cnn", seed=0), zoo.architecture("digits-cnn").preprocessing, name="cnn")
        train = load_images("digits[0:600]")
        train_classifier(model.module, model.to_tensor(train.images), torch.from_numpy(train.labels), epochs=5,
                         progress=False)
        _TRAINED_CNN_STATE.update({k: v.detach().clone() for k, v in model.module.state_dict().items()})
    module = zoo.build("digits-cnn", seed=0)
    module.load_state_dict(_TRAINED_CNN_STATE)
    return module.eval()


@contextlib.contextmanager
def active_store(folder: pathlib.Path):
    """``folder``/mlflow.db as the tracking store (and ``folder`` as the current folder) for the block, as
    :func:`tracking_uri` makes a test's store: for fixtures that build a store once and let each test copy it
    (:func:`copy_store`). Whatever the test had set before (its own tracking_uri) is back afterwards."""
    import mlflow
    import mlflow.tracking.fluent as fluent

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
        patch.chdir(folder)
        mlflow.set_tracking_uri(uri)
        fluent._active_experiment_id = None
        try:
            yield uri
        finally:
            while mlflow.active_run():
                mlflow.end_run()
            fluent._active_experiment_id = None
            mlflow.set_tracking_uri(previous)
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)  # set_experiment exported it


def copy_store(template: pathlib.Path, folder: pathlib.Path) -> None:
    """Make ``folder``/mlflow.db (a test's store, not opened yet) a copy of the store file ``template``.
    Runs and models of the template keep their artifacts where the template's block wrote them (read
    only by the tests); new runs of an experiment the template created write theirs there too, each in
    its own run folder."""
    import shutil

    shutil.copy(template, folder / "mlflow.db")


@pytest.fixture(scope="session")
def registered_cnn_store(empty_store_file, tmp_path_factory) -> pathlib.Path:
    """A sqlite store in which :func:`briefly_trained_cnn` was logged in a "train" run and registered as
    models:/cnn/1, made once per test process: :func:`registered_cnn` copies it (logging the model,
    a torch.export of it, took seconds per test)."""
    from mlflow_di.mlflow_edge import models as edge_models, runs as tracking
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    folder = tmp_path_factory.mktemp("registered-cnn-store")
    copy_store(empty_store_file, folder)
    model = TorchModel(briefly_trained_cnn(), zoo.architecture("digits-cnn").preprocessing, name="cnn",
                       metadata={"arch": "digits-cnn"})
    with active_store(folder), tracking.tracked_run("train"):
        edge_models.log_torch_model(model, registered_model_name="cnn")
    return folder / "mlflow.db"


@pytest.fixture()
def registered_cnn(registered_cnn_store, tracking_uri, tmp_path):
    """digits-cnn trained briefly (:func:`briefly_trained_cnn`), logged in a "train" run and registered
    as models:/cnn/1 in the fresh store of :func:`tracking_uri` (a copy of :func:`registered_cnn_store`)."""
    copy_store(registered_cnn_store, tmp_path)  # nothing has opened the empty store yet
    return "models:/cnn/1"


@pytest.fixture(scope="module")
def one_torch_thread():
    """The machine's cores are shared: one thread avoids OpenMP spin contention (20x faster here).
    A module asks for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def python_ctrl_c():
    """Python's own SIGINT handler (KeyboardInterrupt in the main thread) for one test, whatever the
    worker had before. In two full runs of the suite the overlapped Ctrl-C test's campaign ran to
    completion through the SIGINT it sent itself, as it does when SIGINT is ignored beforehand. What
    had changed the handler was not found: a full run with a hook logging every test after which
    SIGINT's handler changed found none, and a worker starts with Python's handler whether the suite
    runs in the foreground or in the background."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session: 2 CPUs, bound to 127.0.0.1, no dashboard, no
    usage reports. Tests give workers fractional CPUs so two actors and the driver never deadlock."""
    import importlib.util

    from mlflow_di._ray import connect

    if importlib.util.find_spec("ray") is None:  # not imported here: connect sets Ray's environment first
        pytest.skip("ray is not installed (pip install 'mlflow-di[ray]')")
    ray, _ = connect("local", num_cpus=2)  # the product's own start: loopback, no dashboard, no usage reports
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def trained_cnns(one_torch_thread):
    """digits-cnn trained briefly (5 epochs on digits[0:600]), and two pruned copies of it (50%
    unstructured, 30% of the channels): versions of one model to fuzz against each other."""
    from mlflow_di.compression.prune import prune_l1, prune_structured
    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    spec = zoo.architecture("digits-cnn")
    original = TorchModel(briefly_trained_cnn(), spec.preprocessing, name="cnn")
    pruned = TorchModel(prune_l1(original.module, 0.5).module, spec.preprocessing, name="cnn-pruned")
    channels = TorchModel(prune_structured(original.module, 0.3).module, spec.preprocessing, name="cnn-channels")
    return original, pruned, channels


@pytest.fixture(scope="session")
def untrained_cnn_files(tmp_path_factory) -> pathlib.Path:
    """A folder with two small untrained digits CNNs that disagree on many digits, saved as ``m0.pt`` and ``m1.pt``."""
    import torch

    from mlflow_di.models import zoo
    from mlflow_di.models.torch_model import TorchModel

    folder = tmp_path_factory.mktemp("untrained-cnns")
    for seed in (0, 1):
        model = TorchModel(zoo.build("digits-cnn", seed=seed), zoo.architecture("digits-cnn").preprocessing, name="d")
        torch.save({"module": model.module, "mlflow_di": {"preprocessing": model.preprocessing.to_dict()}},
                   folder / f"m{seed}.pt")
    return folder
