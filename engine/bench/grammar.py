"""`berth bench grammar MODEL_DIR`: the grammar engines for structured outputs, on MODEL's
tokenizer: what picking one costs (issue 44 asks for the choice by measurement).

For llguidance (what berth uses: engine/structured_outputs.py, through its `Grammars`) and, when
`import xgrammar` works (it is no dependency of berth's), xgrammar, each with the JSON layout
berth writes (json.dumps's separators, no other whitespace):

- tokenizer setup: the engine's view of the vocabulary, built once per model;
- compile of a 50-property schema (`engine/bench/structured.py` `wide_schema`), cold: a schema
  not seen before, `--cold-schemas` of them, the median; then the first mask of the compiled
  grammar (batch 1), which is where an engine that builds its automata lazily pays for them;
- cached: a matcher for a schema seen before (berth: `Grammars.matcher`, a cache hit and a copy;
  xgrammar: its compiler's cache and a new `GrammarMatcher`), the median of `--repeats`;
- at batch `--batch-size` (default 32), walking a valid document in each row (each row its own
  document of the 50-property schema, one token a step): the mask of a step (berth:
  `Grammars.fill_bitmask`, llguidance's executor over its threads; xgrammar:
  `BatchGrammarMatcher.batch_fill_next_token_bitmask`), the advance of every row by its token,
  and the bitmask applied to float32 logits of the vocabulary's width (berth: the sampler's
  masking, engine/pyexecutor/sampler.py `_constrained`; xgrammar: `apply_token_bitmask_inplace`):
  the median step of the walk, after a first walk of the same grammar (not counted) has warmed
  what each engine builds lazily.

Every step checks that the token each row takes next is one its mask allows: a walk that a mask
refuses fails the benchmark. Times are wall-clock on this machine's CPUs, shared with whatever
else runs; the masks of the engine are computed on a thread while the forward pass runs
(engine/pyexecutor/grammar_masks.py), so what they cost a decode step depends on the cores the
forward pass leaves free.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from berth.engine.bench.structured import WIDE_PROPERTIES, wide_document, wide_schema

ENGINES = ("llguidance", "xgrammar")
# The report's rows: (key in Figures, label, unit: ms, or us for what takes microseconds).
# Figures.values hold milliseconds.
ROWS = (
    ("tokenizer", "Tokenizer setup", "ms"),
    ("compile_cold", f"Compile, {WIDE_PROPERTIES}-property schema, cold", "ms"),
    ("first_mask", "First mask after a cold compile", "us"),
    ("compile_cached", "Compile, cached schema", "us"),
    ("mask_step", "Mask at batch B, a step", "us"),
    ("mask_row", "Mask at batch B, a row", "us"),
    ("advance_step", "Advance at batch B, a step", "us"),
    ("apply_step", "Bitmask applied at batch B", "ms"),
)


@dataclass
class Figures:
    values: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # of the timed walk
    missing: str = ""  # why the engine was not measured


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory: its tokenizer and vocabulary")
    parser.add_argument("--batch-size", type=int, default=32, help="rows masked a step (default 32)")
    parser.add_argument(
        "--cold-schemas", type=int, default=5, help="distinct schemas compiled cold, the median kept"
    )
    parser.add_argument("--repeats", type=int, default=50, help="cached compiles timed, the median kept")
    parser.add_argument("--seed", type=int, default=0, help="of the walked documents")


def run(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        print(f"berth bench grammar: error: {problem}", file=sys.stderr)
        return 2
    from berth.engine.models.config import ModelConfig
    from berth.engine.tokenizer import load_tokenizer

    config = ModelConfig.from_pretrained(args.model)
    tokenizer = load_tokenizer(args.model)
    eos = list(config.eos_token_ids)
    if not eos:
        print(f"berth bench grammar: error: {args.model} names no end-of-sequence token", file=sys.stderr)
        return 2
    schema = wide_schema(0)
    rng = random.Random(args.seed)
    documents = [
        [*tokenizer.encode(wide_document(schema, rng), add_special_tokens=False), eos[0]]
        for _ in range(args.batch_size)
    ]
    lengths = sorted(len(d) for d in documents)
    print(
        f"grammar engines on {args.model}'s tokenizer (vocabulary {config.vocab_size}): a {WIDE_PROPERTIES}-"
        f"property schema; batch {args.batch_size}, each row its own valid document of "
        f"{lengths[0]}-{lengths[-1]} tokens; {os.cpu_count()} CPUs",
        flush=True,
    )
    figures = {}
    try:
        figures["llguidance"] = _llguidance(args, config, documents)
        figures["xgrammar"] = _xgrammar(args, config, tokenizer, documents)
    except WalkError as error:
        print(f"berth bench grammar: error: {error}", file=sys.stderr)
        return 1
    _report(args, figures)
    return 0


def _check_args(args: argparse.Namespace) -> str | None:
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--cold-schemas", args.cold_schemas),
        ("--repeats", args.repeats),
    ):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model} is not a model directory (no config.json)"
    return None


class WalkError(Exception):
    """A valid document's token was refused by its mask: the engine's figures would be wrong."""


def _ms(seconds: float) -> float:
    return 1000 * seconds


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def _allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _walk(
    documents: list[list[int]],
    fill: Callable[[], np.ndarray],
    advance: Callable[[list[int]], None],
    apply: Callable[[np.ndarray], object],
    engine: str,
) -> tuple[list[float], list[float], list[float]]:
    """Steps every row through its document (as far as the shortest goes): the seconds of each
    step's mask, advance and apply."""
    masks, advances, applies = [], [], []
    steps = min(len(d) for d in documents)
    constrained = False  # whether any mask refused any token (one that never does measures nothing)
    for step in range(steps):
        seconds, bitmask = _timed(fill)
        masks.append(seconds)
        constrained = constrained or bool((bitmask != -1).any())
        tokens = [d[step] for d in documents]
        for row, token in enumerate(tokens):
            if not _allowed(bitmask, row, token):
                raise WalkError(f"{engine}: row {row}'s mask refuses token {token} at step {step}")
        applies.append(_timed(lambda bitmask=bitmask: apply(bitmask))[0])
        if step < steps - 1:  # the last: the shortest document's end-of-sequence, which ends it
            advances.append(_timed(lambda tokens=tokens: advance(tokens))[0])
    if not constrained:
        raise WalkError(f"{engine}: no mask of the walk refused a token")
    return masks, advances, applies


