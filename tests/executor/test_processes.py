"""`processes.py`: one answer to "does this process live?" for the proxy, a worker and the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from berth.engine.executor.processes import pid_alive, process_state
from tests.support.engine_processes import wait_until


def test_a_running_a_stopped_an_exited_and_an_unknown_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        assert wait_until(lambda: process_state(child.pid) is None, 5)  # (briefly in D while it execs)
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_until(lambda: process_state(child.pid) == "is stopped (SIGSTOP)", 5)
        assert pid_alive(child.pid)  # stopped is not dead
        os.kill(child.pid, signal.SIGKILL)
        # Exited and not reaped yet (a zombie): gone, though kill(pid, 0) still finds it.
        assert wait_until(lambda: not pid_alive(child.pid), 5)
        assert process_state(child.pid) == "is gone"
    finally:
        child.kill()
        child.wait(5)
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid()) and process_state(os.getpid()) is None
