"""The JSON schemas and documents of the structured-output benchmarks (`berth bench serve
--structured-output`, `berth bench grammar`), and the check that an output is what its schema asks.

The serving workload's schema (`array_schema`) forces a document of a known size: an object
with one array of exactly N three-digit integers, `{"values": [N integers in 100..999]}`, so
that a constrained request writes about as many tokens as the unconstrained workload (whatever
the model picks, each item is as long), and then stops.

The grammar engines' schema (`wide_schema`) is an object of 50 required properties of every
kind JSON Schema has (bounded integers, numbers, bounded strings, booleans, enums, arrays), and
`wide_document` a document that follows it, written as berth writes JSON (json.dumps's
separators, no other whitespace).
"""

from __future__ import annotations

import json
import random
import string
from typing import Any

MIN_VALUE, MAX_VALUE = 100, 999  # the array's integers: three digits each
WIDE_PROPERTIES = 50
ENUM = ("red", "green", "blue", "amber")


def array_schema(items: int) -> dict[str, Any]:
    """`{"values": [exactly `items` integers in 100..999]}`, nothing else."""
    return {
        "type": "object",
        "properties": {
            "values": {
                "type": "array",
                "items": {"type": "integer", "minimum": MIN_VALUE, "maximum": MAX_VALUE},
                "minItems": items,
                "maxItems": items,
            }
        },
        "required": ["values"],
        "additionalProperties": False,
    }


def array_items_for(tokenizer, output_tokens: float) -> tuple[int, int]:
    """The number of items whose document is about `output_tokens` tokens long (as `tokenizer`
    writes it, with random values), and a max_tokens no document of that many items reaches:
    its characters (a token is at least one), and one for end-of-sequence."""
    rng = random.Random(0)

    def tokens(items: int) -> int:
        values = [rng.randint(MIN_VALUE, MAX_VALUE) for _ in range(items)]
        return len(tokenizer.encode(json.dumps({"values": values}), add_special_tokens=False))

    items = 1
    while tokens(items + 1) <= output_tokens:
        items += 1
    return items, len(json.dumps({"values": [MAX_VALUE] * items})) + 1


def wide_schema(seed: int = 0) -> dict[str, Any]:
    """An object of 50 required properties, six kinds in turn; `seed` names them (a schema of
    another seed is another grammar: a cold compile)."""
    properties: dict[str, Any] = {}
    for i in range(WIDE_PROPERTIES):
        name = f"field_{seed}_{i}"
        kind = i % 6
        if kind == 0:
            properties[name] = {"type": "integer", "minimum": 0, "maximum": 10_000}
        elif kind == 1:
            properties[name] = {"type": "string", "minLength": 1, "maxLength": 16}
        elif kind == 2:
            properties[name] = {"type": "boolean"}
        elif kind == 3:
            properties[name] = {"type": "number"}
        elif kind == 4:
            properties[name] = {"enum": list(ENUM)}
        else:
            properties[name] = {"type": "array", "items": {"type": "integer"}, "maxItems": 4}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def wide_document(schema: dict[str, Any], rng: random.Random) -> str:
    """A document `schema` (a `wide_schema`) accepts, with random values, as berth writes JSON."""
    document: dict[str, Any] = {}
    for name, spec in schema["properties"].items():
        kind = spec.get("type", "enum")
        if kind == "integer":
            document[name] = rng.randint(0, 10_000)
        elif kind == "string":
            document[name] = "".join(rng.choices(string.ascii_lowercase + " ", k=rng.randint(1, 16)))
        elif kind == "boolean":
            document[name] = rng.random() < 0.5
        elif kind == "number":
            document[name] = round(rng.uniform(-100, 100), 3)
        elif kind == "enum":
            document[name] = rng.choice(ENUM)
        else:
            document[name] = [rng.randint(0, 100) for _ in range(rng.randint(0, 4))]
    return json.dumps(document)


def schema_problem(text: str, schema: dict[str, Any]) -> str | None:
    """Why `text` is not a document `schema` accepts (None: it is)."""
    import jsonschema

    try:
        document = json.loads(text)
    except ValueError as error:
        return f"not JSON: {error}"
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError as error:
        return f"against the schema: {error.message}"
    return None
