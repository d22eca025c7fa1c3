"""`berth bench throughput MODEL_DIR`: offline throughput of berth against transformers.

Both run the same synthetic workload, greedy, every request generating exactly its drawn
number of tokens (EOS ignored), in the same dtype. transformers runs static batches of
`--batch-size` prompts (left-padded; a batch runs until its longest output is done, as static
batching does); berth gets all requests at once and batches them continuously with the same
batch size. Throughput counts the requested output tokens only.

Also printed, all measured in this run:

- the roofline line: the FLOPs the workload needs (`roofline.workload_flops`) divided by
  (seconds x the matmul peak of this machine in this dtype), for each engine;
- batch-1 TPOT: one request at a time, (time for N tokens - time for 1 token) / (N - 1), the
  median over `--tpot-requests` prompts, for each engine;
- with `--plot FILE.png`: throughput against batch size (`--plot-batch-sizes`), both engines;
- with `--rounds R`: each engine's time in each of R rounds taken in turn (the lines above use
  each engine's fastest).

With `--tensor-parallel-size N` (N > 1) berth also runs with N ranks (an MPI world on this
machine), and its throughput is printed against one rank's (both behind the proxy, measured in
this run), with what the collectives cost per step: rank 0's all-reduce calls and seconds, and
the leader's step-input broadcasts, against the step's wall time.

With `--shared-prefix-len L` it measures prefix caching instead (`shared_prefix.py`): a shared
system prompt, berth with caching on vs off.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from berth.engine.bench import shared_prefix
from berth.engine.bench.workload import WorkItem, add_workload_arguments, describe_workload, make_workload

if TYPE_CHECKING:
    import torch

    from berth.engine.bench.roofline import Peak
    from berth.engine.models.config import ModelConfig

DTYPES = ("float32", "bfloat16")
TPOT_TOKENS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory")
    add_workload_arguments(parser)
    parser.add_argument(
        "--batch-size", type=int, default=32, help="berth's max_batch_size = HF's static batch"
    )
    parser.add_argument("--max-num-tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="both engines' dtype")
    parser.add_argument("--executor", default="in-process", help="berth's executor shape")
    parser.add_argument("--skip-hf", action="store_true", help="measure berth only")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="berth and transformers take turns this many times at --batch-size; each one's "
        "fastest round counts (for a machine whose speed drifts)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="N > 1: also berth with N ranks, against one rank (both behind the proxy) and with "
        "the collectives' cost per step",
    )
    parser.add_argument(
        "--tpot-requests",
        type=int,
        default=3,
        help=f"prompts for the batch-1 TPOT line ({TPOT_TOKENS} tokens each; 0: no TPOT line)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="also plot throughput against batch size")
    parser.add_argument("--plot-batch-sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    shared_prefix.add_arguments(parser)


@dataclass
class Point:
    batch_size: int
    berth_seconds: float
    hf_seconds: float | None


def run(args: argparse.Namespace) -> int:
    if args.shared_prefix_len is not None:
        return shared_prefix.run(args)
    if args.tensor_parallel_size < 1:
        raise SystemExit(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1:
        return run_tensor_parallel(args)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    import torch

    from berth.engine.bench.roofline import matmul_peak, workload_flops
    from berth.engine.models.config import ModelConfig
    from berth.engine.tokenizer import load_tokenizer

    if args.plot:
        import matplotlib  # noqa: F401  (fail now, not after minutes of measuring)
    dtype = getattr(torch, args.dtype)
    config = ModelConfig.from_pretrained(args.model)
    tokenizer = load_tokenizer(args.model)
    workload = make_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    total_out = sum(item.output_len for item in workload)
    flops = workload_flops(config, workload)
    print(
        f"{describe_workload(args, workload)}; batch size {args.batch_size}; dtype {args.dtype}; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    peak = matmul_peak(config, dtype)
    print(
        f"matmul peak ({args.dtype}, this model's GEMMs at 1024 rows, {peak.path}): "
        f"{peak.gflops:.1f} GFLOPS; the workload needs {flops / 1e12:.3f} TFLOP",
        flush=True,
    )

    def line(name: str, seconds: float) -> str:
        achieved = flops / seconds / 1e9  # against `peak` as it is when the line is printed
        return (
            f"{name + ':':<14}{seconds:8.2f} s  {total_out / seconds:10.1f} output tok/s  "
            f"{achieved:7.1f} GFLOPS = {100 * achieved / peak.gflops:5.1f} % of the matmul peak"
        )

    hf = None if args.skip_hf else _load_transformers(args.model, dtype)
    points: dict[int, Point] = {}
    batch_sizes = [args.batch_size] + (
        [b for b in args.plot_batch_sizes if b != args.batch_size] if args.plot else []
    )
    for batch_size in batch_sizes:
        main = batch_size == args.batch_size
        berth_seconds, berth_tpot = _measure_berth(args, batch_size, workload, tpot=main)
        if main:
            peak = _remeasure_peak(config, dtype, peak)
            if args.rounds == 1:
                print(line("berth", berth_seconds), flush=True)
        hf_seconds = None if hf is None else _run_transformers(hf, workload, batch_size)
        if main and args.rounds > 1:
            berth_seconds, hf_seconds = _take_turns(args, hf, workload, berth_seconds, hf_seconds)
            print(line("berth", berth_seconds), flush=True)
        points[batch_size] = Point(batch_size, berth_seconds, hf_seconds)
        if not main:
            hf_part = "" if hf_seconds is None else f", transformers {total_out / hf_seconds:8.1f} tok/s"
            print(
                f"  batch size {batch_size:3d}: berth {total_out / berth_seconds:8.1f} tok/s{hf_part}",
                flush=True,
            )
            continue
        if hf is not None:
            print(line("transformers", hf_seconds))
            print(f"ratio berth / transformers: {hf_seconds / berth_seconds:.2f}x", flush=True)
        if berth_tpot is not None:
            tpot = f"batch-1 TPOT (median of {args.tpot_requests} prompts, {TPOT_TOKENS} tokens each): "
            tpot += f"berth {1000 * berth_tpot:.1f} ms"
            if hf is not None:
                hf_tpot = _transformers_tpot(hf, workload[: args.tpot_requests])
                tpot += f", transformers {1000 * hf_tpot:.1f} ms"
                tpot += f" (ratio transformers / berth {hf_tpot / berth_tpot:.2f}x)"
            print(tpot, flush=True)
        if args.plot:
            print("throughput against batch size (same workload):", flush=True)
    if args.plot:
        _plot(args, [points[b] for b in sorted(points)], total_out)
        print(f"plot: {args.plot}")
    return 0


def _take_turns(
    args: argparse.Namespace, hf, workload: list[WorkItem], berth_seconds: float, hf_seconds: float | None
) -> tuple[float, float | None]:
    """`--rounds` R > 1: R rounds in all of berth then transformers (the first one is given),
    each engine's fastest counting. A machine whose speed drifts for minutes at a time then
    slows both engines' rounds alike, not one engine's only run."""
    berth_runs, hf_runs = [berth_seconds], [hf_seconds]
    for round_number in range(1, args.rounds + 1):
        if round_number > 1:
            berth_runs.append(_measure_berth(args, args.batch_size, workload, tpot=False)[0])
            hf_runs.append(None if hf is None else _run_transformers(hf, workload, args.batch_size))
        said = f"round {round_number}: berth {berth_runs[-1]:.2f} s"
        if hf is not None:
            said += f", transformers {hf_runs[-1]:.2f} s"
        print(said, flush=True)
    return min(berth_runs), (None if hf is None else min(hf_runs))


def _remeasure_peak(config: ModelConfig, dtype: torch.dtype, before: Peak) -> Peak:
    """The peak once more, after the run: a neighbour's burst during the first measurement
    would otherwise lower the peak and flatter every percentage (seen here: 87 GFLOPS at the
    start of a run, 150-170 a minute later). The higher of the two is the one used."""
    from berth.engine.bench.roofline import matmul_peak

    after = matmul_peak(config, dtype)
    best = max(before, after, key=lambda peak: peak.gflops)
    print(
        f"matmul peak again, after berth's run: {after.gflops:.1f} GFLOPS ({after.path}); "
        f"the lines below use the higher, {best.gflops:.1f}",
        flush=True,
    )
    return best


def _measure_berth(args, batch_size: int, workload: list[WorkItem], tpot: bool) -> tuple[float, float | None]:
    from berth.engine import LLM, SamplingParams

    with LLM(
        args.model,
        max_batch_size=batch_size,
        max_num_tokens=args.max_num_tokens,
        executor=args.executor,
        dtype=args.dtype,
    ) as llm:
        seconds = run_berth(llm, workload, SamplingParams)
        berth_tpot = (
            _berth_tpot(llm, workload[: args.tpot_requests], SamplingParams)
            if tpot and args.tpot_requests > 0
            else None
        )
    return seconds, berth_tpot


def run_tensor_parallel(args: argparse.Namespace) -> int:
    """One rank against `--tensor-parallel-size` ranks on the same workload, both through the
    proxy (a TP world always is), and what the collectives cost per step."""
    from berth.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    workload = make_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    total_out = sum(item.output_len for item in workload)
    print(
        f"{describe_workload(args, workload)}; batch size {args.batch_size}; dtype {args.dtype}", flush=True
    )
    seconds = {}
    for size in (1, args.tensor_parallel_size):
        seconds[size], before, after = _measure_world(args, size, workload)
        steps = after.num_steps - before.num_steps
        line = f"berth TP={size}: {seconds[size]:8.2f} s  {total_out / seconds[size]:10.1f} output tok/s"
        line += f"  {steps} steps, {1000 * seconds[size] / max(steps, 1):.2f} ms a step"
        if size > 1:
            reduces = after.num_all_reduces - before.num_all_reduces
            reduce_s = after.all_reduce_seconds - before.all_reduce_seconds
            other_s = after.other_collective_seconds - before.other_collective_seconds
            line += (
                f"; per step on rank 0: {reduces / max(steps, 1):.0f} all-reduces taking "
                f"{1000 * reduce_s / max(steps, 1):.2f} ms ({100 * reduce_s / seconds[size]:.0f} % of the "
                f"wall time), other collectives (step inputs, logits gather) "
                f"{1000 * other_s / max(steps, 1):.2f} ms ({100 * other_s / seconds[size]:.0f} %)"
            )
        print(line, flush=True)
    size = args.tensor_parallel_size
    print(f"ratio TP={size} / TP=1 throughput: {seconds[1] / seconds[size]:.2f}x", flush=True)
    return 0


def _measure_world(args: argparse.Namespace, size: int, workload: list[WorkItem]):
    """(seconds, stats before, stats after) of berth behind the proxy with `size` ranks."""
    from berth.engine import LLM, SamplingParams

    marks = []
    with LLM(
        args.model,
        max_batch_size=args.batch_size,
        max_num_tokens=args.max_num_tokens,
        executor="proxy",
        dtype=args.dtype,
        tensor_parallel_size=size,
    ) as llm:
        seconds = run_berth(llm, workload, SamplingParams, lambda: marks.append(llm.executor.stats))
        return seconds, marks[0], llm.executor.stats


def run_berth(llm, workload: list[WorkItem], sampling_params, on_start=None) -> float:
    """Seconds `llm.generate` takes for the whole workload (after a warm-up, then `on_start()`);
    also `berth bench serve`'s offline baseline."""
    params = [
        sampling_params(temperature=0, max_tokens=item.output_len, ignore_eos=True) for item in workload
    ]
    llm.generate(
        [item.prompt_token_ids[:8] for item in workload[:4]], sampling_params(max_tokens=4)
    )  # warm-up
    if on_start is not None:
        on_start()
    started = time.perf_counter()
    outputs = llm.generate([item.prompt_token_ids for item in workload], params)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(item.output_len for item in workload)
    if produced != expected:
        raise RuntimeError(f"berth produced {produced} tokens, expected {expected}")
    return elapsed


