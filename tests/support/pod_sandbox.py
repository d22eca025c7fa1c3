"""The first process of every container the test kubelet starts (standard library only).

    python pod_sandbox.py PLAN.json

Run as root, it enters the pod's network namespace, gets a mount and a UTS namespace of its own
(so it has its own hostname and its own view of the files below), lays the image's files and the
pod's volumes over the machine's directories, drops to the container's user, groups and
capabilities (`setpriv`), and execs the container's command with its environment. The PID stays
the same from here to the container's command, and every process the command starts shares this
mount namespace: that namespace *is* the container for the kubelet (how it finds, signals and
kills all of a container's processes).

The plan (written by kubelet.py):
  netns       path of the pod's network namespace (/run/netns/NAME)
  hostname    the pod's hostname
  overlays    [{target, lower: [dirs, top first], upper, work}]: copy-on-write layers over a
              machine directory (the image's /etc, /home, /run over the machine's)
  mounts      [{type: bind|tmpfs, source, target, readonly, options}] in mount order
  env, argv, cwd
  setpriv     arguments for setpriv (user, groups, no_new_privs, bounding set), or []
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str, target: str, fstype: str | None, flags: int, options: str | None = None) -> None:
    _check(
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            options.encode() if options else None,
        ),
        f"mount {source} on {target}",
    )


def enter_namespaces(netns: str) -> None:
    fd = os.open(netns, os.O_RDONLY)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns {netns}")
    finally:
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    # Nothing mounted from here on may leak back to the machine.
    mount("none", "/", None, MS_REC | MS_PRIVATE)


def lay_files(plan: dict) -> None:
    # Every bind's source is the machine's, whatever the plan mounts first: a source under /tmp
    # (a checkout cloned there) is hidden once the container's own /tmp is mounted over it. So
    # each is opened now and bound through its descriptor.
    sources = {
        spec["source"]: os.open(spec["source"], os.O_PATH | os.O_CLOEXEC)
        for spec in plan["mounts"]
        if spec["type"] == "bind"
    }
    for layer in plan["overlays"]:
        lower = ":".join([*layer["lower"], layer["target"]])
        options = f"lowerdir={lower},upperdir={layer['upper']},workdir={layer['work']}"
        mount("overlay", layer["target"], "overlay", 0, options)
    for spec in plan["mounts"]:
        target = spec["target"]
        if spec["type"] == "tmpfs":
            os.makedirs(target, exist_ok=True)
            mount("tmpfs", target, "tmpfs", 0, spec.get("options") or "mode=1777")
            continue
        source = f"/proc/self/fd/{sources[spec['source']]}"
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        elif not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        mount(source, target, None, MS_BIND | MS_REC)
        if spec.get("readonly"):
            mount(source, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    for descriptor in sources.values():
        os.close(descriptor)


def main() -> None:
    with open(sys.argv[1]) as handle:
        plan = json.load(handle)
    enter_namespaces(plan["netns"])
    socket.sethostname(plan["hostname"])
    lay_files(plan)
    os.chdir(plan.get("cwd") or "/")
    argv = plan["argv"]
    if plan["setpriv"]:
        argv = ["/usr/bin/setpriv", *plan["setpriv"], "--", *argv]
    try:
        os.execvpe(argv[0], argv, plan["env"])
    except OSError as error:
        # What a container runtime reports when the image lacks the command.
        print(f"exec {argv[0]!r} failed: {error.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
