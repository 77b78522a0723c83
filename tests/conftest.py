import os

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Tests run on CUDA when present (set ADDNORM_TEST_DEVICE to force one), else on CPU."""
    name = os.environ.get("ADDNORM_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