def _tpot(generate, items: list[WorkItem]) -> float:
    """Median over prompts of (time for TPOT_TOKENS tokens - time for 1) / (TPOT_TOKENS - 1)."""
    per_prompt = []
    for item in items:
        generate(item.prompt_token_ids, 2)  # warm this prompt length
        started = time.perf_counter()
        generate(item.prompt_token_ids, 1)
        first = time.perf_counter() - started
        started = time.perf_counter()
        generate(item.prompt_token_ids, TPOT_TOKENS)
        per_prompt.append((time.perf_counter() - started - first) / (TPOT_TOKENS - 1))
    return statistics.median(per_prompt)


def _berth_tpot(llm, items: list[WorkItem], sampling_params) -> float:
    def generate(prompt: list[int], tokens: int) -> None:
        params = sampling_params(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate([prompt], params)

    return _tpot(generate, items)


def _load_transformers(model_dir: str, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _hf_generate(model, batch: list[list[int]], new_tokens: int) -> None:
    import torch

    pad = model.generation_config.pad_token_id or 0
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )


def _run_transformers(model, workload: list[WorkItem], batch_size: int) -> float:
    _hf_generate(model, [item.prompt_token_ids for item in workload[:2]], 2)  # warm-up
    started = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        _hf_generate(model, [item.prompt_token_ids for item in batch], max(item.output_len for item in batch))
    return time.perf_counter() - started


def _transformers_tpot(model, items: list[WorkItem]) -> float:
    return _tpot(lambda prompt, tokens: _hf_generate(model, [prompt], tokens), items)


def _plot(args: argparse.Namespace, points: list[Point], total_out: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    sizes = [p.batch_size for p in points]
    axes.plot(sizes, [total_out / p.berth_seconds for p in points], "o-", label="berth (continuous batching)")
    if all(p.hf_seconds is not None for p in points):
        axes.plot(
            sizes, [total_out / p.hf_seconds for p in points], "s--", label="transformers (static batches)"
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(s) for s in sizes])
    axes.set_xlabel("batch size")
    axes.set_ylabel("output tokens / s")
    axes.set_title(f"{args.model.rstrip('/').split('/')[-1]}, {args.dtype}, {args.num_requests} requests")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.plot)
    plt.close(figure)
