"""How much memory the KV pool may take: the limits that bind this process, and the plan.

A CPU engine in a Kubernetes pod must size its pool from the pod's memory limit, not from
the node's free memory: `/proc/meminfo` shows the node, and a pool sized from it is OOM-killed
once load writes its blocks (the pool's pages are taken lazily, so it looks harmless until
then). So the budget is what the tightest of the limits leaves, measured once the weights are
loaded: the memory cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, on the process's own
cgroup and every ancestor), the host's `MemAvailable`, and on CUDA the device's free memory.
From that, the peak activation memory of the largest step (measured by a profiling forward
pass, as vLLM's profile run does) and a stated headroom are set aside; the pool gets
`memory_fraction` of the rest.

`plan_kv_cache` is a pure function of one rank's measurements, so a tensor-parallel world can
plan on every rank and agree on the smallest block count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from berth.engine.engine_io import GiB, KVCachePlan

MiB = 1 << 20
# Set aside beyond the profiled step: what grows while serving and no profile sees (requests'
# Python objects, the proxy's and server's buffers in the same cgroup, allocator slack).
DEFAULT_HEADROOM_BYTES = 256 * MiB
# A cgroup limit at least this large means none (v1 writes 2^63 - 4096 for "no limit").
NO_LIMIT = 1 << 62


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """One limit on the memory this process may take: `capacity` in all, of which `available`
    is not in use now."""

    source: str  # "cgroup" | "host" | "cuda"
    capacity: int
    available: int
    where: str = ""  # the cgroup directory, the device


class MemoryBudgetError(ValueError):
    """The limits leave too little for what the configuration asks: raised at start, with the
    numbers, instead of an OOM kill under load."""


def plan_kv_cache(
    *,
    limits: list[MemoryLimit],
    bytes_per_block: int,
    block_size: int,
    dtype: str,
    min_blocks: int,
    max_useful_blocks: int,
    activation_peak: int,
    memory_fraction: float,
    headroom: int = DEFAULT_HEADROOM_BYTES,
    explicit_blocks: int | None = None,
    explicit_bytes: int | None = None,
) -> KVCachePlan:
    """The pool for one rank. Without an override: `memory_fraction` of what the tightest limit
    leaves after the activations and the headroom, capped at what `max_useful_blocks` (every
    batch slot at full length) could use, and never less than `min_blocks` (one full-length
    sequence): a configuration that cannot hold one fails here. An override (`explicit_blocks`,
    `explicit_bytes`) is taken as given, but one that the limits cannot hold fails too."""
    if not limits:
        raise ValueError("no memory limit to plan the KV cache against")
    binding = min(limits, key=lambda limit: limit.available)
    usable = binding.available - activation_peak - headroom

    def plan(num_blocks: int, source: str, limit_bytes: int) -> KVCachePlan:
        return KVCachePlan(
            num_blocks=num_blocks,
            block_size=block_size,
            bytes_per_block=bytes_per_block,
            dtype=dtype,
            limit_source=source,
            limit_bytes=limit_bytes,
            available_bytes=binding.available,
            activation_peak_bytes=activation_peak,
            headroom_bytes=headroom,
        )

    accounting = (
        f"the {binding.source} limit{f' ({binding.where})' if binding.where else ''} is "
        f"{_gib(binding.capacity)}, of which {_gib(binding.available)} is free with the weights "
        f"loaded; the largest step's activations take {_gib(activation_peak)} and the headroom is "
        f"{_gib(headroom)}, which leaves {_gib(max(0, usable))} for the KV cache"
    )
    if explicit_blocks is not None or explicit_bytes is not None:
        num_blocks = explicit_blocks if explicit_blocks is not None else explicit_bytes // bytes_per_block
        if num_blocks < 1:
            raise MemoryBudgetError(
                f"kv_cache_memory={explicit_bytes} bytes is less than one KV block ({bytes_per_block} bytes)"
            )
        wanted = num_blocks * bytes_per_block
        if wanted > usable:
            raise MemoryBudgetError(
                f"the KV cache asked for ({num_blocks} blocks = {_gib(wanted)}) does not fit: {accounting}"
            )
        return plan(num_blocks, "flag", wanted)
    num_blocks = min(int(max(0, usable) * memory_fraction) // bytes_per_block, max_useful_blocks)
    if num_blocks < min_blocks:
        raise MemoryBudgetError(
            f"not enough memory for one full-length sequence: it needs {min_blocks} KV blocks "
            f"({_gib(min_blocks * bytes_per_block)}), and {memory_fraction:g} of what is left holds "
            f"{num_blocks}: {accounting}. Raise the memory limit, or lower max_model_len, or use "
            "kv_cache_dtype bfloat16"
        )
    return plan(num_blocks, binding.source, binding.capacity)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / MiB:.0f} MiB"


# ---- the limits, read from the system ------------------------------------------------------------


def host_limits(proc: Path = Path("/proc"), cgroup_root: Path | None = None) -> list[MemoryLimit]:
    """The host-memory limits of this process: its memory cgroups' (if any sets one) and the
    host's available memory. `proc` and `cgroup_root` are for tests."""
    limits = [_host_limit(proc)]
    cgroup = cgroup_limit(proc, cgroup_root)
    if cgroup is not None:
        limits.append(cgroup)
    return limits


