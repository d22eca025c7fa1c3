"""A synthetic workload: random prompts and output lengths from stated distributions, fixed seed."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=(16, 256),
        metavar=("MIN", "MAX"),
        help="prompt lengths, uniform in [MIN, MAX] (default 16 256)",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(16, 256),
        metavar=("MIN", "MAX"),
        help="output lengths, uniform in [MIN, MAX] (default 16 256)",
    )
    parser.add_argument("--seed", type=int, default=0)


def make_workload(args: argparse.Namespace, vocab_size: int, reserved_ids: set[int]) -> list[WorkItem]:
    """Prompts are random ordinary token ids (no special tokens); lengths uniform in the ranges."""
    rng = random.Random(args.seed)
    ordinary = [t for t in range(vocab_size) if t not in reserved_ids]
    items = []
    for _ in range(args.num_requests):
        prompt_len = rng.randint(*args.input_len)
        items.append(
            WorkItem([rng.choice(ordinary) for _ in range(prompt_len)], rng.randint(*args.output_len))
        )
    return items


def describe_workload(args: argparse.Namespace, workload: list[WorkItem]) -> str:
    """One line for a benchmark's report: the workload's size and the distributions it came from."""
    total_in = sum(len(item.prompt_token_ids) for item in workload)
    total_out = sum(item.output_len for item in workload)
    return (
        f"workload: {len(workload)} requests, {total_in} prompt tokens, {total_out} output tokens "
        f"(prompt {args.input_len[0]}-{args.input_len[1]}, output {args.output_len[0]}-{args.output_len[1]}, "
        f"seed {args.seed})"
    )
