"""`berth bench wake` as a user runs it: the first token of a request to a world that serves,
sleeps, or was released, each next to what it waited for (the engine's wake, a cold start)."""

from __future__ import annotations

import re

import pytest

from tests.engine.test_cli import berth

ROW = re.compile(
    r"^(?P<scenario>awake|asleep|released)\s+(?P<ttft>[\d.]+) s\s+(?P<what>.+?)\s{2,}", re.MULTILINE
)


@pytest.mark.slow  # runs `berth bench wake`: servers, an activator, sleeps and cold starts
def test_bench_wake_prints_each_first_token_next_to_what_it_waited_for(tiny_model):
    result = berth("bench", "wake", str(tiny_model), "--max-tokens", "4", "--serve-args", "--kv-blocks 64")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {m["scenario"]: m for m in ROW.finditer(result.stdout)}
    assert sorted(rows) == ["asleep", "awake", "released"], result.stdout
    assert all(float(row["ttft"]) > 0 for row in rows.values())
    assert (
        rows["asleep"]["what"] == "engine wake (level 1)" and rows["released"]["what"] == "cold world start"
    )
    assert re.search(r"released / asleep: [\d.]+x", result.stdout)
