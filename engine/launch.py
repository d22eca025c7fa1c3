"""`berth launch MODEL --hostfile FILE --tensor-parallel-size N ...`: the cluster entry point.

The launcher pod of an LLMDeployment world runs this (operator/render.py writes the command).
It starts the world's N ranks on the hosts of the hostfile (the world's worker pods) with
mpich's mpirun, over ssh with the key pair the operator mounts, and keeps the engine's proxy and
the OpenAI server in this process: `berth serve`, with every one of its options, whose ranks run
elsewhere. Rank 0 connects back to this process by `--launcher-host` (default: its fully
qualified name, the pod's DNS name on the world's headless Service).

It serves until SIGTERM (exit 0, after draining as `berth serve` does), or until the world ends
(exit 1, once /health has answered 503 with the reason for `--world-end-grace` seconds): a world
is never half alive, and the operator restarts it whole.

The pods of a world start in any order: before mpirun, it waits until every host of the
hostfile lets it in through the launch agent. Hosts that are this machine are started without
the agent (mpich forks them), so a hostfile may name this machine, even several times.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from berth.engine.serve import arguments as serve_arguments

DEFAULT_SSH_KEY = "/etc/berth/ssh/id_ed25519"  # where the operator mounts the world's key pair
AGENT_TRY_SECONDS = 30  # one attempt of the agent to reach a host
AGENT_RETRY_SECONDS = 1.0
WATCH_VERDICT_SECONDS = 2  # how long a failed connection waits for mpiexec's own verdict
COMMAND = "berth launch"


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_arguments.add_arguments(parser)
    world = parser.add_argument_group("the world (mpirun over the hostfile)")
    world.add_argument(
        "--hostfile", required=True, help="the hosts of the ranks, one HOST[:SLOTS] a line (mpich's format)"
    )
    world.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="GPUs of each host: > 0 runs each rank on the GPU of its local rank; 0 runs the ranks on CPUs",
    )
    world.add_argument(
        "--launcher-host",
        help="the name (or address) under which the hosts reach this process (default: its fully "
        "qualified domain name)",
    )
    world.add_argument(
        "--launcher-agent",
        metavar="PROGRAM",
        help="what mpirun starts remote ranks with, called as `PROGRAM [-x] HOST COMMAND...` "
        "(default: ssh with --ssh-key, host keys not pinned)",
    )
    world.add_argument("--ssh-key", default=DEFAULT_SSH_KEY, help=f"default {DEFAULT_SSH_KEY}")
    world.add_argument(
        "--hosts-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every host to let the agent in before giving up (default 600)",
    )
    world.add_argument(
        "--world-end-grace",
        type=float,
        default=5.0,
        help="seconds /health answers 503 with the reason after the world ends, before exiting 1 (default 5)",
    )


def _fail(message: str) -> int:
    return serve_arguments.fail(message, COMMAND)


def run(args: argparse.Namespace) -> int:
    if args.attach is not None:
        return _fail("--attach: berth launch owns its engine; frontends run `berth serve --attach`")
    if args.num_postprocess_workers:
        # Rank 0 would have to reach their lanes, which listen on this machine's loopback.
        return _fail("--num-postprocess-workers: not with berth launch yet (rank 0 runs on another host)")
    if args.executor not in (None, "proxy"):
        return _fail(f"--executor {args.executor}: the ranks of berth launch run in an MPI world (proxy)")
    if args.gpus_per_node < 0:
        return _fail(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    if args.world_end_grace < 0 or args.hosts_timeout < 0:
        return _fail("--world-end-grace and --hosts-timeout must be >= 0")
    try:
        hosts = read_hostfile(Path(args.hostfile))
    except (OSError, ValueError) as error:
        return _fail(f"--hostfile {args.hostfile}: {error}")
    size = args.tensor_parallel_size or 1
    slots = sum(host.slots for host in hosts)
    if slots < size:
        return _fail(f"--hostfile {args.hostfile} has {slots} slots for {size} ranks")
    if args.device is None:
        args.device = "cuda" if args.gpus_per_node else "cpu"

    from berth.engine.executor.world import MpiWorld
    from berth.engine.serve.owner import serve_model

    with tempfile.TemporaryDirectory(prefix="berth-launch-") as scratch:
        agent = args.launcher_agent or write_ssh_agent(Path(scratch), args.ssh_key)
        world = MpiWorld(
            size,
            hostfile=args.hostfile,
            launcher_agent=write_connection_watch(Path(scratch), agent),
            launcher_host=args.launcher_host or socket.getfqdn(),
        )
        return serve_model(
            args,
            world=world,
            command=COMMAND,
            exit_when_dead_after=args.world_end_grace,
            before_start=lambda: wait_for_hosts(hosts, agent, args.hosts_timeout),
        )


def read_hostfile(path: Path) -> list[Host]:
    hosts = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, slots = line.partition(":")
        if not name or (slots and not slots.isdigit()) or slots == "0" or " " in line:
            raise ValueError(f"line {number} ({raw!r}) is not HOST or HOST:SLOTS")
        hosts.append(Host(name, int(slots or 1)))
    if not hosts:
        raise ValueError("names no host")
    return hosts


def write_ssh_agent(folder: Path, key: str) -> str:
    """An ssh for mpirun with the world's key. Worker pods get new host keys whenever their
    world restarts, so host keys are not pinned (mpi-operator does the same)."""
    agent = folder / "ssh"
    options = [
        "-i", key,
        "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null",
        "-o", "BatchMode=yes",
        "-o", "LogLevel=ERROR",
        "-o", "ConnectTimeout=10",
        # A host that stops answering (its node lost, the network cut) ends the connection, and
        # with it the world (write_connection_watch), within half a minute.
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=6",
    ]  # fmt: skip
    agent.write_text(f'#!/bin/sh\nexec ssh {shlex.join(options)} "$@"\n')
    agent.chmod(0o700)
    return str(agent)


def write_connection_watch(folder: Path, agent: str) -> str:
    """What mpirun starts remote hosts with: `agent`, and the world's end when its connection to
    a host ends in failure.

    mpiexec (hydra) hears of a host's ranks only from that host's proxy: when a rank dies, the
    proxy reports it and mpiexec ends the world. But a host whose proxy vanishes without a word
    (its pod deleted, its node lost, the connection cut) leaves mpiexec waiting for it forever,
    and the world half alive. So when the agent ends with an error, this stops mpiexec (its
    parent; SIGTERM ends every other host's ranks, SIGKILL follows if it does not end), after a
    moment in which mpiexec's own verdict on a dead rank comes first. A clean shutdown ends
    every connection with 0."""
    watch = folder / "agent-watch"
    watch.write_text(
        "#!/bin/sh\n"
        "mpiexec=$PPID\n"
        'started=$(cut -d" " -f22 /proc/$mpiexec/stat)\n'
        f'{shlex.quote(agent)} "$@"\n'
        "status=$?\n"
        'if [ "$status" -ne 0 ]; then\n'
        '    if [ "$1" = -x ]; then host=$2; else host=$1; fi\n'
        f'    echo "{COMMAND}: the connection to $host ended (exit $status): ending the world" >&2\n'
        "    # In the background: mpiexec waits for this agent before it exits on its own.\n"
        "    # The same mpiexec (its start time) still running: the world is still up.\n"
        "    # SIGTERM first (mpiexec ends the other hosts' ranks); an mpiexec whose cleanup waits\n"
        "    # on hosts that are gone as well gets SIGKILL (their proxies then end their ranks).\n"
        f"    (for signal in TERM KILL; do sleep {WATCH_VERDICT_SECONDS}\n"
        '     if [ "$(cut -d" " -f22 /proc/$mpiexec/stat 2>/dev/null)" = "$started" ]; then\n'
        '         kill -"$signal" "$mpiexec"\n'
        "     fi; done) </dev/null >/dev/null 2>&1 &\n"
        "fi\n"
        'exit "$status"\n'
    )
    watch.chmod(0o700)
    return str(watch)


def is_this_machine(host: str) -> bool:
    """Whether `host` is this machine (mpich starts its ranks without the agent): it resolves to
    an address this machine can bind."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def wait_for_hosts(hosts: list[Host], agent: str, timeout: float) -> int | None:
    """None once the agent gets into every other host (it runs `true` there); 1 after `timeout`."""
    deadline = time.monotonic() + timeout
    for host in dict.fromkeys(h.name for h in hosts):
        if is_this_machine(host):
            continue
        said = ""
        while True:
            try:
                done = subprocess.run(
                    [agent, host, "true"],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=AGENT_TRY_SECONDS,
                )
                if done.returncode == 0:
                    break
                said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            except subprocess.TimeoutExpired:
                said = f"no answer in {AGENT_TRY_SECONDS} s"
            if time.monotonic() > deadline:
                print(
                    f"{COMMAND}: error: {host} did not let {agent} in within {timeout:.0f} s: {said}",
                    file=sys.stderr,
                )
                return 1
            time.sleep(AGENT_RETRY_SECONDS)
    return None
