"""`berth operator` as a process of its own, for tests that kill it (`kill -9`), run two of
them, or cut them off: the same entry point as the CLI's (`berth.operator.cli.run_operator`,
leader election and kopf included), with one difference a test needs: launcher pods are mapped
to their engines through a JSON file the test keeps current (pod uid -> [host, port]), when the
engines run on 127.0.0.1, not at pod IPs (without --addresses: pod IPs, as in a cluster).
With --stall-on-sigusr1 SECONDS, a SIGUSR1 blocks the main thread (kopf's event loop) for that
long, as a burst of work or a long synchronous call would; with --stall-when-leading too, the
process sends itself one the moment it takes the Lease (before kopf's loop hears of it).

    python tests/support/operator_process.py --addresses FILE [berth operator's arguments]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from berth.operator import cli


class StallWhenLeading(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("leading as"):
            os.kill(os.getpid(), signal.SIGUSR1)


class FileResolver:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, pod: Mapping[str, Any]) -> tuple | None:
        try:
            addresses = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        address = addresses.get(pod["metadata"]["uid"])
        return tuple(address) if address else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="operator_process")
    parser.add_argument("--addresses", type=Path, help="without it: pod IPs, as in a cluster")
    parser.add_argument("--stall-on-sigusr1", type=float, metavar="SECONDS")
    parser.add_argument("--stall-when-leading", action="store_true")
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.stall_on_sigusr1:
        signal.signal(signal.SIGUSR1, lambda *_: time.sleep(args.stall_on_sigusr1))
    if args.stall_when_leading:
        logging.getLogger("berth.operator.leadership").addHandler(StallWhenLeading())
    memo = {"resolve_launcher_address": FileResolver(args.addresses)} if args.addresses else {}
    return cli.run_operator(args, memo)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
