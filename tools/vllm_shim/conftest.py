"""vLLM's tests take a ``default_vllm_config`` fixture, which installs a default engine config for its CustomOp
dispatch; the shim's layers dispatch without one, so the fixture provides nothing."""

import pytest


@pytest.fixture
def default_vllm_config():
    return None
