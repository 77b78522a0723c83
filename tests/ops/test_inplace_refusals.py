"""The in-place ops refuse bad input before writing anything (issue 30 items 4, 13 and 24): an expanded view, one
tensor passed as both x and residual (eagerly and under torch.compile(fullgraph=True)), and meta tensors, which have
no memory to alias."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops import backends

BACKENDS = ["torch", "reference", "cpu"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _call(is_rms, x, r, w, b, backend):
    if is_rms:
        return addnorm.add_rms_norm_(x, r, w, backend=backend)
    return addnorm.add_layer_norm_(x, r, w, b, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("expanded", ["x", "residual"])
def test_an_expanded_view_is_refused_before_anything_is_written(backend, is_rms, expanded):
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 16, generator=g).expand(4, 16)  # stride 0: four rows, one row of memory
    full = torch.randn(4, 16, generator=g)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    x, r = (row, full) if expanded == "x" else (full, row)
    before_x, before_r = x.clone(), r.clone()
    with pytest.raises(ValueError, match=f"^{expanded} has elements that share memory .*{expanded}.clone"):
        _call(is_rms, x, r, w, b, backend)
    # nothing written: a retry after the error does not add the residual twice
    assert torch.equal(x, before_x) and torch.equal(r, before_r)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_one_tensor_as_x_and_residual_under_compile_fullgraph_is_eagers_error(backend):
    _skip_unavailable(backend)
    x, w = torch.randn(4, 16), torch.randn(16)
    before = x.clone()
    with pytest.raises(ValueError, match="x and residual must not share memory") as eager:
        addnorm.add_rms_norm_(x, x, w, backend=backend)
    compiled = torch.compile(lambda x, w: addnorm.add_rms_norm_(x, x, w, backend=backend), fullgraph=True)
    with pytest.raises(ValueError) as traced:
        compiled(x, w)
    assert str(traced.value) == str(eager.value)
    assert torch.equal(x, before)  # neither wrote anything


@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_two_meta_tensors_run_and_views_of_one_are_refused(is_rms):
    x, r = torch.empty(4, 16, device="meta"), torch.empty(4, 16, device="meta", dtype=torch.float32)
    w, b = torch.empty(16, device="meta"), torch.empty(16, device="meta")
    xo, ro = _call(is_rms, x, r, w, b, "auto")  # meta tensors share no memory, though every data pointer is 0
    assert xo is x and ro is r and xo.device.type == "meta"
    with pytest.raises(
        ValueError, match=r"x and residual must not overlap in memory .*\[0, 256\) and residual \[0, 256\)"
    ):
        _call(is_rms, x, x.view(4, 16), w, b, "auto")
