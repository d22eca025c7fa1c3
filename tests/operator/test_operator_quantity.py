"""Quantities are rendered the way the API server stores them (k8s.io/apimachinery's canonical
form), so a reconcile never mistakes the server's spelling for drift. The emulator's own
implementation (tests/support/quantities.py, on the official client's parse_quantity) is held to
the same table of the API server's forms: the operator is never checked against itself."""

from __future__ import annotations

import pytest
from kubernetes.utils import parse_quantity

from berth.operator.quantity import canonical_quantity
from tests.support import quantities

# (what a user writes, what a Kubernetes API server stores), as `kubectl get -o yaml` shows it.
CANONICAL = [
    ("0.5", "500m"),
    (0.5, "500m"),
    ("1.5", "1500m"),
    ("1000m", "1"),
    ("100m", "100m"),
    ("0.1", "100m"),
    (4, "4"),
    ("1000", "1k"),
    ("1500", "1500"),
    ("2000", "2k"),
    ("1000k", "1M"),
    ("128974848000m", "128974848"),
    ("1Gi", "1Gi"),
    ("1024Mi", "1Gi"),
    ("1.5Gi", "1536Mi"),
    ("0.5Gi", "512Mi"),
    ("0.5Ki", "512"),  # below 1Ki a binary amount is shown in decimal
    ("2048", "2048"),
    ("1e3", "1e3"),
    ("129e6", "129e6"),
    ("1.5e3", "1500"),
    ("0", "0"),
    ("0.0", "0"),
    ("-0.5", "-500m"),
    ("0.0000000001", "1n"),  # precision ends at nano units: rounded up
]


@pytest.mark.parametrize(("written", "stored"), CANONICAL, ids=[str(w) for w, _ in CANONICAL])
def test_canonical_form(written: str | int | float, stored: str) -> None:
    assert canonical_quantity(written) == stored
    assert canonical_quantity(stored) == stored  # canonical is a fixed point


@pytest.mark.parametrize(("written", "stored"), CANONICAL, ids=[str(w) for w, _ in CANONICAL])
def test_the_emulators_independent_canonical_form(written: str | int | float, stored: str) -> None:
    assert quantities.canonical(written) == stored
    if stored != "1n":  # the one rounded case
        assert parse_quantity(stored) == parse_quantity(str(written))  # the same amount


@pytest.mark.parametrize("bad", ["lots", "1.5.5", "Gi", "1Gb", True, ""])
def test_not_a_quantity(bad: object) -> None:
    with pytest.raises(ValueError, match="is not a Kubernetes quantity"):
        canonical_quantity(bad)  # type: ignore[arg-type]
    assert not quantities.is_quantity(bad)
