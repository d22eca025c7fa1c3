"""What the operating system says about a process: whether it lives, and what keeps it from running.

The one place these are decided, for the proxy (its workers), a worker (its proxy) and the tests.
"""

from __future__ import annotations

import os
from pathlib import Path

# /proc/PID/stat's states that stop a process from answering (R, S and I do not).
_STUCK_STATES = {
    "T": "is stopped (SIGSTOP)",
    "t": "is stopped by a debugger",
    "D": "is in uninterruptible sleep (a hung device or file system)",
    "Z": "has exited",
    "X": "has exited",
}


def pid_alive(pid: int) -> bool:
    """True while `pid` runs. An exited process nobody has reaped yet is gone. The kernel's answer
    to kill(pid, 0) decides, not /proc: a /proc this process cannot read (hidepid) is no death."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: it exists
    state = _state(pid)
    return state not in ("Z", "X")


def process_state(pid: int) -> str | None:
    """What keeps process `pid` from running, in words; None while it can run (or cannot be read)."""
    if not pid_alive(pid):
        return "is gone"
    return _STUCK_STATES.get(_state(pid) or "")


def _state(pid: int) -> str | None:
    """The one-letter state in /proc/PID/stat; None if that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[0] if fields else None
