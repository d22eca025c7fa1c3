"""`berth bench throughput MODEL --shared-prefix-len L`: prefix caching on vs off, in one run.

A chat-like workload: every request starts with the same L-token system prompt, followed by
its own prompt and output lengths drawn from `--input-len` / `--output-len` (fixed seed). The
workload runs through `LLM.generate`'s engine twice, prefix caching off, then on, with the same
engine options, each after a warm-up of the same shapes with another system prompt (so that
neither run pays the process's first large steps, and the warm-up leaves nothing to reuse).
Each run reports output throughput, time to first token (from submission to the engine step
that produced the request's first token: all requests arrive at once, so it includes their
wait in the queue) and how much of the prompts the prefix cache served.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from berth.engine.bench.workload import WorkItem, describe_workload, make_workload


@dataclass
class Run:
    seconds: float
    output_tokens: int
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    def ttft(self, quantile: float) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]

    @property
    def mean_ttft(self) -> float:
        return sum(self.ttfts) / len(self.ttfts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        metavar="L",
        help="give every prompt the same L-token system prompt and compare prefix caching on vs off",
    )


def with_shared_prefix(
    args: argparse.Namespace, vocab_size: int, reserved_ids: set[int], *, salt: int = 0
) -> list[WorkItem]:
    """The workload of `make_workload`, each prompt behind one system prompt of L ordinary tokens
    (another one for each `salt`)."""
    rng = random.Random(f"{args.seed}-{salt}")
    ordinary = [t for t in range(vocab_size) if t not in reserved_ids]
    system = [rng.choice(ordinary) for _ in range(args.shared_prefix_len)]
    items = make_workload(args, vocab_size, reserved_ids)
    return [WorkItem(system + item.prompt_token_ids, item.output_len) for item in items]


def run(args: argparse.Namespace) -> int:
    from berth.engine import LLM

    if args.shared_prefix_len < 1:
        raise SystemExit(
            f"berth bench throughput: --shared-prefix-len must be >= 1, got {args.shared_prefix_len}"
        )
    runs: dict[bool, Run] = {}
    workload: list[WorkItem] = []
    warm_up: list[WorkItem] = []
    for caching in (False, True):
        with LLM(
            args.model,
            max_batch_size=args.batch_size,
            max_num_tokens=args.max_num_tokens,
            executor=args.executor,
            enable_prefix_caching=caching,
        ) as llm:
            if not workload:
                vocab_size, special = len(llm.tokenizer), set(llm.tokenizer.all_special_ids)
                workload = with_shared_prefix(args, vocab_size, special)
                warm_up = with_shared_prefix(args, vocab_size, special, salt=1)[: 2 * args.batch_size]
                print(
                    f"{describe_workload(args, workload)}; a shared system prompt of "
                    f"{args.shared_prefix_len} tokens; batch size {args.batch_size}"
                )
            measure(llm, warm_up)
            runs[caching] = measure(llm, workload)
    for caching, measured in runs.items():
        print(
            f"prefix caching {'on ' if caching else 'off'}: {measured.seconds:8.2f} s "
            f"{measured.tokens_per_second:10.1f} output tok/s  TTFT mean {1000 * measured.mean_ttft:8.1f} ms "
            f"median {1000 * measured.ttft(0.5):8.1f} ms  p99 {1000 * measured.ttft(0.99):8.1f} ms  "
            f"prompt tokens from the cache {measured.cached_tokens / measured.prompt_tokens:6.1%}"
        )
    on, off = runs[True], runs[False]
    print(
        f"ratio on / off: throughput {on.tokens_per_second / off.tokens_per_second:.2f}x, "
        f"mean TTFT {on.mean_ttft / off.mean_ttft:.2f}x"
    )
    return 0


def measure(llm, workload: list[WorkItem]) -> Run:
    """The workload submitted at once; what it took."""
    from berth.engine import SamplingParams

    before = llm.executor.stats
    started = time.perf_counter()
    results = [
        # Streamed: each step's tokens come back as it runs, stamped with the step's time.
        llm.generate_async(
            item.prompt_token_ids,
            SamplingParams(temperature=0, max_tokens=item.output_len, ignore_eos=True, detokenize=False),
            streaming=True,
        )
        for item in workload
    ]
    outputs = [result.result() for result in results]
    seconds = time.perf_counter() - started
    after = llm.executor.stats
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(item.output_len for item in workload)
    if produced != expected:
        raise RuntimeError(f"berth produced {produced} tokens, expected {expected}")
    return Run(
        seconds=seconds,
        output_tokens=produced,
        ttfts=[r.token_step_times[0] - r.request.arrival_time for r in results],
        prompt_tokens=sum(len(item.prompt_token_ids) for item in workload),
        cached_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
    )
