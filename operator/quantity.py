"""Kubernetes resource quantities in the form the API server stores them.

The API server rewrites every quantity into its canonical form (`0.5` → `500m`, `1.5Gi` →
`1536Mi`, `1000` → `1k`); an operator that renders another spelling sees a difference on every
read and patches forever. The children are rendered in canonical form instead
(k8s.io/apimachinery resource.Quantity: CanonicalizeBytes).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated

from pydantic import WithJsonSchema

# Kubernetes' own quantity grammar (k8s.io/apimachinery resource.Quantity).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

# An int or a string in Kubernetes' quantity grammar, as the API server's own types declare it.
Quantity = Annotated[
    str | int | float,
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
        }
    ),
]


def check_quantity(value: str | int | float, where: str) -> None:
    if isinstance(value, bool) or not re.match(QUANTITY_PATTERN, str(value)):
        raise ValueError(f"{where}: {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 16Gi)")


_QUANTITY = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {exponent: suffix for suffix, exponent in _DECIMAL.items()}
_BINARY_SUFFIX = {0: "", **{exponent: suffix for suffix, exponent in _BINARY.items()}}


def parse_quantity(value: str | int | float) -> tuple[Fraction, str]:
    """(exact value, format: 'binary' | 'decimal' | 'exponent')."""
    match = _QUANTITY.match(str(value).strip())
    if isinstance(value, bool) or not match:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 2, 16Gi)")
    sign, number, suffix = match[1], match[2], match[3] or ""
    amount = Fraction(number) * (-1 if sign == "-" else 1)
    if suffix in _BINARY:
        return amount * 1024 ** _BINARY[suffix], "binary"
    if suffix[:1] in ("e", "E"):
        return amount * Fraction(10) ** int(suffix[1:]), "exponent"
    return amount * Fraction(10) ** _DECIMAL[suffix], "decimal"


def _decimal(amount: Fraction, exponent_style: bool) -> str:
    # Precision ends at nano units; the API server rounds smaller fractions up.
    scaled = amount * 10**9
    mantissa = -((-scaled.numerator) // scaled.denominator) if scaled.denominator != 1 else scaled.numerator
    if mantissa == 0:
        return "0"
    exponent = -9
    while mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    while exponent % 3:
        mantissa *= 10
        exponent -= 1
    if exponent_style:
        return f"{mantissa}e{exponent}" if exponent else str(mantissa)
    if exponent in _DECIMAL_SUFFIX:
        return f"{mantissa}{_DECIMAL_SUFFIX[exponent]}"
    return f"{mantissa}e{exponent}"


def canonical_quantity(value: str | int | float) -> str:
    """The spelling the API server stores `value` under."""
    amount, style = parse_quantity(value)
    if amount == 0:
        return "0"
    if style == "binary" and abs(amount) >= 1024 and amount.denominator == 1:
        mantissa, exponent = int(amount), 0
        while mantissa % 1024 == 0 and exponent < 6:
            mantissa //= 1024
            exponent += 1
        return f"{mantissa}{_BINARY_SUFFIX[exponent]}"
    # Small or fractional binary amounts are shown in decimal, as the API server does.
    return _decimal(amount, exponent_style=style == "exponent")
