"""Fixtures shared by the ops tests."""

from __future__ import annotations

import pytest

from addnorm.ops import backends


@pytest.fixture
def fresh_registry():
    """The backend registry as in a fresh process (nothing imported, nothing resolved), and again afterwards, so
    that what a test registered or resolved does not outlive it."""
    backends.forget()
    yield
    backends.forget()
