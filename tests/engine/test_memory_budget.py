"""Sizing the KV pool: the limits read from cgroup v1 / v2 trees and /proc (fake ones here;
tests/serve/test_serve_memory.py runs a real cgroup), the plan's arithmetic and its refusals,
the profiled step, and the fraction the operator passes in the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from berth.engine.config import EngineConfig
from berth.engine.models.loader import load_model
from berth.engine.pyexecutor.memory_budget import (
    MemoryBudgetError,
    MemoryLimit,
    cgroup_limit,
    host_limits,
    plan_kv_cache,
)
from berth.engine.pyexecutor.profile_run import activation_peak_bytes, profile_sequence_lengths
from berth.engine.serve.arguments import byte_count

MiB, GiB = 1 << 20, 1 << 30
V1_UNLIMITED = 9223372036854771712


def fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "meminfo").write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    return proc


def write(directory: Path, **files: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name.replace("_", ".", 1)).write_text(str(value))


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
V1_MOUNT = (
    "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
)


def test_cgroup_v2_limit_is_the_tightest_of_the_process_cgroup_and_its_ancestors(tmp_path):
    proc = fake_proc(tmp_path, "0::/kubepods/pod1/container\n", V2_MOUNT)
    root = tmp_path / "cgroup"
    write(root / "kubepods", memory_max="max", memory_current=5 * GiB, memory_stat="inactive_file 0\n")
    write(
        root / "kubepods" / "pod1",
        memory_max=4 * GiB,
        memory_current=3 * GiB,
        memory_stat="anon 1\ninactive_file 1073741824\n",  # page cache the kernel reclaims first
    )
    write(root / "kubepods" / "pod1" / "container", memory_max="max", memory_current=GiB)
    limit = cgroup_limit(proc, root)
    assert limit == MemoryLimit("cgroup", 4 * GiB, 2 * GiB, str(root / "kubepods" / "pod1"))


def test_cgroup_v1_limit_and_unlimited_values(tmp_path):
    proc = fake_proc(tmp_path, "5:cpu:/\n4:memory:/pod/ctr\n", V1_MOUNT)
    root = tmp_path / "memory"
    write(root, memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=GiB)
    write(root / "pod", memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=GiB)
    write(
        root / "pod" / "ctr",
        memory_limit_in_bytes=2 * GiB,
        memory_usage_in_bytes=GiB,
        memory_stat="cache 5\ntotal_inactive_file 268435456\n",
    )
    assert cgroup_limit(proc, root) == MemoryLimit(
        "cgroup", 2 * GiB, 2 * GiB - 768 * MiB, str(root / "pod/ctr")
    )
    (root / "pod" / "ctr" / "memory.limit_in_bytes").write_text(str(V1_UNLIMITED))
    assert cgroup_limit(proc, root) is None  # "huge" means no limit
    limits = host_limits(proc, root)
    assert limits == [MemoryLimit("host", 24000000 * 1024, 20000000 * 1024)]


def test_a_containers_own_cgroup_is_the_mount_root_in_a_cgroup_namespace(tmp_path):
    """In a pod, /proc/self/cgroup says "/" (or a path outside the mount): the limit is the
    mount root's own."""
    proc = fake_proc(tmp_path, "0::/\n", V2_MOUNT)
    root = tmp_path / "cgroup"
    write(root, memory_max=3 * GiB, memory_current=GiB)
    assert cgroup_limit(proc, root) == MemoryLimit("cgroup", 3 * GiB, 2 * GiB, str(root))
    proc = fake_proc(tmp_path / "other", "0::/../../elsewhere\n", V2_MOUNT)
    assert cgroup_limit(proc, root).capacity == 3 * GiB
    both = host_limits(proc, root)
    assert [limit.source for limit in both] == ["host", "cgroup"]


def plan(**changes):
    arguments = dict(
        limits=[MemoryLimit("host", 24 * GiB, 20 * GiB), MemoryLimit("cgroup", 4 * GiB, 3 * GiB)],
        bytes_per_block=MiB,
        block_size=16,
        dtype="float32",
        min_blocks=64,
        max_useful_blocks=10**6,
        activation_peak=200 * MiB,
        memory_fraction=0.5,
        headroom=256 * MiB,
    )
    return plan_kv_cache(**(arguments | changes))