def _walk_figures(figures: Figures, batch: int, walk: tuple[list[float], list[float], list[float]]) -> None:
    masks, advances, applies = walk
    figures.steps = len(masks)
    figures.values["mask_step"] = _ms(statistics.median(masks))
    figures.values["mask_row"] = figures.values["mask_step"] / batch
    figures.values["advance_step"] = _ms(statistics.median(advances))
    figures.values["apply_step"] = _ms(statistics.median(applies))


def _logits(batch: int, vocab_size: int):
    import torch

    return torch.randn(batch, vocab_size, dtype=torch.float32, generator=torch.Generator().manual_seed(0))


def _llguidance(args: argparse.Namespace, config, documents: list[list[int]]) -> Figures:
    from berth.engine.pyexecutor.grammar_masks import StepMasks
    from berth.engine.pyexecutor.sampler import _constrained
    from berth.engine.structured_outputs import Grammars, StructuredOutputs, forbidden_tokens

    figures = Figures()
    grammars = Grammars(args.model, config.vocab_size, config.eos_token_ids)
    figures.values["tokenizer"] = _ms(_timed(lambda: grammars.tokenizer)[0])
    cold, first = [], []
    for seed in range(1, args.cold_schemas + 1):
        seconds, matcher = _timed(
            lambda seed=seed: grammars.matcher(StructuredOutputs(json=wide_schema(seed)))
        )
        cold.append(seconds)
        first.append(_timed(lambda matcher=matcher: grammars.fill_bitmask([matcher]))[0])
    figures.values["compile_cold"] = _ms(statistics.median(cold))
    figures.values["first_mask"] = _ms(statistics.median(first))
    spec = StructuredOutputs(json=wide_schema(0))
    grammars.matcher(spec)  # compiled once: the rest are cache hits
    figures.values["compile_cached"] = _ms(
        statistics.median(_timed(lambda: grammars.matcher(spec))[0] for _ in range(args.repeats))
    )
    logits = _logits(len(documents), config.vocab_size)
    rows = list(range(len(documents)))

    def walk() -> tuple[list[float], list[float], list[float]]:
        matchers = [grammars.matcher(spec) for _ in documents]

        def advance(tokens: list[int]) -> None:
            for matcher, token in zip(matchers, tokens):  # as grammar_masks.py catches up
                if not matcher.consume_tokens([token]):
                    raise WalkError(f"llguidance: token {token} refused: {matcher.get_error()}")

        return _walk(
            documents,
            lambda: grammars.fill_bitmask(matchers),
            advance,
            # The masking as the engine does it: the bits unpacked (on its grammar thread), then
            # the sampler's -inf in place (a request without logprobs: no copy).
            lambda bitmask: _constrained(
                logits,
                StepMasks(rows, forbidden_tokens(bitmask, config.vocab_size), [None] * len(rows)),
                copy=False,
            ),
            "llguidance",
        )

    walk()  # what it builds lazily, built
    _walk_figures(figures, len(documents), walk())
    return figures


