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


@pytest.mark.parametrize("runner", ["lockstep", "boundary"])
def test_a_campaign_extended_to_more_seeds_keeps_its_records_and_equals_a_fresh_one(pair, tmp_path, runner):
    """Each seed's search depends on its own index alone, so growing a 3-seed campaign to 6 (the first 3 its own)
    searches only the new seeds and gives the records of a 6-seed campaign run at once; other seeds are refused."""
    from mlflow_di.fuzz.seeds import seed_fingerprint
    from mlflow_di.fuzz.store import CampaignStore

    original, compressed, seeds = pair
    folder = tmp_path / "campaign"
    RUNNERS[runner](original, compressed, seeds.subset(slice(0, 3)), out_dir=folder, progress=False)
    first = (folder / RECORDS).read_text().splitlines()
    store = CampaignStore(folder)
    assert store.extend(6, seed_fingerprint(seeds), lambda n: seed_fingerprint(seeds.subset(slice(0, n)))) == 3
    grown = RUNNERS[runner](original, compressed, seeds, out_dir=folder, resume=True, progress=False)
    assert (folder / RECORDS).read_text().splitlines()[:3] == first  # the first three were not searched again
    fresh = RUNNERS[runner](original, compressed, seeds, out_dir=tmp_path / "fresh", progress=False)
    assert grown.complete and comparable_records(grown) == comparable_records(fresh)
    other = load_images("digits[100:106]")
    with pytest.raises(UserError, match="its 6 seeds are not the first of the new ones"):
        CampaignStore(tmp_path / "fresh").extend(
            12, "x", lambda n: seed_fingerprint(other.subset(slice(0, min(n, 6)))))


@pytest.mark.parametrize("tail", [b'{"index": 7, "lab', b"", b"\n"], ids=["torn", "whole", "blank-line"])
def test_records_appended_after_a_torn_line_start_on_their_own_and_the_torn_line_is_gone(tmp_path, tail):
    """A full disk or a kill mid-write leaves a record line without its end; the next append (a resumed
    campaign) cuts it first, so the file holds whole records only."""
    from mlflow_di.fuzz.results import SeedRecord
    from mlflow_di.fuzz.store import CampaignStore

    def record(index):
        return SeedRecord(index=index, label=1, success=False, stop="max_queries", queries=5, seconds=0.0,
                          seed_labels=(1, 1), seed_probabilities=(1.0, 1.0))
    whole = record(0).to_json() + "\n" + record(1).to_json() + "\n"
    (tmp_path / RECORDS).write_bytes(whole.encode() + tail)
    store = CampaignStore(tmp_path)
    store.append(record(2), None, None)
    store.close()
    lines = (tmp_path / RECORDS).read_text().splitlines()
    kept = [line for line in lines if line]
    assert [SeedRecord.from_json(line).index for line in kept] == [0, 1, 2]
    assert len(lines) == len(kept) + (tail == b"\n")  # a blank line is whole: left as it was
