"""`berth generate MODEL_DIR`: generate from prompts through the LLM API; prints text and speed."""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = ["Hello, world!", "The quick brown fox", "Kubernetes operators", "def add(a, b):"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face model directory (see `berth make-tiny-model`)")
    parser.add_argument(
        "--prompt", action="append", dest="prompts", help="repeat for several (default: a few)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--dtype", default="auto")


def run(args: argparse.Namespace) -> int:
    from berth.engine import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        )
    except ValueError as error:
        raise SystemExit(f"berth generate: {error}") from None
    prompts = args.prompts or DEFAULT_PROMPTS
    try:
        llm = LLM(args.model, dtype=args.dtype, max_batch_size=args.max_batch_size)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"berth generate: {error}") from None
    with llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up: first-call costs are not speed
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    print(
        f"{len(prompts)} prompts, {generated} tokens in {elapsed:.3f} s: {generated / elapsed:.1f} tokens/s"
    )
    return 0
