"""Sleep and wakeup on CUDA, on the Llama-3-8B-shaped checkpoint the decode check wrote: the
device's free memory (`torch.cuda.mem_get_info`, the whole device: the engine runs in a worker
process) awake, asleep at level 1 and at level 2, and awake again; how long each wakeup takes;
and whether a greedy generation after waking equals the one before.

Level 1 moves the weights to (pinned) host memory and frees the KV cache; level 2 drops the
weights, and the wakeup reloads them from the checkpoint. Each must give back at least 90 % of
what the engine held on the device (KV cache, plus the weights).

The prompts go one at a time: under continuous batching, which requests share a step depends on
when each reaches the engine, and a step of another shape rounds differently (other GEMM
kernels); on a random model, whose greedy choices are close calls, that alone changes tokens.
One at a time, every step has the same shape before and after, so the tokens must be equal.
Prefix caching is off for the same reason (a cached prefix is another computation)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from berth.engine.bench.gpu.checkpoint import LLAMA3_8B, TINY, random_checkpoint
from berth.engine.bench.gpu.decode import prompts
from berth.engine.bench.gpu.result import CheckResult, check_main

FREED_GOAL = 0.9


def device_free_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def check(result: CheckResult, dry_run: bool, workdir: Path) -> None:
    from berth.engine import LLM, SamplingParams

    device = "cpu" if dry_run else "cuda"
    shapes = TINY if dry_run else LLAMA3_8B
    model_dir = random_checkpoint(
        workdir / ("tiny-random" if dry_run else "llama3-8b-random"), shapes, torch.bfloat16, device
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    batch = prompts(4, seed=3)
    kv_bytes = (64 << 20) if dry_run else (16 << 30)
    with LLM(
        model_dir,
        device=device,
        dtype="bfloat16",
        max_batch_size=8,
        kv_cache_memory=kv_bytes,
        enable_prefix_caching=False,
    ) as llm:

        def generate() -> list[list[int]]:
            return [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in batch]

        before = generate()
        awake = device_free_bytes(device)
        for level in (1, 2):
            slept = llm.sleep(level=level)
            held = slept.memory_before
            asleep = device_free_bytes(device)
            woken = time.perf_counter()
            llm.wake_up()
            wake_seconds = time.perf_counter() - woken
            after = generate()
            again = device_free_bytes(device)
            engine_held = held.kv_cache_bytes + held.weight_bytes
            result.metrics[f"level{level}"] = {
                "held_kv_cache_bytes": held.kv_cache_bytes,
                "held_weight_bytes": held.weight_bytes,
                "device_free_awake": awake,
                "device_free_asleep": asleep,
                "device_free_after": again,
                "sleep_seconds": slept.seconds,
                "wake_seconds": wake_seconds,
                "engine_allocated_asleep": slept.memory_after.device_allocated_bytes,
            }
            if awake is not None:
                freed = asleep - awake
                result.add(
                    f"level {level} sleep frees on the device",
                    f"{freed / 2**30:.2f} GiB of {engine_held / 2**30:.2f} GiB held (KV cache "
                    f"{held.kv_cache_bytes / 2**30:.2f} + weights {held.weight_bytes / 2**30:.2f}) = "
                    f"{100 * freed / engine_held:.0f} %; asleep {slept.seconds:.1f} s after asking",
                    f">= {100 * FREED_GOAL:.0f} %",
                    freed >= FREED_GOAL * engine_held,
                )
                result.add(
                    f"level {level} wakeup",
                    f"{wake_seconds:.1f} s; device free memory back to {again / 2**30:.1f} GiB "
                    f"(awake before: {awake / 2**30:.1f})",
                )
            else:
                result.add(f"level {level} sleep / wakeup", f"{slept.seconds:.2f} s / {wake_seconds:.2f} s")
            result.add(
                f"level {level}: greedy tokens after waking",
                "identical to before" if after == before else "DIFFERENT from before",
                "identical",
                after == before,
            )
            awake = again


def main(argv: list[str] | None = None) -> int:
    return check_main("sleep", __doc__.split("\n")[0], check, argv)


if __name__ == "__main__":
    sys.exit(main())
