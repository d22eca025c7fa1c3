"""Every Triton kernel the engine launches compiles for an H100 / H200 (sm_90) within its shared
memory and thread limits: Triton's real compiler, no GPU (`tests/support/hopper_compile.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "support" / "hopper_compile.py"


@pytest.mark.slow  # compiles every Triton kernel for sm_90
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


# The sliding-window specialisations of the attention kernels (WINDOW=True), launched as a
# windowed layer launches them, through the same sm_90 driver.
WINDOWED = """
import sys
import torch
sys.path.insert(0, {support!r})
from hopper_compile import hopper_target
from berth import kernels
from berth.kernels.synthetic_batch import random_paged_batch
from berth.kernels.triton_kernels.attention_decode import decode_attention

with hopper_target() as compiled, kernels.use_backend("triton"):
    for dtype in (torch.bfloat16, torch.float32):
        for q_heads, kv_heads, head_dim in ((32, 8, 128), (4, 2, 16)):
            seqs = ((0, 40), (20, 13), (300, 1), (5, 1))
            batch = random_paged_batch(seqs, 2, q_heads, kv_heads, head_dim, 16, dtype)
            md, scale = batch.metadata, head_dim**-0.5
            kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache, md, scale, 4096)
            rows = slice(md.num_prefills, md.num_seqs)
            decode_attention(
                torch.empty_like(batch.query), batch.query[md.num_prefill_tokens :], batch.key_cache,
                batch.value_cache, md.query_start_loc[rows], md.seq_lens[rows], md.block_tables[rows],
                md.max_seq_len, scale, segment_len=64, window=4096,
            )
print(" ".join(sorted({{name for name, _, _ in compiled}})))
"""


def test_the_sliding_window_kernels_compile_for_sm90():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = WINDOWED.format(support=str(SCRIPT.parent))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compiled = set(result.stdout.split())
    assert compiled == {"_prefill_attention_kernel", "_decode_segment_kernel", "_decode_merge_kernel"}
