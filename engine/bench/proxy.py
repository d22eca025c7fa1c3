"""`berth bench proxy MODEL_DIR`: the proxy + worker shape against the in-process engine.

Both shapes run the same synthetic workload in one run, greedy, every request generating
exactly its drawn number of tokens (EOS ignored), all requests submitted at once:

- offline: `LLM.generate` (whole outputs), for throughput;
- streaming: every request streamed to an asyncio consumer, for throughput and time to first
  token (submit -> first token seen by the consumer).

The shapes take turns for `--rounds` rounds (machine noise is several percent); each shape
reports its best offline and its best streaming round.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

from berth.engine.bench.workload import WorkItem, add_workload_arguments, describe_workload, make_workload

SHAPES = ("in-process", "proxy")


@dataclass
class Measurement:
    offline_tokens_per_s: float
    streaming_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory")
    add_workload_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="max_batch_size of the engine")
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2, help="turns per shape; the best one counts")


def run(args: argparse.Namespace) -> int:
    import torch

    from berth.engine import LLM, SamplingParams

    best: dict[str, Measurement] = {}
    workload: list[WorkItem] | None = None
    for round_index in range(args.rounds):
        for shape in SHAPES:
            llm = LLM(
                args.model, executor=shape, max_batch_size=args.batch_size, max_num_tokens=args.max_num_tokens
            )
            try:
                if workload is None:
                    tokenizer = llm.tokenizer
                    workload = make_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
                    _describe(args, workload, torch.get_num_threads())
                measured = _measure(llm, workload, SamplingParams)
            finally:
                llm.shutdown()
            print(
                f"round {round_index + 1} {shape:>10}: offline {measured.offline_tokens_per_s:9.1f} tok/s, "
                f"streaming {measured.streaming_tokens_per_s:9.1f} tok/s, TTFT p50 "
                f"{measured.ttft_p50_ms:7.1f} ms p99 {measured.ttft_p99_ms:7.1f} ms"
            )
            best[shape] = _better(best.get(shape), measured)
    _report(best["in-process"], best["proxy"])
    return 0


def _better(old: Measurement | None, new: Measurement) -> Measurement:
    """The best of each: offline throughput, and streaming throughput with that round's TTFTs."""
    if old is None:
        return new
    streaming = new if new.streaming_tokens_per_s > old.streaming_tokens_per_s else old
    return Measurement(
        offline_tokens_per_s=max(old.offline_tokens_per_s, new.offline_tokens_per_s),
        streaming_tokens_per_s=streaming.streaming_tokens_per_s,
        ttft_p50_ms=streaming.ttft_p50_ms,
        ttft_p99_ms=streaming.ttft_p99_ms,
    )


def _describe(args: argparse.Namespace, workload: list[WorkItem], threads: int) -> None:
    print(f"{describe_workload(args, workload)}; batch size {args.batch_size}; torch threads {threads}")


def _measure(llm, workload: list[WorkItem], sampling_params) -> Measurement:
    prompts = [item.prompt_token_ids for item in workload]
    params = [sampling_params(temperature=0, max_tokens=i.output_len, ignore_eos=True) for i in workload]
    expected = sum(item.output_len for item in workload)
    llm.generate(prompts[:4], sampling_params(max_tokens=4))  # warm-up: first-call costs are not speed

    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    offline_seconds = time.perf_counter() - started
    _check_count(sum(len(o.outputs[0].token_ids) for o in outputs), expected)

    streaming_seconds, ttfts, produced = asyncio.run(_stream_all(llm, prompts, params))
    _check_count(produced, expected)
    ttfts.sort()
    return Measurement(
        offline_tokens_per_s=expected / offline_seconds,
        streaming_tokens_per_s=expected / streaming_seconds,
        ttft_p50_ms=1000 * statistics.median(ttfts),
        ttft_p99_ms=1000 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
    )


async def _stream_all(llm, prompts, params) -> tuple[float, list[float], int]:
    async def consume(result, submitted: float) -> tuple[float, int]:
        first = None
        count = 0
        async for update in result:
            if first is None and update.outputs[0].token_ids:
                first = time.perf_counter() - submitted
            count = len(update.outputs[0].token_ids)
        return first, count

    started = time.perf_counter()
    consumers = []
    for prompt, sampling in zip(prompts, params):
        result = llm.generate_async(prompt, sampling, streaming=True)
        consumers.append(consume(result, time.perf_counter()))
    done = await asyncio.gather(*consumers)
    elapsed = time.perf_counter() - started
    return elapsed, [ttft for ttft, _ in done], sum(count for _, count in done)


def _check_count(produced: int, expected: int) -> None:
    if produced != expected:
        raise RuntimeError(f"produced {produced} tokens, expected {expected}")


def _report(in_process: Measurement, proxy: Measurement) -> None:
    print(
        f"proxy / in-process throughput: offline "
        f"{proxy.offline_tokens_per_s / in_process.offline_tokens_per_s:.3f}x, streaming "
        f"{proxy.streaming_tokens_per_s / in_process.streaming_tokens_per_s:.3f}x"
    )
    print(
        f"TTFT p50 {in_process.ttft_p50_ms:.1f} -> {proxy.ttft_p50_ms:.1f} ms, "
        f"p99 {in_process.ttft_p99_ms:.1f} -> {proxy.ttft_p99_ms:.1f} ms (in-process -> proxy)"
    )