def _xgrammar(args: argparse.Namespace, config, tokenizer, documents: list[list[int]]) -> Figures:
    try:
        # By name: optional, compared only where someone installed it (no dependency of berth's,
        # nor carried to a GPU machine).
        xgr = importlib.import_module("xgrammar")
    except ImportError as error:
        return Figures(missing=f"not installed ({error})")
    import torch

    figures = Figures()
    eos = list(config.eos_token_ids)

    def setup():
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size, stop_token_ids=eos)
        return xgr.GrammarCompiler(info)

    seconds, compiler = _timed(setup)
    figures.values["tokenizer"] = _ms(seconds)

    def compile_json(schema) -> object:  # the layout berth writes
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    words = (config.vocab_size + 31) // 32
    cold, first = [], []
    for seed in range(1, args.cold_schemas + 1):
        seconds, matcher = _timed(lambda seed=seed: xgr.GrammarMatcher(compile_json(wide_schema(seed))))
        cold.append(seconds)
        one = np.full((1, words), -1, dtype=np.int32)
        first.append(_timed(lambda matcher=matcher, one=one: matcher.fill_next_token_bitmask(one))[0])
    figures.values["compile_cold"] = _ms(statistics.median(cold))
    figures.values["first_mask"] = _ms(statistics.median(first))
    schema = wide_schema(0)
    compile_json(schema)
    figures.values["compile_cached"] = _ms(
        statistics.median(
            _timed(lambda: xgr.GrammarMatcher(compile_json(schema)))[0] for _ in range(args.repeats)
        )
    )
    logits = _logits(len(documents), config.vocab_size)
    batch = xgr.BatchGrammarMatcher()

    def walk() -> tuple[list[float], list[float], list[float]]:
        compiled = compile_json(schema)
        matchers = [xgr.GrammarMatcher(compiled) for _ in documents]
        bitmask = np.full((len(documents), words), -1, dtype=np.int32)

        def fill() -> np.ndarray:
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
            return bitmask

        def advance(tokens: list[int]) -> None:
            for matcher, token in zip(matchers, tokens):
                if not matcher.accept_token(token):
                    raise WalkError(f"xgrammar: token {token} refused")

        def apply(bitmask: np.ndarray) -> None:
            # In place (xgrammar's way), on a copy: the logits stay the same for every step.
            xgr.apply_token_bitmask_inplace(logits.clone(), torch.from_numpy(bitmask))

        return _walk(documents, fill, advance, apply, "xgrammar")

    walk()
    _walk_figures(figures, len(documents), walk())
    return figures


def _report(args: argparse.Namespace, figures: dict[str, Figures]) -> None:
    width = 44
    print(f"{' Grammar engines ':-^{width + 2 * 14}}")
    print(f"{'':<{width}}" + "".join(f"{engine:>14}" for engine in ENGINES))
    for key, label, unit in ROWS:
        label = f"{label.replace('batch B', f'batch {args.batch_size}')} ({unit}):"
        cells = []
        for engine in ENGINES:
            value = figures[engine].values.get(key)
            shown = "-" if value is None else f"{value:.3f}" if unit == "ms" else f"{1000 * value:.1f}"
            cells.append(f"{shown:>14}")
        print(f"{label:<{width}}" + "".join(cells))
    print("-" * (width + 2 * 14))
    for engine in ENGINES:
        if figures[engine].missing:
            print(f"{engine}: {figures[engine].missing}")
        else:
            print(f"{engine}: the walk timed {figures[engine].steps} steps at batch {args.batch_size}")
    measured = [e for e in ENGINES if not figures[e].missing]
    if len(measured) == 2:
        a, b = (figures[e].values for e in measured)
        print(f"{'Mask a step, llguidance / xgrammar:':<{width}}{a['mask_step'] / b['mask_step']:>14.2f}")
        print(
            f"{'Compile cold, llguidance / xgrammar:':<{width}}{a['compile_cold'] / b['compile_cold']:>14.2f}"
        )
