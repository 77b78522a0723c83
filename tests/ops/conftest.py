"""Fixtures shared by the ops tests."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import backends


@pytest.fixture
def fresh_registry():
    """The backend registry as in a fresh process (nothing imported, nothing resolved), and again afterwards, so
    that what a test registered or resolved does not outlive it."""
    backends.forget()
    yield
    backends.forget()


@pytest.fixture
def torch_threads():
    """set(n): run the test with n torch threads; the count before it is restored afterwards. (ATen's row sums
    depend on it: a lone row of >= 32768 values is split across threads.)"""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
