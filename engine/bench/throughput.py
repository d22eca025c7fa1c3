"""`berth bench throughput MODEL_DIR`: offline throughput of berth against transformers.

Both run the same synthetic workload, greedy, every request generating exactly its drawn
number of tokens (EOS ignored). transformers runs static batches of `--batch-size` prompts
(left-padded; a batch runs until its longest output is done, as static batching does);
berth gets all requests at once and batches them continuously with the same batch size.
Throughput counts the requested output tokens only.
"""

from __future__ import annotations

import argparse
import time

from berth.engine.bench.workload import WorkItem, add_workload_arguments, describe_workload, make_workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory")
    add_workload_arguments(parser)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="berth's max_batch_size = HF's static batch"
    )
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--executor", default="in-process", help="berth's executor shape")
    parser.add_argument("--skip-hf", action="store_true", help="measure berth only")


def run(args: argparse.Namespace) -> int:
    import torch

    from berth.engine import LLM, SamplingParams

    llm = LLM(
        args.model, max_batch_size=args.batch_size, max_num_tokens=args.max_num_tokens, executor=args.executor
    )
    tokenizer = llm.tokenizer
    workload = make_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    total_out = sum(item.output_len for item in workload)
    threads = torch.get_num_threads()
    print(f"{describe_workload(args, workload)}; batch size {args.batch_size}; torch threads {threads}")
    berth_seconds = run_berth(llm, workload, SamplingParams)
    llm.shutdown()
    print(f"berth:        {berth_seconds:8.2f} s  {total_out / berth_seconds:10.1f} output tok/s")
    if args.skip_hf:
        return 0
    hf_seconds = _run_transformers(args.model, workload, args.batch_size)
    print(f"transformers: {hf_seconds:8.2f} s  {total_out / hf_seconds:10.1f} output tok/s")
    print(f"ratio berth / transformers: {hf_seconds / berth_seconds:.2f}x")
    return 0


def run_berth(llm, workload: list[WorkItem], sampling_params) -> float:
    """Seconds `llm.generate` takes for the whole workload (after a warm-up); also `berth bench
    serve`'s offline baseline."""
    params = [
        sampling_params(temperature=0, max_tokens=item.output_len, ignore_eos=True) for item in workload
    ]
    llm.generate(
        [item.prompt_token_ids[:8] for item in workload[:4]], sampling_params(max_tokens=4)
    )  # warm-up
    started = time.perf_counter()
    outputs = llm.generate([item.prompt_token_ids for item in workload], params)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(item.output_len for item in workload)
    if produced != expected:
        raise RuntimeError(f"berth produced {produced} tokens, expected {expected}")
    return elapsed


def _run_transformers(model_dir: str, workload: list[WorkItem], batch_size: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(batch: list[WorkItem]) -> None:
        width = max(len(item.prompt_token_ids) for item in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, item in enumerate(batch):
            ids[row, width - len(item.prompt_token_ids) :] = torch.tensor(item.prompt_token_ids)
            mask[row, width - len(item.prompt_token_ids) :] = 1
        longest = max(item.output_len for item in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=pad,
            )

    generate(workload[:2])  # warm-up
    started = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        generate(workload[start : start + batch_size])
    return time.perf_counter() - started
