"""A Ray node lost in the middle of a fuzz campaign costs time, never records (tests/ray_node_loss.py runs
the campaign on a local multi-node cluster in its own process)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (mlflow-di[ray])")]


def test_a_node_removed_mid_campaign_loses_no_record_and_writes_none_twice():
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-m", "tests.ray_node_loss"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    assert found["lost"]["after_chunks"] < found["stats"]["chunks"]  # the node went while chunks were left
    assert found["complete"] and found["equal"] and found["written_equal"]
    assert found["records"] == found["seeds"]  # every seed once: nothing lost, nothing written twice
    assert found["stats"]["chunks_on_restarted_workers"] >= 1  # the lost node's worker ran again elsewhere