def test_the_tightest_limit_binds_after_activations_and_headroom():
    sized = plan()
    # (3 GiB free - 200 MiB - 256 MiB) * 0.5 = 1308 MiB: 1308 blocks of 1 MiB.
    assert (sized.num_blocks, sized.limit_source, sized.limit_bytes) == (1308, "cgroup", 4 * GiB)
    assert (sized.pool_bytes, sized.bytes_per_token, sized.num_tokens) == (1308 * MiB, MiB // 16, 1308 * 16)
    assert plan(max_useful_blocks=100).num_blocks == 100  # never more than the batch can use
    host_bound = plan(
        limits=[MemoryLimit("host", 24 * GiB, 2 * GiB), MemoryLimit("cgroup", 8 * GiB, 7 * GiB)]
    )
    assert host_bound.limit_source == "host" and host_bound.num_blocks == (2048 - 456) // 2
    assert "limit 4.00 GiB from cgroup" in sized.describe()
    assert sized.describe().startswith("KV cache: 1308 blocks = 1.28 GiB (20928 tokens of context)")


def test_too_little_for_one_full_length_sequence_is_refused_with_the_numbers():
    with pytest.raises(MemoryBudgetError) as refused:
        plan(min_blocks=2000)
    message = str(refused.value)
    assert "one full-length sequence: it needs 2000 KV blocks (1.95 GiB)" in message
    assert "holds 1308" in message and "the cgroup limit" in message and "is 4.00 GiB" in message
    assert "activations take 200 MiB" in message and "headroom is 256 MiB" in message


def test_overrides_are_taken_as_given_but_must_fit():
    assert plan(explicit_blocks=10, min_blocks=2000).num_blocks == 10  # a small pool by choice
    by_bytes = plan(explicit_bytes=100 * MiB + 5)
    assert (by_bytes.num_blocks, by_bytes.limit_source, by_bytes.limit_bytes) == (100, "flag", 100 * MiB)
    with pytest.raises(MemoryBudgetError, match=r"\(3000 blocks = 2.93 GiB\) does not fit: the cgroup"):
        plan(explicit_blocks=3000)
    with pytest.raises(MemoryBudgetError, match="less than one KV block"):
        plan(explicit_bytes=5)


def test_profile_lengths_fill_the_step_within_the_sequence_limit():
    assert profile_sequence_lengths(2048, 8192, 64) == [2048]
    assert profile_sequence_lengths(2048, 1000, 64) == [999, 999, 50]
    assert profile_sequence_lengths(2048, 100, 2) == [99, 99]  # the batch cannot hold more


def test_profiled_activations_grow_with_the_step(tiny_model):
    model = load_model(str(tiny_model), "float32", torch.device("cpu"))
    c = model.config

    def peak(tokens: int) -> int:
        return activation_peak_bytes(
            model, [tokens], num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            kv_dtype=torch.float32, block_size=16, device=torch.device("cpu"),
        )  # fmt: skip

    small, large = peak(8), peak(1000)
    # 1000 tokens' hidden states, MLP and QKV activations in float32 are megabytes.
    assert large > 2 * MiB and large > small
    # A process that has freed memory before (steps, other tests) keeps those pages resident
    # for reuse; the profile must still count its step's activations.
    freed = [torch.ones(n) for n in [1 << 16, 1 << 18, 1 << 20, 1 << 22] * 8]
    del freed
    peak(1000)
    assert peak(1000) > 2 * MiB


def test_the_fraction_comes_from_the_environment_the_operator_sets(monkeypatch):
    monkeypatch.setenv("BERTH_KV_CACHE_MEMORY_FRACTION", "0.6")
    assert EngineConfig(model="m").kv_cache_memory_fraction == 0.6
    assert EngineConfig(model="m", kv_cache_memory_fraction=0.8).kv_cache_memory_fraction == 0.8
    monkeypatch.setenv("BERTH_KV_CACHE_MEMORY_FRACTION", "lots")
    with pytest.raises(ValueError, match="BERTH_KV_CACHE_MEMORY_FRACTION must be a number"):
        EngineConfig(model="m")
    monkeypatch.setenv("BERTH_KV_CACHE_MEMORY_FRACTION", "1.5")
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\]"):
        EngineConfig(model="m")
    monkeypatch.delenv("BERTH_KV_CACHE_MEMORY_FRACTION")
    assert EngineConfig(model="m").kv_cache_memory_fraction == 0.9


def test_kv_cache_options_are_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(model="m", kv_cache_blocks=4, kv_cache_memory=1 << 20)
    assert [byte_count(text) for text in ("4Gi", "512Mi", "2G", "1000000", "1.5GiB")] == [
        4 * GiB, 512 * MiB, 2 * 10**9, 10**6, 3 * GiB // 2,
    ]  # fmt: skip
