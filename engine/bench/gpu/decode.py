"""Decode speed on a random model with Llama-3-8B's shapes in bf16 (`checkpoint.py`):

- berth's batch-1 time per output token (TPOT) against the roofline: every weight read once per
  token, at the device's measured copy bandwidth; with CUDA graphs, and eagerly;
- output tokens/s at batch 1, 8, 32 and 64 (prompts of 128 tokens, 128 tokens out each, EOS
  ignored), berth against transformers' `generate` on the same checkpoint and prompts.

berth runs as in production (the proxy and a worker process). transformers runs eagerly with
its default dynamic KV cache: a static cache pays only with `torch.compile`, whose compile of an
8B model would take most of this check's budget.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

from berth.engine.bench.gpu.ceilings import copy_bandwidth
from berth.engine.bench.gpu.checkpoint import LLAMA3_8B, TINY, random_checkpoint, weight_bytes
from berth.engine.bench.gpu.result import CheckResult, check_main

PROMPT_LEN = 128
OUTPUT_LEN = 128
BATCH_SIZES = (1, 8, 32, 64)
TPOT_TOKENS = 64
# The bars: batch-1 decode with graphs at >= 80 % of the roofline, and berth >= 1.5x
# transformers at batch 32.
ROOFLINE_GOAL = 0.8
SPEEDUP_GOAL = 1.5


def prompts(count: int, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(count)]


def berth_seconds(llm, batch: list[list[int]], new_tokens: int) -> float:
    """Wall seconds for `batch` to generate `new_tokens` each (all submitted at once)."""
    from berth.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    outputs = llm.generate(batch, params)
    seconds = time.perf_counter() - started
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    if produced != new_tokens * len(batch):
        raise RuntimeError(f"berth produced {produced} tokens, expected {new_tokens * len(batch)}")
    return seconds


def hf_seconds(model, batch: list[list[int]], new_tokens: int) -> float:
    input_ids = torch.tensor(batch, device=model.device)  # equal lengths: no padding
    _synchronize(input_ids.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=model.generation_config.pad_token_id,
        )
    _synchronize(input_ids.device)
    seconds = time.perf_counter() - started
    if out.shape[1] != len(batch[0]) + new_tokens:
        raise RuntimeError(
            f"transformers produced {out.shape[1] - len(batch[0])} tokens, expected {new_tokens}"
        )
    return seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tpot(seconds_for, prompt: list[int]) -> float:
    """Seconds per output token at batch 1, without the prompt: (t(N tokens) - t(1)) / (N - 1),
    each the best of 3 runs."""
    seconds_for([prompt], 2)  # warm this prompt length
    one = min(seconds_for([prompt], 1) for _ in range(3))
    many = min(seconds_for([prompt], TPOT_TOKENS) for _ in range(3))
    return (many - one) / (TPOT_TOKENS - 1)


def throughput(seconds_for, batch_sizes: tuple[int, ...]) -> dict[int, float]:
    """Output tokens/s at each batch size, after a short warm-up run at that size."""
    rates = {}
    for size in batch_sizes:
        seconds_for(prompts(size, seed=99), 4)
        rates[size] = size * OUTPUT_LEN / seconds_for(prompts(size), OUTPUT_LEN)
    return rates


def check(result: CheckResult, dry_run: bool, workdir: Path) -> None:
    from berth.engine import LLM

    device = "cpu" if dry_run else "cuda"
    batch_sizes = (1, 2) if dry_run else BATCH_SIZES
    started = time.perf_counter()
    shapes = TINY if dry_run else LLAMA3_8B
    model_dir = random_checkpoint(
        workdir / ("tiny-random" if dry_run else "llama3-8b-random"), shapes, torch.bfloat16, device
    )
    weights = weight_bytes(model_dir)
    result.add(
        "checkpoint",
        f"{weights / 1e9:.2f} GB of bf16 weights, ready in {time.perf_counter() - started:.0f} s",
    )
    bandwidth = copy_bandwidth(torch.device(device), 64 << 20 if dry_run else 4 << 30)
    if device == "cuda":
        torch.cuda.empty_cache()
    roofline = weights / bandwidth
    result.metrics |= {
        "weight_bytes": weights,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "roofline_tpot_s": roofline,
    }
    result.add(
        "roofline TPOT (weights / copy bandwidth)", f"{1e3 * roofline:.2f} ms ({bandwidth / 1e12:.2f} TB/s)"
    )

    options = dict(
        device=device,
        dtype="bfloat16",
        max_batch_size=max(batch_sizes),
        kv_cache_memory=(16 << 30) if not dry_run else (64 << 20),
    )
    tpots = {}
    for mode, eager in (("CUDA graphs", False), ("eager", True)):
        loaded = time.perf_counter()
        with LLM(model_dir, enforce_eager=eager, **options) as llm:
            load_seconds = time.perf_counter() - loaded
            seconds_for = lambda batch, n, llm=llm: berth_seconds(llm, batch, n)  # noqa: E731
            tpots[mode] = tpot(seconds_for, prompts(1, seed=7)[0])
            share = roofline / tpots[mode]
            result.metrics[f"berth_tpot_s {mode}"] = tpots[mode]
            graph_goal = mode == "CUDA graphs" and not dry_run
            result.add(
                f"berth batch-1 TPOT, {mode}",
                f"{1e3 * tpots[mode]:.2f} ms = {100 * share:.0f} % of the roofline "
                f"(engine up in {load_seconds:.0f} s)",
                f">= {100 * ROOFLINE_GOAL:.0f} %" if graph_goal else "",
                share >= ROOFLINE_GOAL if graph_goal else None,
            )
            if not eager:
                berth_rates = throughput(seconds_for, batch_sizes)
                result.metrics["berth_tokens_per_s"] = berth_rates
    result.add(
        "CUDA graphs vs eager, batch-1 TPOT",
        f"{tpots['eager'] / tpots['CUDA graphs']:.2f}x faster with graphs"
        if not dry_run
        else "(no graphs on a CPU)",
    )

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map=device).eval()
    seconds_for = lambda batch, n: hf_seconds(hf, batch, n)  # noqa: E731
    result.note("transformers runs eagerly with its default dynamic KV cache (no torch.compile)")
    hf_tpot = tpot(seconds_for, prompts(1, seed=7)[0])
    result.metrics["transformers_tpot_s"] = hf_tpot
    result.add(
        "transformers batch-1 TPOT",
        f"{1e3 * hf_tpot:.2f} ms (berth with graphs {hf_tpot / tpots['CUDA graphs']:.2f}x faster)",
    )
    hf_rates = throughput(seconds_for, batch_sizes)
    result.metrics["transformers_tokens_per_s"] = hf_rates
    for size in batch_sizes:
        ratio = berth_rates[size] / hf_rates[size]
        goal = size == 32
        result.add(
            f"output tokens/s at batch {size}",
            f"berth {berth_rates[size]:,.0f}, transformers {hf_rates[size]:,.0f}: {ratio:.2f}x",
            f">= {SPEEDUP_GOAL}x" if goal else "",
            ratio >= SPEEDUP_GOAL if goal else None,
        )


def main(argv: list[str] | None = None) -> int:
    return check_main("decode", __doc__.split("\n")[0], check, argv)


if __name__ == "__main__":
    sys.exit(main())
