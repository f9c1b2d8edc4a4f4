"""Fixtures for the AllReduce tests (the harness itself is in ``harness.py``)."""

from __future__ import annotations

import pytest

from terascale.allreduce.protocol import new_key


@pytest.fixture
def key() -> bytes:
    """A fresh 32-byte attempt key."""
    return new_key()
