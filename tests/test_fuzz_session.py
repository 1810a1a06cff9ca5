"""The campaign folder's lifecycle, written once (mlflow_di.fuzz.session) and used by every runner: one
process per folder, settings written only after the seeds are checked, resume merging what was finished."""
import os
import subprocess
import sys

import pytest

from mlflow_di.data import load_images
from mlflow_di.errors import UserError
from mlflow_di.fuzz.boundary import run_boundary
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.deepxplore import run_deepxplore
from mlflow_di.fuzz.results import comparable_records
from mlflow_di.fuzz.store import CONFIG, RECORDS
from mlflow_di.models import zoo
from mlflow_di.models.torch_model import TorchModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair():
    """Two untrained digits CNNs (white-box) and 6 seeds."""
    spec = zoo.architecture("digits-cnn")
    models = [TorchModel(zoo.build("digits-cnn", seed=seed), spec.preprocessing, name=f"cnn{seed}") for seed in (0, 1)]
    return (*models, load_images("digits[0:6]"))


RUNNERS = {
    "lockstep": lambda o, c, seeds, **kw: run_campaign(o.classifier(), c.classifier(), seeds, max_queries=20, **kw),
    "boundary": lambda o, c, seeds, **kw: run_boundary(o, c.classifier(), seeds, max_queries=20, **kw),
    "deepxplore": lambda o, c, seeds, **kw: run_deepxplore([o, c], seeds, **kw),
}


@pytest.mark.parametrize("runner", RUNNERS)
def test_every_runner_refuses_a_folder_another_process_holds(pair, tmp_path, runner):
    folder = tmp_path / "campaign"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mlflow_di.folder_lock import FolderLock; "
         f"FolderLock({str(folder)!r}, 'x').acquire(); print('held', flush=True); time.sleep(60)"],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"another mlflow-di process \\(pid {holder.pid}\\) is using the campaign"):
            RUNNERS[runner](*pair, out_dir=folder, progress=False)
        assert not (folder / CONFIG).exists()  # nothing written beside the other process
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_campaign_its_runner_refuses_leaves_no_settings_behind(pair, tmp_path, runner):
    original, compressed, seeds = pair
    wrong = load_images("digits[0:6]")
    wrong.images = wrong.images[:, :4, :4]  # images the models cannot take: refused when the seeds are checked
    folder = tmp_path / "campaign"
    with pytest.raises(UserError):
        RUNNERS[runner](original, compressed, wrong, out_dir=folder, progress=False)
    assert not (folder / CONFIG).exists()  # so the same folder can be used for the corrected campaign
    RUNNERS[runner](original, compressed, seeds, out_dir=folder, progress=False)
    assert (folder / CONFIG).exists()


@pytest.mark.parametrize("runner", RUNNERS)
def test_resume_of_a_finished_campaign_returns_its_records(pair, tmp_path, runner):
    folder = tmp_path / "campaign"
    fresh = RUNNERS[runner](*pair, out_dir=folder, progress=False)
    written = (folder / RECORDS).read_text()
    assert len(written.splitlines()) == 6
    resumed = RUNNERS[runner](*pair, out_dir=folder, resume=True, progress=False)
    assert resumed.complete and comparable_records(resumed) == comparable_records(fresh)
    assert (folder / RECORDS).read_text() == written  # nothing searched, nothing appended again
