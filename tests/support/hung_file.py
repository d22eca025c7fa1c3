"""A file whose every open blocks, as a file on a hung network mount does, without a mount.

    with HungFile(path):  # opening `path` (to read its weights, say) now blocks in the kernel
        ...

A helper process opens the file and takes a write lease on it (fcntl F_SETLEASE F_WRLCK). Any
other process's open then waits in the kernel until the lease holder gives the lease up, which
this one never does: the kernel breaks the lease itself only after /proc/sys/fs/lease-break-time
(45 s by default), far longer than a test waits. `stat` does not break a lease, so the file still
looks like a plain file of the right size. Leaving the block ends the helper (its lease with it).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HOLDER_READY = "lease held"


class HungFile:
    def __init__(self, path: Path, timeout: float = 10) -> None:
        self.path = Path(path)
        self._timeout = timeout
        self._holder: subprocess.Popen | None = None

    def __enter__(self) -> HungFile:
        self._holder = subprocess.Popen(
            [sys.executable, __file__, str(self.path)], stdout=subprocess.PIPE, text=True
        )
        line = self._holder.stdout.readline()  # bounded: the holder says so or exits at once
        if line.strip() != HOLDER_READY:
            self.__exit__()
            raise RuntimeError(f"could not take a lease on {self.path} (leases disabled? {line!r})")
        return self

    def __exit__(self, *exc_info) -> None:
        if self._holder is not None:
            self._holder.kill()
            self._holder.wait(self._timeout)
            self._holder.stdout.close()


def _hold(path: str) -> None:
    # Every open by another process sends the holder a lease-break signal (SIGIO), which would
    # end it: it is ignored, and the lease stays until the holder is killed.
    signal.signal(signal.SIGIO, signal.SIG_IGN)
    descriptor = os.open(path, os.O_RDONLY)
    fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    print(HOLDER_READY, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    _hold(sys.argv[1])
