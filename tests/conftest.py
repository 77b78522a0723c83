import os

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must be set before
# triton is imported.
try:
    import torch as _t

    if not _t.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Tests run on CUDA when present (set ADDNORM_TEST_DEVICE to force one), else on CPU."""
    name = os.environ.get("ADDNORM_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# One intra-op thread per test process: the suite runs with one xdist worker per core, and tiny matmuls only lose
# from more threads. Tests about threading set their own count.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
