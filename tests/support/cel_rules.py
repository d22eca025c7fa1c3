"""The CRD's CEL rules (`x-kubernetes-validations`), evaluated the way the API server does, with a
CEL implementation from PyPI (cel-python): no real API server ever compiled them here, so the
emulator runs them on every custom resource it stores, and a rule that does not compile, or that
says something other than what it means, fails the tests that meet it.

As the API server: defaults from the schema are applied first (rules see a defaulted object),
each rule runs with `self` bound to the value at its node (every item, for rules under a list),
absent optional fields are not validated, and a failing rule answers 422 with its message.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import celpy


class RuleError(Exception):
    """A rule that cannot be compiled or evaluated (the CRD is wrong, not the object)."""


@functools.cache
def program(rule: str) -> Any:
    environment = celpy.Environment()
    try:
        return environment.program(environment.compile(rule))
    except celpy.CELParseError as error:
        raise RuleError(f"CEL rule does not compile: {rule!r}: {error}") from error


def with_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Structural defaulting: a missing property with a default gets it, inside present objects."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = with_defaults(sub, value[key])
        additional = schema.get("additionalProperties")
        if isinstance(additional, Mapping):
            for key in value:
                value[key] = with_defaults(additional, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [with_defaults(schema["items"], item) for item in value]
    return value


def _sites(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[tuple[str, dict[str, Any], Any]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from _sites(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            yield from _sites(schema["items"], item, f"{path}[{index}]")


def violations(schema: Mapping[str, Any], obj: Mapping[str, Any]) -> list[str]:
    """The API server's messages for every rule the object breaks ("" path: the root)."""
    defaulted = with_defaults(schema, copy.deepcopy(dict(obj)))
    messages = []
    for path, rule, value in _sites(schema, defaulted, ""):
        try:
            result = program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except RuleError:
            raise
        except Exception as error:  # celpy's evaluation errors: the rule is wrong for this shape
            raise RuleError(
                f"CEL rule {rule['rule']!r} failed to evaluate at {path or '<root>'}: {error}"
            ) from error
        if isinstance(result, Exception) or not isinstance(result, celpy.celtypes.BoolType):
            raise RuleError(f"CEL rule {rule['rule']!r} gave {result!r} at {path or '<root>'}, not a bool")
        if not bool(result):
            where = (path + rule.get("fieldPath", "")).lstrip(".") or "<root>"
            messages.append(f'{where}: Invalid value: "object": {" ".join(rule["message"].split())}')
    return messages
