"""An `ssh` for tests of `berth launch` and its default launch agent, put first on PATH as
`ssh`: it records how it was called (a JSON line in `$FAKE_SSH_LOG`) and runs the remote
command on this machine instead of on HOST. A host named in `$FAKE_SSH_MOUNTS`
(`HOST=TARGET=SOURCE`, comma-separated) runs it in a mount namespace of its own with SOURCE
mounted over TARGET: a worker pod whose volume differs from the others' (needs root)."""

from __future__ import annotations

import json
import os
import shlex
import sys

OPTIONS_WITH_A_VALUE = {"-i", "-o", "-p", "-l", "-F", "-E", "-J", "-b", "-c", "-m"}


def main(argv: list[str]) -> None:
    with open(os.environ["FAKE_SSH_LOG"], "a") as log:
        log.write(json.dumps(argv) + "\n")
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        index += 2 if argv[index] in OPTIONS_WITH_A_VALUE else 1
    host, words = argv[index], argv[index + 1 :]
    script = " ".join(words)  # as ssh does: the words joined, for the remote user's shell
    mounts = dict(
        (entry.split("=", 1)[0], entry.split("=", 1)[1])
        for entry in os.environ.get("FAKE_SSH_MOUNTS", "").split(",")
        if entry
    )
    if host in mounts:
        target, source = mounts[host].split("=", 1)
        inner = (
            f"mount --bind {shlex.quote(source)} {shlex.quote(target)} && exec sh -c {shlex.quote(script)}"
        )
        os.execvp("unshare", ["unshare", "--mount", "sh", "-c", inner])
    os.execvp("sh", ["sh", "-c", script])


if __name__ == "__main__":
    main(sys.argv[1:])
