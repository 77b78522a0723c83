"""vLLM's ``tests/kernels/utils.opcheck``: ``torch.library.opcheck`` with ``torch.allclose`` made to accept float8
tensors (compared after promotion to float64), as vLLM's helper does; PyTorch itself has no float8 ``allclose``,
which opcheck's schema test needs to see whether an argument was mutated."""

from unittest import mock

import torch

ALL_OPCHECK_TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _allclose_any_float(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=equal_nan).all())


def opcheck(op, args, kwargs=None, *, test_utils=ALL_OPCHECK_TEST_UTILS, raise_exception=True, cond=True):
    if not cond:
        return {}
    with mock.patch("torch.allclose", new=_allclose_any_float):
        return torch.library.opcheck(op, args, kwargs, test_utils=test_utils, raise_exception=raise_exception)
