"""The structured-output benchmarks: `berth bench serve --structured-output` (constrained
against unconstrained on one server, every output that stops checked against its schema) and
`berth bench grammar` (the grammar engines' compile and mask times)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import jsonschema
import pytest

from berth.engine.bench import grammar
from berth.engine.bench.serve import Constraint, RequestResult, Shape, _report_structured
from berth.engine.bench.structured import (
    array_items_for,
    array_schema,
    schema_problem,
    wide_document,
    wide_schema,
)
from berth.engine.structured_outputs import Grammars, StructuredOutputs
from berth.engine.tokenizer import load_tokenizer


def figure(stdout: str, label: str, column: int = 0) -> float:
    """The number in `column` after `label:` on its line."""
    match = re.search(rf"^{re.escape(label)}:((?:\s+[\d.]+)+)", stdout, re.MULTILINE)
    assert match, f"{label!r} missing from:\n{stdout}"
    return float(match.group(1).split()[column])


def berth(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "berth", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.slow  # `berth bench serve` against a server it starts, two workloads
def test_bench_serve_compares_json_schema_constrained_with_unconstrained_on_one_server(tiny_model):
    result = berth(
        "bench", "serve", str(tiny_model), "--num-requests", "8", "--input-len", "4", "16",
        "--output-len", "16", "32", "--batch-size", "8", "--max-concurrency", "4", "--skip-offline",
        "--structured-output", "--rounds", "2",
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert out.count("server: berth serve") == 1  # both workloads, both rounds, on the one server
    assert "each shape's fastest of 2 rounds" in out
    plain, constrained = out.split(" Serving Benchmark Result: ")[1:]
    assert constrained.startswith("json_schema, ")
    for section in (plain, constrained):
        assert figure(section, "Successful requests") == 8 and figure(section, "Failed requests") == 0
    schema = json.loads(re.search(r"response_format json_schema (\{.*\}); max_tokens", out).group(1))
    assert schema["properties"]["values"]["minItems"] >= 1
    table = out.split(" json_schema-constrained vs unconstrained ")[1]
    for label in ("Median TPOT (ms)", "Mean TPOT (ms)", "Output throughput (tok/s)"):
        assert figure(table, label, 0) > 0 and figure(table, label, 1) > 0  # side by side
    for label in ("Median TPOT ratio", "Mean TPOT ratio", "Output throughput ratio"):
        assert figure(table, f"{label} (json_schema / unconstrained)") > 0
    stopped = re.search(r"^Constrained outputs that stopped:\s+(\d+) of (\d+) \([\d.]+ %\)$", out, re.M)
    valid = re.search(r"^Stopped outputs valid per the schema:\s+(\d+) of (\d+) \(100.0 %\)$", out, re.M)
    assert stopped and valid, out
    assert int(stopped.group(2)) == 8 and int(stopped.group(1)) >= 1
    assert valid.group(1) == valid.group(2) == stopped.group(1)


def test_bench_serve_refuses_structured_output_with_another_comparison(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = berth("bench", "serve", str(tmp_path), "--structured-output", "--disaggregated", timeout=60)
    assert result.returncode == 2 and "--structured-output" in result.stderr
    assert "Traceback" not in result.stderr


def _done(text: str, finish_reason: str = "stop") -> RequestResult:
    return RequestResult(ok=True, output_tokens=10, ttft=0.01, e2e=0.1, itls=[0.01] * 9, text=text,
                         finish_reason=finish_reason)  # fmt: skip


def test_an_output_that_stops_but_breaks_the_schema_fails_the_report(capsys):
    constraint = Constraint(array_schema(2), 20)
    plain = [_done("anything", "length")] * 2
    shape = Shape("x", 0, 0)
    good = [_done('{"values": [100, 999]}'), _done('{"values": [100', "length")]
    assert _report_structured([(shape, 1.0, plain), (shape, 1.0, good)], constraint)
    out = capsys.readouterr().out
    assert re.search(r"Constrained outputs that stopped:\s+1 of 2", out)
    assert re.search(r"Stopped outputs valid per the schema:\s+1 of 1", out)
    bad = [_done('{"values": [100, 1000]}'), _done('{"values": [1]')]
    assert not _report_structured([(shape, 1.0, plain), (shape, 1.0, bad)], constraint)
    out = capsys.readouterr().out
    assert re.search(r"Stopped outputs valid per the schema:\s+0 of 2 \(0.0 %\)", out)
    assert "invalid output: against the schema" in out and "invalid output: not JSON" in out
    none_stopped = [_done('{"values": [', "length")]
    assert not _report_structured([(shape, 1.0, plain), (shape, 1.0, none_stopped)], constraint)


def test_the_array_schema_fits_the_output_length_and_its_limit_every_document(tiny_model):
    tokenizer = load_tokenizer(str(tiny_model))
    items, max_tokens = array_items_for(tokenizer, 40)
    schema = array_schema(items)
    longest = json.dumps({"values": [999] * items})
    assert schema_problem(longest, schema) is None
    assert len(tokenizer.encode(longest, add_special_tokens=False)) < max_tokens
    assert schema_problem(json.dumps({"values": [999] * (items + 1)}), schema) is not None
    assert schema_problem(json.dumps({"values": [99] * items}), schema) is not None  # three digits each


def test_the_wide_schema_has_fifty_properties_and_its_documents_follow_it(tiny_model):
    import random

    schema = wide_schema(3)
    assert len(schema["properties"]) == 50 and schema["required"] == list(schema["properties"])
    assert wide_schema(4)["properties"].keys().isdisjoint(schema["properties"])  # another grammar
    document = wide_document(schema, random.Random(0))
    jsonschema.validate(json.loads(document), schema)
    # ... and llguidance accepts it, in berth's JSON layout, token by token.
    tokenizer = load_tokenizer(str(tiny_model))
    grammars = Grammars(str(tiny_model), len(tokenizer), [tokenizer.eos_token_id])
    matcher = grammars.matcher(StructuredOutputs(json=schema))
    assert matcher.consume_tokens(tokenizer.encode(document, add_special_tokens=False)), matcher.get_error()
    assert matcher.is_accepting()


def _grammar_args(model) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    grammar.add_arguments(parser)
    return parser.parse_args([str(model), "--batch-size", "4", "--cold-schemas", "2", "--repeats", "5"])


LLGUIDANCE_ROWS = (
    "Tokenizer setup (ms)",
    "Compile, 50-property schema, cold (ms)",
    "First mask after a cold compile (us)",
    "Compile, cached schema (us)",
    "Mask at batch 4, a step (us)",
    "Mask at batch 4, a row (us)",
    "Advance at batch 4, a step (us)",
    "Bitmask applied at batch 4 (ms)",
)


def test_bench_grammar_reports_compile_and_mask_times_of_each_engine(tiny_model, capsys):
    assert grammar.run(_grammar_args(tiny_model)) == 0
    out = capsys.readouterr().out
    for label in LLGUIDANCE_ROWS:
        assert figure(out, label, 0) > 0, label
    assert re.search(r"^llguidance: the walk timed \d+ steps at batch 4$", out, re.MULTILINE)
    try:
        import xgrammar  # noqa: F401  (installed here; no dependency of berth's)
    except ImportError:
        assert "xgrammar: not installed" in out
    else:
        for label in LLGUIDANCE_ROWS:
            assert figure(out, label, 1) > 0, label
        assert figure(out, "Mask a step, llguidance / xgrammar") > 0


def test_bench_grammar_without_xgrammar_says_so(tiny_model, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    assert grammar.run(_grammar_args(tiny_model)) == 0
    out = capsys.readouterr().out
    assert "xgrammar: not installed" in out
    assert figure(out, "Compile, 50-property schema, cold (ms)", 0) > 0
    assert re.search(r"^Compile, 50-property schema, cold \(ms\):\s+[\d.]+\s+-$", out, re.MULTILINE)


def test_bench_grammar_refuses_bad_arguments(tmp_path, capsys):
    args = _grammar_args(tmp_path)
    assert grammar.run(args) == 2
    assert "no config.json" in capsys.readouterr().err
