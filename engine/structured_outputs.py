"""Structured outputs: constrained decoding with llguidance.

A request names what its output must be (`StructuredOutputs`: a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a Lark grammar). The engine keeps an llguidance
matcher per sequence: before each draw, the matcher's bitmask of the tokens it allows sets every
other logit to -inf; after it, the drawn token advances the matcher. When the grammar is complete
only end-of-sequence is allowed, so an output that ends with finish_reason "stop" is always
complete and valid; one cut by max_tokens ("length") may not be.

Why llguidance (README "Structured outputs" has the measurements): it refuses what it does not
implement (an unknown JSON Schema keyword or format is an error, never silently ignored, so a
"stop" output always validates), needs no compile cache of its own (a 50-property schema compiles
in about 2 ms), and its wheel has no Python dependencies.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


# The JSON the model writes: one layout, json.dumps's default (what models have seen most), no
# other whitespace: flexible whitespace lets a weak model pad forever. A schema may ask for
# another in its "x-guidance" options.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
CACHED_GRAMMARS = 256
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputs:
    """What one request's output must be: exactly one of the fields.

    `json`: a JSON schema (a dict, or its text); `json_object`: any JSON object; `regex`: a
    regular expression the whole output matches; `choice`: exactly one of these strings;
    `grammar`: a grammar in llguidance's Lark dialect.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def validate(self) -> None:
        """Raises ValueError (naming `structured_outputs`) for a malformed request; whether the
        grammar compiles is `grammar_problem`'s question."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if self.json_object not in (True, False):
            raise ValueError(f"structured_outputs json_object must be a bool, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must name exactly one of json, json_object, regex, choice, grammar"
                f" (got {', '.join(given) or 'none'})"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs json must be a JSON schema (an object), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if (
                not isinstance(choice, (list, tuple))
                or not 0 < len(choice) <= MAX_CHOICES
                or any(not isinstance(c, str) or not c for c in choice)
            ):
                raise ValueError(
                    f"structured_outputs choice must be 1 to {MAX_CHOICES} non-empty strings, got {choice!r}"
                )


def grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for `spec` (not yet compiled: that checks it)."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise ValueError(f"structured_outputs json is not valid JSON: {error}") from error
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs json must be a JSON schema (an object), got {schema!r}")
        return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # JSON string literals are Lark string literals, escapes and all.
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    return matcher.grammar_from_lark(spec.grammar)


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _problem(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.validate_grammar(text)


def grammar_problem(spec: StructuredOutputs) -> str | None:
    """Why `spec` cannot constrain an output (llguidance's words), None when it can. Needs no
    tokenizer: the server asks it before a request reaches the engine."""
    try:
        spec.validate()
        problem = _problem(grammar_text(spec))
    except ValueError as error:
        return str(error)
    return problem or None


class Grammars:
    """The matchers of one tokenizer: compiled grammars are kept (by their text) and copied for
    each new sequence, so a schema sent again costs a copy, not a compile.

    The tokenizer (llguidance's, about half a second to build) is made on first use, from the
    model directory's tokenizer, over the model's vocabulary (its logits' width).
    """

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._executor = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            from berth.engine.tokenizer import load_tokenizer

            hf = load_tokenizer(self.model_dir)
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for `spec`; ValueError (llguidance's words) when it does not compile."""
        import llguidance

        text = grammar_text(spec)
        compiled = self._compiled.get(text)
        if compiled is None:
            compiled = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs: {compiled.get_error()}")
            self._compiled[text] = compiled
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(text)
        return compiled.deep_copy()

    def fill_bitmask(self, matchers: Sequence[Any]) -> np.ndarray:
        """Row i: the tokens matchers[i] allows next, one bit each, in int32 words. Numpy, not
        torch: it runs on a thread of its own while the forward pass runs, and torch's CPU ops
        must stay on the engine's thread (py_executor.py)."""
        import llguidance
        import numpy as np

        words = (self.vocab_size + 31) // 32
        bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        rows = [(matcher, row) for row, matcher in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, words * 4, len(matchers))
        return bitmask


def forbidden_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Row i: True for each token bitmask[i] does not allow (bool, [rows, vocab_size]). Numpy,
    so the grammar thread makes it while the forward pass runs: one cheap unpack there, and the
    sampler only fills -inf where it says."""
    import numpy as np

    as_bytes = bitmask.astype("<i4", copy=False).view(np.uint8)  # bit t of a row is bit t%8 of byte t//8
    return np.unpackbits(as_bytes, axis=1, count=vocab_size, bitorder="little") == 0
