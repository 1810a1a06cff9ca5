"""A Ray node lost in the middle of a fuzz campaign or a coverage pass, or a campaign's driver killed, costs time,
never records (tests/ray_node_loss.py runs all three on one local multi-node cluster in its own process)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (mlflow-di[ray])")]


@pytest.fixture(scope="module")
def found():
    """What tests/ray_node_loss.py saw: one cluster, three losses (a node mid-campaign, a node mid-pass, the driver)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-m", "tests.ray_node_loss"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))


def test_a_node_removed_mid_campaign_loses_no_record_and_writes_none_twice(found):
    fuzz = found["fuzz"]
    assert fuzz["lost"]["after_chunks"] < fuzz["stats"]["chunks"]  # the node went while chunks were left
    assert fuzz["complete"] and fuzz["equal"] and fuzz["written_equal"]
    assert fuzz["records"] == fuzz["seeds"]  # every seed once: nothing lost, nothing written twice
    assert fuzz["stats"]["chunks_on_restarted_workers"] >= 1  # the lost node's worker ran again elsewhere


def test_a_node_removed_mid_coverage_pass_changes_no_number(found):
    coverage = found["coverage"]
    assert coverage["idc_equal"] and coverage["results_equal"] and coverage["criteria_equal"]
    assert coverage["lost"]["batches_on_restarted_workers"] >= 1  # said, not hidden


def test_a_killed_driver_leaves_a_campaign_that_resume_completes(found):
    driver = found["driver"]
    assert 0 < driver["saved_before_the_kill"] < driver["seeds"]  # killed with work done and work left
    assert driver["complete"] and driver["written_equal"]
    assert driver["lines"] == driver["distinct"] == driver["seeds"]  # each seed written once