def cuda_limit(device) -> MemoryLimit:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return MemoryLimit("cuda", total, free, str(device))


def _host_limit(proc: Path) -> MemoryLimit:
    meminfo = _key_values(proc / "meminfo")
    if "MemAvailable" in meminfo:
        return MemoryLimit("host", meminfo["MemTotal"] * 1024, meminfo["MemAvailable"] * 1024)
    page = os.sysconf("SC_PAGE_SIZE")
    return MemoryLimit("host", page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES"))


def cgroup_limit(proc: Path = Path("/proc"), cgroup_root: Path | None = None) -> MemoryLimit | None:
    """The tightest memory cgroup limit on this process: of its own cgroup and every ancestor
    that the mount shows (a pod's container sees its own cgroup as the mount's root). In use
    means what the kubelet calls the working set: usage less the inactive page cache, which
    the kernel reclaims before it kills anyone. None when no cgroup sets a limit."""
    found: list[MemoryLimit] = []
    for directory, version in _memory_cgroups(proc, cgroup_root):
        for node in _self_and_ancestors(directory, version.root):
            limit = _read_cgroup(node, version.v2)
            if limit is not None:
                found.append(limit)
    return min(found, key=lambda limit: limit.available) if found else None


@dataclass(frozen=True, slots=True)
class _Hierarchy:
    root: Path  # where the hierarchy is mounted
    v2: bool


def _memory_cgroups(proc: Path, cgroup_root: Path | None) -> list[tuple[Path, _Hierarchy]]:
    """This process's cgroup directory in each hierarchy that controls memory."""
    try:
        memberships = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    hierarchies: dict[str, tuple[str, str]] = {}  # "v2" / "v1" -> (mount's root in the tree, mount point)
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, fs = left.split(), right.split()
        if len(fields) < 5 or len(fs) < 3:
            continue
        if fs[0] == "cgroup2":
            hierarchies.setdefault("v2", (fields[3], fields[4]))
        elif fs[0] == "cgroup" and "memory" in fs[2].split(","):
            hierarchies.setdefault("v1", (fields[3], fields[4]))
    found = []
    for line in memberships:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            key = "v2"
        elif "memory" in controllers.split(","):
            key = "v1"
        else:
            continue
        if key not in hierarchies:
            continue
        mount_root, mount_point = hierarchies[key]
        point = Path(cgroup_root) if cgroup_root is not None else Path(mount_point)
        relative = os.path.relpath(path, mount_root)
        # Outside the mounted subtree (a cgroup namespace, a bind mount): the mount is ours.
        directory = point if relative.startswith("..") or relative == "." else point / relative
        found.append((directory, _Hierarchy(point, key == "v2")))
    return found


def _self_and_ancestors(directory: Path, root: Path) -> list[Path]:
    nodes = [directory]
    while nodes[-1] != root and root in nodes[-1].parents:
        nodes.append(nodes[-1].parent)
    return nodes


def _read_cgroup(directory: Path, v2: bool) -> MemoryLimit | None:
    limit_file, usage_file, inactive = (
        ("memory.max", "memory.current", "inactive_file")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    try:
        text = (directory / limit_file).read_text().strip()
        if text == "max" or int(text) >= NO_LIMIT:
            return None
        capacity = int(text)
        usage = int((directory / usage_file).read_text())
    except (OSError, ValueError):
        return None
    working_set = max(0, usage - _key_values(directory / "memory.stat").get(inactive, 0))
    return MemoryLimit("cgroup", capacity, max(0, capacity - working_set), str(directory))


def _key_values(path: Path) -> dict[str, int]:
    """`key value` or `Key: value kB` lines (memory.stat, /proc/meminfo)."""
    values = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.replace(":", " ").split()
            if len(parts) >= 2 and parts[1].isdigit():
                values[parts[0]] = int(parts[1])
    except OSError:
        pass
    return values
