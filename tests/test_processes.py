"""Whether a process still runs: this one does, a reaped child does not, and neither does a zombie (killed,
not yet reaped), which signal 0 alone would call alive."""
import os
import subprocess
import sys
import time

from mlflow_di import processes


def test_this_process_runs_and_a_reaped_child_does_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert processes.alive(os.getpid())
    assert not processes.alive(child.pid)


def test_a_zombie_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.kill()
        deadline = time.monotonic() + 10
        while processes.alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not processes.alive(child.pid)
        os.kill(child.pid, 0)  # not reaped yet: the kernel still knows the pid
    finally:
        child.wait()
