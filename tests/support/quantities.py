"""Kubernetes quantities the way the API server stores them, for the emulator: written apart from
the operator's own (operator/quantity.py) so the tests do not check that code against itself.

The value comes from the official Python client's `kubernetes.utils.parse_quantity`; the grammar
and the canonical spelling follow k8s.io/apimachinery pkg/api/resource (Quantity.CanonicalizeBytes):
the format is kept (binary suffix, decimal suffix, or exponent), a binary amount below 1024 or
with a fraction is written in decimal, decimal amounts are rounded up to nano units and written
with the largest suffix (or exponent) whose power of 1000 divides them. tests/operator/
test_operator_quantity.py checks this against the API server's own canonical forms.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal

from kubernetes.utils import parse_quantity

# resource.Quantity's grammar (the regular expression the CRD's schema uses too).
GRAMMAR = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(\d+(\.\d*)?|\.\d+)))?$")
DECIMAL_SUFFIXES = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
BINARY_SUFFIXES = {0: "", 1: "Ki", 2: "Mi", 3: "Gi", 4: "Ti", 5: "Pi", 6: "Ei"}


def is_quantity(value: object) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (str, int, float))
        and bool(GRAMMAR.match(str(value)))
    )


def canonical(value: str | int | float) -> str:
    """The spelling the API server stores a quantity under."""
    text = str(value).strip()
    if not is_quantity(text):
        raise ValueError(f"quantities must match the regular expression {GRAMMAR.pattern!r}: {text!r}")
    amount = parse_quantity(text)
    binary = text.endswith("i")
    exponent_form = bool(re.search(r"[eE]", text))
    if amount == 0:
        return "0"
    if binary and abs(amount) >= 1024 and amount == amount.to_integral_value():
        mantissa, power = int(amount), 0
        while mantissa % 1024 == 0 and power < 6:
            mantissa //= 1024
            power += 1
        return f"{mantissa}{BINARY_SUFFIXES[power]}"
    # Decimal: rounded up to whole nano units, then the largest power of 1000 that divides it.
    nanos = int((amount * Decimal(10) ** 9).to_integral_value(rounding=ROUND_CEILING))
    exponent = -9
    while nanos % 1000 == 0 and exponent < 18:
        nanos //= 1000
        exponent += 3
    if exponent_form:
        return f"{nanos}e{exponent}" if exponent else str(nanos)
    return f"{nanos}{DECIMAL_SUFFIXES[exponent]}"
