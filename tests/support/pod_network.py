"""Pod networking for the test kubelet: one Linux bridge per kubelet, one network namespace per
pod, a veth pair between them, and pod IPs from a private test range.

The bridge carries the range's first address, so this process (the operator under test, the
tests) reaches every pod IP directly, like a node reaches its pods. Nothing leaves the bridge:
there is no route out of a pod's namespace and no NAT.

Everything is named after the owning process (`bk<pid>...`, `berth-<pid>-<n>`), so a run that
was killed before its cleanup is swept by the next one (`sweep_stale`), and two test processes on
one machine never touch each other's devices. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.engine_processes import pid_alive

NETNS_DIR = Path("/run/netns")
SUBNET_LOCK = Path("/run/berth-test-pod-network.lock")
# Candidate pod ranges (RFC 1918, well away from the usual Docker / Kubernetes defaults); a
# kubelet takes the first /22 that no interface on this machine uses yet.
TEST_RANGE = ipaddress.ip_network("10.233.0.0/16")
SUBNET_PREFIX = 22
NETNS_PREFIX = "berth-"
LINK_PREFIX = "bk"


class NetworkSetupError(RuntimeError):
    """The machine cannot give pods their own network (not root, no iproute2, ...)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetworkSetupError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def require_root() -> None:
    """Fail loudly (never skip): the pods' namespaces are the point of these tests."""
    if os.geteuid() != 0:
        raise NetworkSetupError(
            "the test kubelet runs pods in their own network and mount namespaces, which needs root "
            "(run the suite as root, as CI does)"
        )
    if subprocess.run(["ip", "-V"], capture_output=True).returncode != 0:
        raise NetworkSetupError(
            "iproute2 (`ip`) is missing: install it with the project's setup (make setup)"
        )


def netns_pids(name: str) -> list[int]:
    result = ip("netns", "pids", name, check=False)
    return [int(pid) for pid in result.stdout.split()] if result.returncode == 0 else []


def kill_netns_processes(name: str, timeout: float = 10.0) -> None:
    """SIGKILL everything still running in a namespace and wait until it is gone: a namespace
    that a process still holds survives `ip netns del`, and its veth with it."""
    deadline = time.monotonic() + timeout
    while pids := netns_pids(name):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise NetworkSetupError(f"processes {pids} in network namespace {name} did not die")
        time.sleep(0.02)


def delete_netns(name: str) -> None:
    kill_netns_processes(name)
    ip("netns", "del", name, check=False)


def sweep_stale() -> None:
    """Remove namespaces and links left behind by test processes that no longer exist."""
    owner = re.compile(rf"^{NETNS_PREFIX}([0-9a-f]+)-")
    for entry in NETNS_DIR.iterdir() if NETNS_DIR.exists() else []:
        match = owner.match(entry.name)
        if match and not pid_alive(int(match[1], 16)):
            delete_netns(entry.name)
    links = ip("-o", "link", "show", check=False).stdout
    for name in re.findall(rf"^\d+: ({LINK_PREFIX}[bv][0-9a-f]+)[@:]", links, flags=re.M):
        pid = int(re.match(rf"{LINK_PREFIX}[bv]([0-9a-f]+)", name)[1], 16)  # type: ignore[index]
        if not pid_alive(pid):
            ip("link", "del", name, check=False)


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = ip("-o", "-4", "addr", "show", check=False).stdout
    return [ipaddress.ip_interface(cidr).network for cidr in re.findall(r"inet (\S+)", out)]


@dataclass
class PodInterface:
    netns: str
    host_link: str
    ip: str


@dataclass
class PodNetwork:
    """The bridge of one kubelet and the pods' namespaces on it."""

    subnet: ipaddress.IPv4Network
    bridge: str
    gateway: str
    _token: str = field(default_factory=lambda: f"{os.getpid():x}")
    _numbers: itertools.count = field(default_factory=lambda: itertools.count(1))
    _free: list[str] = field(default_factory=list)
    _hosts: object = None
    pods: dict[str, PodInterface] = field(default_factory=dict)  # netns name -> interface

    @classmethod
    def create(cls) -> PodNetwork:
        require_root()
        # Choosing a free range and taking it is one step for all test processes on the machine
        # (pytest-xdist's workers): two kubelets starting at once must not take the same range.
        with open(SUBNET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sweep_stale()
            used = _used_networks()
            subnet = next(
                (
                    candidate
                    for candidate in TEST_RANGE.subnets(new_prefix=SUBNET_PREFIX)
                    if not any(candidate.overlaps(net) for net in used)
                ),
                None,
            )
            if subnet is None:
                raise NetworkSetupError(f"no free /{SUBNET_PREFIX} left in {TEST_RANGE}")
            bridge = f"{LINK_PREFIX}b{os.getpid():x}"
            gateway = str(next(subnet.hosts()))
            ip("link", "add", bridge, "type", "bridge")
            ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", bridge)
        ip("link", "set", bridge, "up")
        network = cls(subnet=subnet, bridge=bridge, gateway=gateway)
        network._hosts = iter(list(subnet.hosts())[1:])  # the first address is the bridge's
        return network

    def _next_ip(self) -> str:
        # Fresh addresses first: a deleted pod's address is handed out again only when none is
        # left, so a stale address in a test's hands never reaches a newer pod.
        fresh = next(self._hosts, None)  # type: ignore[call-overload]
        if fresh is not None:
            return str(fresh)
        if self._free:
            return self._free.pop(0)
        raise NetworkSetupError(f"pod range {self.subnet} is exhausted")

    def add_pod(self) -> PodInterface:
        """A new namespace with `lo` and `eth0` up and a pod IP on the bridge."""
        number = next(self._numbers)
        netns = f"{NETNS_PREFIX}{self._token}-{number}"
        host_link = f"{LINK_PREFIX}v{self._token}n{number:x}"
        address = self._next_ip()
        ip("netns", "add", netns)
        try:
            ip("link", "add", host_link, "type", "veth", "peer", "name", "eth0", "netns", netns)
            ip("link", "set", host_link, "master", self.bridge, "up")
            ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
            ip("-n", netns, "link", "set", "eth0", "up")
            ip("-n", netns, "link", "set", "lo", "up")
        except NetworkSetupError:
            ip("link", "del", host_link, check=False)
            ip("netns", "del", netns, check=False)
            raise
        interface = PodInterface(netns=netns, host_link=host_link, ip=address)
        self.pods[netns] = interface
        return interface

    def remove_pod(self, netns: str) -> None:
        interface = self.pods.pop(netns, None)
        delete_netns(netns)
        if interface is not None:
            ip("link", "del", interface.host_link, check=False)  # gone with the namespace already
            self._free.append(interface.ip)

    def close(self) -> None:
        for netns in list(self.pods):
            self.remove_pod(netns)
        ip("link", "del", self.bridge, check=False)
