"""Marks shared across the suite."""

from __future__ import annotations

from typing import Any

import pytest


def full_only(*values: Any) -> list[Any]:
    """Parameters of a sweep that only ``make test-full`` runs (marked ``full``): each
    repeats, at another size or shape, what the sweep's other parameters check."""
    return [pytest.param(value, marks=pytest.mark.full) for value in values]
