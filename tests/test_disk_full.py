"""Writes the machine refuses (a full disk, a read-only mount, a full tracking store): one line,
exit code 2, the run ended FAILED, finished work kept and resumable, nothing half-written left.

The cases run on a small tmpfs mounted for the test; where the machine does not allow mounting
(not root, no CAP_SYS_ADMIN) they are skipped with that reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PREFIX = "mlflow-di: error: "


@pytest.fixture()
def small_disk(tmp_path):
    """A 2 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'})")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(folder, leave_kib: int = 0) -> None:
    """Fill the file system of ``folder`` up to ``leave_kib`` KiB."""
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize - leave_kib * 1024
    with open(folder / "filler", "wb") as handle:
        handle.write(b"\0" * max(free, 0))


@pytest.fixture(scope="module")
def models(untrained_cnn_files):
    """Two small untrained digits CNNs that disagree on many digits (``m0.pt``, ``m1.pt``)."""
    return untrained_cnn_files


def run_cli(*args, uri):
    return subprocess.run([sys.executable, "-m", "mlflow_di.cli", "--tracking-uri", uri, *args],
                          capture_output=True, text=True, timeout=300)


def statuses(uri) -> list[str]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return [run.info.status for run in client.search_runs([e.experiment_id for e in client.search_experiments()])]


def one_line(done) -> str:
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith(PREFIX), done.stderr[-3000:]
    return lines[0]


def test_an_output_on_a_full_disk_is_refused_before_any_work(small_disk, models, tmp_path):
    fill(small_disk)
    uri = f"sqlite:///{tmp_path / 's.db'}"
    done = run_cli("coverage", "--model-uri", str(models / "m0.pt"), "--train-data", "digits[0:40]",
                   "--test-data", "digits[40:80]", "--criteria", "nc", "--json-out", str(small_disk / "out/c.json"), uri=uri)
    assert "--json-out" in one_line(done) and "No space left on device" in done.stderr
    assert statuses(uri) == []  # refused while parsing: no run started
    assert not [p for p in small_disk.rglob("*") if p.name != "filler" and p.is_file()]


def test_an_output_on_a_read_only_mount_is_refused(small_disk, models, tmp_path):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    uri = f"sqlite:///{tmp_path / 's.db'}"
    done = run_cli("fuzz", "--original", str(models / "m0.pt"), "--compressed", str(models / "m1.pt"),
                   "--seed-data", "digits[0:4]", "--out-dir", str(small_disk / "campaign"), uri=uri)
    assert "--out-dir" in one_line(done) and "Read-only file system" in done.stderr


def test_a_disk_that_fills_during_a_campaign_keeps_what_was_found(small_disk, models, tmp_path):
    """The campaign writes until the disk is full: one line, the run FAILED, every record written
    whole; after room is made, --resume completes the campaign."""
    fill(small_disk, leave_kib=64)
    uri = f"sqlite:///{tmp_path / 's.db'}"
    campaign = small_disk / "campaign"
    argv = ["fuzz", "--original", str(models / "m0.pt"), "--compressed", str(models / "m1.pt"), "--seed-data",
            "digits[0:300]", "--num-seeds", "300", "--max-queries", "50", "--out-dir", str(campaign)]
    done = run_cli(*argv, uri=uri)
    assert "No space left on device" in one_line(done) and "finished work is kept" in done.stderr
    assert statuses(uri) == ["FAILED"]
    assert not [p.name for p in campaign.rglob("*partial*")]
    (small_disk / "filler").unlink()
    resumed = run_cli(*argv, "--resume", uri=uri)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (campaign / "records.jsonl").read_text().splitlines()]
    assert sorted(record["index"] for record in records) == list(range(300))


def test_a_full_tracking_store_is_one_line(small_disk, models):
    uri = f"sqlite:///{small_disk / 'store.db'}"
    import mlflow

    mlflow.MlflowClient(uri).search_experiments()  # creates the store's tables
    fill(small_disk)
    done = run_cli("coverage", "--model-uri", str(models / "m0.pt"), "--train-data", "digits[0:40]",
                   "--test-data", "digits[40:80]", "--criteria", "nc", uri=uri)
    assert "database or disk is full" in one_line(done)


def test_outputs_that_are_not_regular_files_are_written_in_place_and_checked(tmp_path):
    """``--json-out /dev/full`` fails in one line (ENOSPC shows when the write is flushed); a link (such as
    /dev/stdout) is written through, never replaced by a renamed file; a regular file is replaced whole."""
    import threading

    from mlflow_di.commands.output_files import WriteFailed, write_text_out

    if os.path.exists("/dev/full"):
        with pytest.raises(WriteFailed, match="No space left on device"):
            write_text_out("{}", "/dev/full")
        assert not os.path.isfile("/dev/full") and not os.path.exists("/dev/.full.partial")
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text_out("through the link", str(link))
    assert link.is_symlink() and target.read_text() == "through the link"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    write_text_out("into the pipe", str(fifo))
    reader.join(10)
    assert got == ["into the pipe"] and not (tmp_path / ".pipe.partial").exists()
    plain = tmp_path / "plain.json"
    write_text_out("whole", str(plain))
    assert plain.read_text() == "whole" and sorted(p.name for p in tmp_path.iterdir()) == [
        "link.json", "pipe", "plain.json", "real.json"]


def test_a_sqlite_store_in_a_read_only_folder_is_one_line(tmp_path):
    """SQLAlchemy's 'unable to open database file' (164 lines of traceback) becomes one line naming the store."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'})")
    try:
        uri = f"sqlite:///{folder}/mlflow.db"
        run = subprocess.run([sys.executable, "-m", "mlflow_di.cli", "--tracking-uri", uri, "gate", "--model-uri",
                              "models:/m/1", "--min-idc", "0.5"], capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith(PREFIX) and f"cannot open the tracking store {uri}" in lines[0]
