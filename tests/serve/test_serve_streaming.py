"""SSE events stay one line for every line reader: generated text may hold characters (U+0085,
U+2028, U+2029) that JSON leaves raw and `str.splitlines` (so httpx's `iter_lines`) splits on;
a random model's stream then reached clients cut in two."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder

from berth.engine.serve.streaming import _one_line


def test_an_event_with_unicode_line_separators_stays_one_line_and_the_same_json():
    text = json.dumps({"text": "a\x85b\u2028c\u2029d\x1ce"}, ensure_ascii=False)
    line = _one_line(text)
    assert json.loads(line) == json.loads(text)
    assert LineDecoder().decode(f"data: {line}\n") == [f"data: {line}"]
