"""The engine on CUDA against transformers on CUDA: greedy tokens of a random-weight Llama and
Qwen2, in float32 (equal but for near-ties) and bfloat16 (the low-precision rule), with decode
steps replayed from CUDA graphs and run eagerly (`enforce_eager`); the rules are
`bench/parity_rules.py`'s, as on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from berth.engine.bench.gpu.result import CheckResult, check_main
from berth.engine.bench.parity_rules import (
    close_parity_problem,
    exact_parity_problem,
    hf_greedy,
    prompts_of_many_lengths,
)

MAX_NEW = 16
# bfloat16's rounding is relative, so its error on a log-probability grows with the logits: the
# random models' (init std 0.25) are several times a trained model's, for which the CPU tests
# allow 0.15 (tests/engine/test_real_model.py).
BF16_LOGPROB_TOLERANCE = 0.3
MODELS = {  # name -> make_tiny_model's arguments (the suite's fixtures: tests/conftest.py)
    "llama": dict(seed=0),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=False, seed=1),
}


def berth_greedy(model_dir: Path, device: str, dtype: str, prompts: list[list[int]], **options) -> tuple:
    """(completions, the engine's decode-graph replays) for greedy runs of `prompts`."""
    from berth.engine import LLM, SamplingParams

    with LLM(
        model_dir,
        executor="in-process",
        device=device,
        dtype=dtype,
        max_batch_size=8,
        max_num_tokens=32,  # the longer prompts take several prefill chunks
        kv_cache_memory=256 << 20,
        **options,
    ) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5))
        graphs = llm.executor.engine.model_runner.decode_graphs
        replays = graphs.num_replays if graphs is not None else 0
    return [output.outputs[0] for output in outputs], replays


def check(result: CheckResult, dry_run: bool, workdir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from berth.engine.models.tiny_model import make_tiny_model
    from berth.engine.tokenizer import load_tokenizer

    device = "cpu" if dry_run else "cuda"
    if not dry_run:
        # transformers' float32 matmuls must be float32 (TF32 would be another model).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    for name, arguments in MODELS.items():
        model_dir = make_tiny_model(workdir / f"tiny-{name}", **arguments)
        prompts = prompts_of_many_lengths(load_tokenizer(model_dir))
        for dtype in ("float32", "bfloat16"):
            hf = (
                AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
            )
            reference = [hf_greedy(hf, prompt, MAX_NEW) for prompt in prompts]
            del hf
            runs = {"graphs": berth_greedy(model_dir, device, dtype, prompts)}
            runs["eager"] = berth_greedy(model_dir, device, dtype, prompts, enforce_eager=True)
            for mode, (completions, replays) in runs.items():
                problems = []
                for completion, (theirs, hf_logprobs) in zip(completions, reference):
                    if dtype == "float32":
                        problem = exact_parity_problem(completion.token_ids, theirs, hf_logprobs)
                    else:
                        problem = close_parity_problem(
                            completion.token_ids,
                            completion.logprobs,
                            theirs,
                            hf_logprobs,
                            BF16_LOGPROB_TOLERANCE,
                        )
                    if problem:
                        problems.append(problem)
                same = sum(c.token_ids == theirs for c, (theirs, _) in zip(completions, reference))
                rule = "equal but near-ties" if dtype == "float32" else "each in the other's top 5"
                replayed = "" if dry_run else f"; {replays} graph replays"
                result.add(
                    f"{name} {dtype} {mode}: greedy vs transformers",
                    f"{same}/{len(prompts)} prompts identical ({MAX_NEW} tokens){replayed}",
                    rule + ("" if dry_run or mode == "eager" else ", decode steps replayed"),
                    not problems and (dry_run or mode == "eager" or replays > 0),
                )
                for problem in problems:
                    result.note(f"{name} {dtype} {mode}: {problem}")
            graph_tokens = [c.token_ids for c in runs["graphs"][0]]
            eager_tokens = [c.token_ids for c in runs["eager"][0]]
            result.metrics[f"{name}_{dtype}_graphs_equal_eager"] = graph_tokens == eager_tokens


def main(argv: list[str] | None = None) -> int:
    return check_main("parity", __doc__.split("\n")[0], check, argv)


if __name__ == "__main__":
    sys.exit(main())
