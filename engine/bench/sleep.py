"""`berth bench sleep MODEL_DIR`: how fast an engine sleeps and wakes, and what it gives back.

For each level, in one run: the KV pool is filled (prompts whose tokens write every block, so
the pool is resident, not just reserved), then the engine sleeps, then wakes. Reported per
level: the time to PARKED and back to RUNNING as the caller waits for them, the engine
process's resident memory (RSS, read from /proc/PID/statm) before, asleep, and after waking and filling
the pool again, what it freed as a share of what it held (the KV pool; plus the weights at
level 2), and whether greedy outputs of a fixed prompt set are the same after as before.
On a GPU it also shows torch's CUDA allocator's count asleep (as the engine reports it).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

MiB = 1 << 20
# What "near zero" means for torch's CUDA allocator after a level-2 sleep: the odd small tensor
# (a sampler's generator state), never a weight or the KV cache.
CUDA_NEAR_ZERO = 4 * MiB


@dataclass
class LevelRun:
    level: int
    sleep_seconds: float
    wake_seconds: float
    kv_bytes: int
    weight_bytes: int
    rss_before: int
    rss_asleep: int
    rss_after: int
    device_allocated_asleep: int | None
    same_outputs: bool

    @property
    def held(self) -> int:
        return self.kv_bytes + (self.weight_bytes if self.level == 2 else 0)

    @property
    def freed(self) -> int:
        return self.rss_before - self.rss_asleep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV pool size in blocks (default 1024)")
    parser.add_argument("--kv-block-size", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32, help="max_batch_size of the engine")
    parser.add_argument("--executor", choices=("proxy", "in-process"), default="proxy")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--no-fill", dest="fill", action="store_false", help="do not fill the KV pool first")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from berth.engine import LLM, SamplingParams
    from berth.engine.pyexecutor.sleep import resident_bytes

    try:
        llm = LLM(
            args.model,
            executor=args.executor,
            kv_cache_blocks=args.kv_blocks,
            kv_block_size=args.kv_block_size,
            max_batch_size=args.batch_size,
            dtype=args.dtype,
            device=args.device,
        )
    except (ValueError, OSError) as error:
        print(f"berth bench sleep: error: {error}", file=sys.stderr)
        return 2
    try:
        rng = random.Random(args.seed)
        ordinary = [t for t in range(len(llm.tokenizer)) if t not in set(llm.tokenizer.all_special_ids)]
        fill = _fill_prompts(llm.limits, ordinary, rng) if args.fill else []
        checks = [[rng.choice(ordinary) for _ in range(rng.randint(4, 32))] for _ in range(8)]
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        one_token = SamplingParams(temperature=0, max_tokens=1)
        pid = llm.executor.engine_pid
        limits = llm.limits
        print(
            f"model {args.model}, executor {args.executor} (engine pid {pid}), KV pool "
            f"{limits.num_kv_blocks} blocks of {limits.kv_block_size} tokens, fill {sum(map(len, fill))} "
            f"prompt tokens, {os.cpu_count()} CPUs"
        )
        runs = []
        for level in args.levels:
            llm.generate(fill, one_token)
            before = [o.outputs[0].token_ids for o in llm.generate(checks, greedy)]
            rss_before = resident_bytes(pid)
            started = time.perf_counter()
            slept = llm.sleep(level=level)
            sleep_seconds = time.perf_counter() - started
            rss_asleep = resident_bytes(pid)
            started = time.perf_counter()
            llm.wake_up()
            wake_seconds = time.perf_counter() - started
            after = [o.outputs[0].token_ids for o in llm.generate(checks, greedy)]
            llm.generate(fill, one_token)
            runs.append(
                LevelRun(
                    level=level,
                    sleep_seconds=sleep_seconds,
                    wake_seconds=wake_seconds,
                    kv_bytes=slept.memory_before.kv_cache_bytes,
                    weight_bytes=slept.memory_before.weight_bytes,
                    rss_before=rss_before,
                    rss_asleep=rss_asleep,
                    rss_after=resident_bytes(pid),
                    device_allocated_asleep=slept.memory_after.device_allocated_bytes,
                    same_outputs=before == after,
                )
            )
    finally:
        llm.shutdown()
    print(format_table(runs))
    failures = [f"level {r.level}: outputs differ after the wakeup" for r in runs if not r.same_outputs]
    failures += [
        f"level 2: CUDA memory still allocated asleep: {r.device_allocated_asleep / MiB:.1f} MiB"
        for r in runs
        if r.level == 2 and (r.device_allocated_asleep or 0) > CUDA_NEAR_ZERO
    ]
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


def _fill_prompts(limits, ordinary: list[int], rng: random.Random) -> list[list[int]]:
    """Prompts whose tokens write every block of the pool once (each at most a sequence long)."""
    pool_tokens = limits.num_kv_blocks * limits.kv_block_size
    length = max(limits.kv_block_size, min(limits.max_model_len - 1, pool_tokens))
    length -= length % limits.kv_block_size  # whole blocks: each prompt fills the blocks it takes
    count = -(-pool_tokens // length)
    return [[rng.choice(ordinary) for _ in range(length)] for _ in range(count)]


def format_table(runs: list[LevelRun]) -> str:
    header = (
        "level  to PARKED  to RUNNING  KV pool  weights   RSS before  RSS asleep  RSS after"
        "  freed     freed/held  same outputs"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        line = (
            f"{r.level:>5}  {r.sleep_seconds:7.3f} s  {r.wake_seconds:8.3f} s  {r.kv_bytes / MiB:5.1f} MB"
            f"  {r.weight_bytes / MiB:5.1f} MB  {r.rss_before / MiB:7.1f} MB  {r.rss_asleep / MiB:7.1f} MB"
            f"  {r.rss_after / MiB:6.1f} MB  {r.freed / MiB:6.1f} MB  {r.freed / max(1, r.held):9.0%}"
            f"   {'yes' if r.same_outputs else 'NO'}"
        )
        if r.device_allocated_asleep is not None:
            line += f"  (CUDA allocated asleep: {r.device_allocated_asleep / MiB:.1f} MB)"
        lines.append(line)
    lines.append(
        "freed = RSS before - RSS asleep; held = the KV pool (level 1) or the KV pool + weights (level 2). "
        "On a CPU level 1 keeps the weights (host memory is their device)."
    )
    lines.append("Targets for a tiny model: to PARKED <= 1 s, to RUNNING <= 2 s.")
    return "\n".join(lines)
