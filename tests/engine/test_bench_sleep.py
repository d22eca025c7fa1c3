"""`berth bench sleep` as a user runs it: one row per level with both transition times, the
engine's RSS before / asleep / after, what it freed, and outputs that are the same after."""

from __future__ import annotations

import re

import pytest

from tests.engine.test_cli import berth

MB = r"\s+(?P<{}>-?[\d.]+) MB"
ROW = re.compile(
    r"^\s+(?P<level>[12])\s+(?P<sleep>[\d.]+) s\s+(?P<wake>[\d.]+) s"
    + "".join(MB.format(name) for name in ("kv", "weights", "before", "asleep", "after", "freed"))
    + r"\s+-?\d+%\s+(?P<same>\w+)",
    re.MULTILINE,
)


@pytest.mark.slow  # runs `berth bench sleep`: an engine put to sleep and woken at each level
def test_bench_sleep_prints_a_row_per_level(tiny_model):
    result = berth("bench", "sleep", str(tiny_model), "--kv-blocks", "64", "--batch-size", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {int(m["level"]): m for m in ROW.finditer(result.stdout)}
    assert sorted(rows) == [1, 2], result.stdout
    for row in rows.values():
        assert row["same"] == "yes"
        assert float(row["sleep"]) > 0 and float(row["wake"]) > 0
        assert float(row["kv"]) == 0.5  # 64 blocks x 16 tokens x 512 bytes
        assert float(row["before"]) > 0 and float(row["asleep"]) > 0 and float(row["after"]) > 0
    assert "to PARKED <= 1 s" in result.stdout


def test_bench_sleep_refuses_bad_arguments(tiny_model):
    result = berth("bench", "sleep", str(tiny_model), "--levels", "3")
    assert result.returncode == 2 and "--levels" in result.stderr and "Traceback" not in result.stderr
    result = berth("bench", "sleep", str(tiny_model), "--kv-blocks", "0")
    assert result.returncode == 2 and "kv_cache_blocks" in result.stderr and "Traceback" not in result.stderr
