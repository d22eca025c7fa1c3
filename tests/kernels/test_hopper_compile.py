"""Every Triton kernel the engine launches compiles for an H100 / H200 (sm_90) within its shared
memory and thread limits: Triton's real compiler, no GPU (`tests/support/hopper_compile.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "support" / "hopper_compile.py"


def test_every_kernel_compiles_for_sm90_in_every_dtype():
    # In a process of its own: this one runs Triton in its interpreter (kernels/conftest.py).
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    compiled = {line.split()[3] for line in lines if line.startswith("compiled for sm_90")}
    assert compiled == {
        "_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_embedding_kernel", "_write_kv_cache_kernel",
        "_prefill_attention_kernel", "_decode_segment_kernel", "_decode_merge_kernel", "_gemv_kernel",
    }  # fmt: skip
