"""A reasoning model's thinking split from its answer (`--reasoning-parser`), whole or streamed
in any chunking, the same way."""

from __future__ import annotations

import pytest

from berth.engine.serve.reasoning import REASONING_PARSERS, ReasoningStream

CASES = [
    # (parser, answer, reasoning, content)
    ("qwen3", "<think>\nSky is blue.\n</think>\n\nBlue.", "Sky is blue.", "Blue."),
    ("qwen3", "Blue.", None, "Blue."),  # thinking off: all content
    ("qwen3", "<think>\nStill thinking", "Still thinking", None),  # cut while thinking
    ("qwen3", "<thin air>", None, "<thin air>"),
    ("deepseek_r1", "Sky is blue.\n</think>\n\nBlue.", "Sky is blue.", "Blue."),  # the prompt opened it
    ("deepseek_r1", "<think>Hm.</think>Blue.", "Hm.", "Blue."),
    ("deepseek_r1", "Never ended", "Never ended", None),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_a_whole_answer_splits_into_thinking_and_content(name, text, reasoning, content) -> None:
    assert REASONING_PARSERS[name]().split(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_a_streamed_answer_splits_as_the_whole_one(name, text, reasoning, content, step) -> None:
    stream = ReasoningStream(REASONING_PARSERS[name]())
    thought = said = ""
    for start in range(0, len(text), step):
        piece = stream.feed(text[start : start + step], start + step >= len(text))
        thought, said = thought + piece[0], said + piece[1]
    assert (thought.strip() or None, said or None) == (reasoning, content)
