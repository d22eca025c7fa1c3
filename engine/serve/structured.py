"""A request's structured output, as OpenAI and vLLM spell it, read into `StructuredOutputs`.

OpenAI's `response_format` (`json_schema` with its schema, or `json_object`), vLLM's
`structured_outputs` object (`json`, `regex`, `choice`, `grammar`) and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` fields: at most one of them per request.
A constraint that cannot compile is a 400 naming the field and llguidance's reason, before the
request reaches the engine; it is never ignored.
"""

from __future__ import annotations

from typing import Any

from berth.engine.serve.errors import bad_request
from berth.engine.serve.protocol import ChatCompletionRequest, CompletionRequest
from berth.engine.structured_outputs import StructuredOutputs, grammar_problem

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputs | None:
    """The constraint `body` asks for (None: none), checked to compile."""
    asked: list[tuple[str, StructuredOutputs]] = []
    if body.response_format is not None:
        spec = _from_response_format(body.response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", _from_vllm(body.structured_outputs)))
    for field, name in GUIDED_FIELDS.items():
        value = getattr(body, field)
        if value is not None:
            asked.append((field, StructuredOutputs(**{name: value})))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(field for field, _ in asked)
        raise bad_request(f"ask for one structured output at a time (got {names})", param=asked[1][0])
    ((field, spec),) = asked
    problem = grammar_problem(spec)
    if problem is not None:
        raise bad_request(f"{field} cannot constrain the output: {problem}", param=field)
    return spec


def _from_response_format(value: dict[str, Any]) -> StructuredOutputs | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        described = value.get("json_schema")
        if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
            raise bad_request(
                'response_format json_schema needs {"name": ..., "schema": {a JSON schema}}',
                param="response_format.json_schema",
            )
        return StructuredOutputs(json=described["schema"])
    raise bad_request(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type",
    )


def _from_vllm(value: dict[str, Any]) -> StructuredOutputs:
    names = {"json", "json_object", "regex", "choice", "grammar"}
    unknown = sorted(set(value) - names)
    if unknown:
        raise bad_request(
            f"structured_outputs has no field {unknown[0]!r} (it takes one of {', '.join(sorted(names))})",
            param="structured_outputs",
        )
    return StructuredOutputs(**value)
