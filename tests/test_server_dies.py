"""A real ``mlflow server`` that dies in the middle of a command: one line and exit 2 (never the gate's FAIL
code 1), the results kept on disk with the command that logs them, and the run not left RUNNING once the
server is back (the next command that reaches it ends the run FAILED)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.mlflow_server import LOCAL_ONLY, start_server

PREFIX = "mlflow-di: error: "
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_file(untrained_cnn_files):
    """Two small untrained digits CNNs that disagree on many digits (``m0.pt``, ``m1.pt``)."""
    return untrained_cnn_files


def running_runs(url: str) -> list[dict]:
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/runs/search", method="POST",
                                     data=json.dumps({"experiment_ids": ["0", "1"], "max_results": 50}).encode(),
                                     headers={"Content-Type": "application/json"})
    with LOCAL_ONLY.open(request, timeout=5) as answer:
        runs = json.loads(answer.read()).get("runs", [])
    return [run["info"] for run in runs]


#: a periodic progress line off a terminal, e.g. ``fuzz dflare:  12%|#2        | 36/300 [00:10<01:14, ...]``
PROGRESS_LINE = re.compile(r"^[^:]{1,80}: +\d+%\|")


def progress_and_other_lines(err: str) -> tuple[list[str], list[str]]:
    """stderr's lines split into periodic progress lines and the rest."""
    lines = err.strip().splitlines()
    return [line for line in lines if PROGRESS_LINE.match(line)], [line for line in lines if not PROGRESS_LINE.match(line)]


@pytest.mark.parametrize("command", ["fuzz", "coverage"])
def test_a_server_that_dies_mid_run_is_one_line_and_the_run_is_ended_when_it_is_back(command, model_file, tmp_path):
    folder, work = tmp_path / "server", tmp_path / "work"
    work.mkdir()
    server = start_server(folder)
    port = int(server.url.rsplit(":", 1)[1])
    # each runs for several seconds after its run starts, long enough to be killed in the middle (the server dies
    # as soon as the run is RUNNING), and goes on to its end with the server gone
    if command == "fuzz":  # 100 seeds, 2,000 queries each at most
        args = ["fuzz", "--original", str(model_file / "m0.pt"), "--compressed", str(model_file / "m1.pt"),
                "--seed-data", "digits[0:100]", "--num-seeds", "100", "--max-queries", "2000"]
    else:  # every criterion on 1,200 training images; the IDC interval is not what this test reads
        args = ["coverage", "--model-uri", str(model_file / "m0.pt"), "--train-data", "digits[0:1200]",
                "--test-data", "digits[1200:]", "--idc-resamples", "5"]
    process = subprocess.Popen([sys.executable, "-m", "mlflow_di.cli", "--tracking-uri", server.url, *args], cwd=work,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(run["status"] == "RUNNING" for run in running_runs(server.url)):
            assert process.poll() is None and time.monotonic() < deadline, "the command never started its run"
            time.sleep(0.2)
        run_id = next(run["run_id"] for run in running_runs(server.url) if run["status"] == "RUNNING")
        os.killpg(server.process.pid, signal.SIGKILL)  # the server dies, with no word to anyone
        server.process.wait(10)
        out, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    # a slow machine prints progress lines (every 10 s off a terminal) before the server dies: one
    # error line, the last, and nothing else but progress
    progress, lines = progress_and_other_lines(err)
    assert process.returncode == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(PREFIX) and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == lines[0]
    assert server.url in lines[0] and f"run {run_id} could not be ended either" in lines[0]
    assert "mlflow-di close-runs" in lines[0]  # the command that ends it once the store is back
    kept = work / "mlflow-di-unlogged" / run_id
    assert (kept / "end.json").exists() and f"--local-dir mlflow-di-unlogged/{run_id}" in lines[0]
    back = start_server(folder, port=port)
    try:
        assert [run["status"] for run in running_runs(back.url) if run["run_id"] == run_id] == ["RUNNING"]
        again = subprocess.run([sys.executable, "-m", "mlflow_di.cli", "--tracking-uri", back.url, "coverage",
                                "--model-uri", str(model_file / "m0.pt"), "--train-data", "digits[0:50]",
                                "--test-data", "digits[50:80]", "--criteria", "nc"], cwd=work, capture_output=True,
                               text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"ended run {run_id}, left RUNNING" in again.stderr
        assert [run["status"] for run in running_runs(back.url) if run["run_id"] == run_id] == ["FAILED"]
        assert not (kept / "end.json").exists()
    finally:
        back.stop()
