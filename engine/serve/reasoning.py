"""Reasoning models' thinking, split from their answer (`--reasoning-parser`): the text between
the thinking markers goes to `reasoning_content`, the rest to `content` (where tool calls are
then read).

- `qwen3`: `<think>...</think>` opens the answer when the model thinks; with thinking off
  (`chat_template_kwargs: {"enable_thinking": false}`) there is none, and all is content.
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the answer is thinking up to
  `</think>`; an answer cut before it is all thinking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

START, END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str]
    # Whether the answer is thinking from its first token (the prompt opened the marker).
    opens_thinking: ClassVar[bool]

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None where there is none."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            body = stripped[len(START) :]
        elif self.opens_thinking or END in text:  # the prompt opened it
            body = text
        else:
            return None, text or None
        reasoning, ended, content = body.partition(END)
        return reasoning.strip() or None, (content.lstrip() or None) if ended else None


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    opens_thinking = False


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    opens_thinking = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3Parser, DeepSeekR1Parser)}


@dataclass
class ReasoningStream:
    """One choice's streamed answer split into thinking and content as it comes: what may be
    the start of a marker is held back until the next text says. (A qwen3 answer streams as
    content unless it opens with `<think>`.)"""

    parser: ReasoningParser
    text: str = ""
    sent: int = 0  # characters of `text` handled
    state: str = ""  # "" (not yet known), "thinking", or "content"
    skip_space: bool = False  # the space after `</think>` is not content

    def feed(self, diff: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) that `diff` gives, with the rest when `finished`."""
        self.text += diff
        reasoning = ""
        if not self.state:
            stripped = self.text.lstrip()
            if stripped.startswith(START):
                self.state, self.sent = "thinking", len(self.text) - len(stripped) + len(START)
            elif not finished and START.startswith(stripped):
                return "", ""  # it may still open with the marker
            else:
                self.state = "thinking" if self.parser.opens_thinking else "content"
        if self.state == "thinking":
            end = self.text.find(END, self.sent)
            if end < 0:
                held = (
                    0
                    if finished
                    else max((n for n in range(1, len(END)) if self.text.endswith(END[:n])), default=0)
                )
                upto = len(self.text) - held
                reasoning, self.sent = self.text[self.sent : upto], upto
                return reasoning, ""
            reasoning = self.text[self.sent : end]
            self.state, self.sent, self.skip_space = "content", end + len(END), True
        if self.skip_space:
            rest = self.text[self.sent :]
            self.sent += len(rest) - len(rest.lstrip())
            self.skip_space = not rest.strip()
        content, self.sent = self.text[self.sent :], len(self.text)
        return reasoning, content
