"""The decode-size fast paths give the general paths' bits: the torch backend's one-dtype RMSNorm
without gradients (eager's ``x + r; F.rms_norm``), the in-place op on the torch backend, and the nn modules' direct
call; bad input and a weight changed after the first call still raise errors that name them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import addnorm
from addnorm.nn import LayerNorm, RMSNorm
from addnorm.ops import torch_backend as TB
from addnorm.ops.contract import AddNormSpec

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# 0 rows, 1 row, N not a power of two, a decode row of 4096, many rows
SHAPES = [(0, 64), (1, 7), (1, 4096), (8, 4096), (3, 1000), (2, 5, 4095), (37, 130)]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    r = (2 * torch.randn(shape, generator=g)).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, r, w


def _general(x, r, w, eps, cast):
    d = x.dtype
    cast = cast and d not in (torch.float32, torch.float64)  # as run_add_norm drops it
    return TB.add_norm_general(x, r, w, None, AddNormSpec(eps, True, 0.0, d, False, cast, d))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("cast", [False, True], ids=["plain", "cbw"])
def test_torch_one_dtype_path_is_bitwise_the_general_path(dtype, shape, cast):
    x, r, w = _inputs(shape, dtype)
    for eps in (1e-6, 1e-5):
        for res, weight in ((r, w), (None, w), (r, None)):
            want = _general(x, res, weight, eps, cast)
            with torch.inference_mode():
                got = addnorm.add_rms_norm(x, res, weight, eps, cast_before_weight=cast, backend="torch")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[0].dtype == dtype and got[1].dtype == dtype


def test_strided_rows_take_the_fast_path_with_the_same_bits():
    xb, rb, _ = _inputs((6, 200), torch.bfloat16)
    w = _inputs((200,), torch.bfloat16, seed=1)[2][:130]
    x, r = xb[:, 10:140], rb[:, 50:180]  # rows of 130 with a row stride of 200
    want = _general(x, r, w, 1e-6, False)
    with torch.inference_mode():
        got = addnorm.add_rms_norm(x, r, w, 1e-6, backend="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_fast_path_is_taken_without_grad_and_not_with_it(monkeypatch):
    x, r, w = _inputs((2, 64), torch.bfloat16)
    calls = []
    real = TB.add_norm_general
    monkeypatch.setattr(TB, "add_norm_general", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        addnorm.add_rms_norm(x, r, w, backend="torch")
    assert calls == []
    wg = w.clone().requires_grad_(True)
    out, _ = addnorm.add_rms_norm(x, r, wg, backend="torch")  # a gradient: the statistics-dtype path
    assert calls == [1] and out.requires_grad
    with torch.no_grad():
        addnorm.add_rms_norm(x, r.float(), w, backend="torch")  # two dtypes: the general path
    assert calls == [1, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (3, 1000), (1, 7)], ids=str)
@pytest.mark.parametrize("cast", [False, True], ids=["plain", "cbw"])
def test_in_place_torch_fast_path_is_bitwise_the_general_path(dtype, shape, cast):
    x, r, w = _inputs(shape, dtype)
    want = _general(x, r, w, 1e-6, cast)
    xi, ri = x.clone(), r.clone()
    with torch.inference_mode():
        addnorm.add_rms_norm_(xi, ri, w, 1e-6, cast_before_weight=cast, backend="torch")
    assert torch.equal(xi, want[0]) and torch.equal(ri, want[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 7), (8, 4095)], ids=str)
def test_zero_centered_weight_on_the_torch_backend(monkeypatch, dtype, shape):
    """1 + w is the contract's in fp32/fp64 (x's own dtype): those calls take the one-dtype ops with weight + 1;
    in a half dtype 1 + w is no half value, so they fall back to the general path. Both: the general path's bits,
    out of place and in place."""
    x, r, w = _inputs(shape, dtype)
    w = w - 1  # stored as w - 1 (Gemma)
    served = dtype in (torch.float32, torch.float64)
    calls = []
    real = TB.add_norm_general
    monkeypatch.setattr(TB, "add_norm_general", lambda *a: calls.append(1) or real(*a))
    for cast, res, weight in ((False, r, w), (True, r, w), (False, None, w), (False, r, None)):
        spec = AddNormSpec(1e-6, True, 0.0, dtype, True, cast and not served, dtype)
        want = real(x, res, weight, None, spec)
        with torch.inference_mode():
            got = addnorm.add_rms_norm(
                x, res, weight, 1e-6, zero_centered_weight=True, cast_before_weight=cast, backend="torch"
            )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if weight is not None:
            plain = real(x, res, weight, None, dataclasses.replace(spec, zero_centered_weight=False))
            assert not torch.equal(got[0], plain[0])  # (1 + w was applied)
        if res is not None:
            xi, ri = x.clone(), r.clone()
            with torch.inference_mode():
                addnorm.add_rms_norm_(
                    xi, ri, weight, 1e-6, zero_centered_weight=True, cast_before_weight=cast, backend="torch"
                )
            assert torch.equal(xi, want[0]) and torch.equal(ri, want[1])
    # general-path calls: none where served; where not, the out-of-place calls with a weight (3) and in place (2,
    # which runs the out-of-place op); without a weight zero_centered_weight changes nothing and the call is served
    assert len(calls) == (0 if served else 5)


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize("backend", ["torch", "cpu", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_module_direct_call_is_bitwise_the_functional_call(cls, backend, dtype):
    x, r, _ = _inputs((2, 3, 96), dtype)
    norm = cls(96, eps=1e-5, dtype=dtype, backend=backend)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96))
    params = (norm.weight, norm.bias) if cls is LayerNorm else (norm.weight,)
    fn = addnorm.add_layer_norm if cls is LayerNorm else addnorm.add_rms_norm
    with torch.inference_mode():
        got, got_res = norm(x, r)
        alone = norm(x)
    want = fn(x, r, *params, 1e-5, backend=backend)  # parameters require grad: the general path
    assert torch.equal(got, want[0]) and torch.equal(got_res, want[1])
    assert torch.equal(alone, fn(x, None, *params, 1e-5, backend=backend)[0])


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_bad_input_and_residual_are_named(cls):
    norm = cls(16)
    with pytest.raises(ValueError, match="^input's trailing shape"):
        norm(torch.randn(2, 15))
    with pytest.raises(ValueError, match="^residual's trailing shape"):
        norm(torch.randn(2, 16), torch.randn(2, 15))
    with pytest.raises(TypeError, match="^residual must be a torch.Tensor"):
        norm(torch.randn(2, 16), [1.0] * 16)
    with pytest.raises(ValueError, match="^residual must have x's shape"):
        norm(torch.randn(2, 16), torch.randn(3, 16))


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
def test_a_weight_changed_after_the_first_call_is_checked_again(cls):
    norm = cls(16)
    x, r = torch.randn(2, 16), torch.randn(2, 16)
    with torch.inference_mode():
        norm(x, r)
    norm.weight.requires_grad_(False)
    norm.weight.data = torch.ones(16, dtype=torch.int32)
    with torch.inference_mode(), pytest.raises(TypeError, match="^weight must be float16"):
        norm(x, r)
    norm.weight.data = torch.ones(15)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"^weight must have shape \(16,\)"):
        norm(x, r)
    norm.weight = nn.Parameter(torch.ones(16, device="meta"))
    with torch.inference_mode(), pytest.raises(ValueError, match="^weight must be on x's device cpu"):
        norm(x, r)
    norm.weight = nn.Parameter(torch.full((16,), 2.0, dtype=torch.float64))  # valid: used as given
    with torch.inference_mode():
        out, _ = norm(x, r)
    fn = addnorm.add_layer_norm if cls is LayerNorm else addnorm.add_rms_norm
    params = (norm.weight, norm.bias) if cls is LayerNorm else (norm.weight,)
    assert torch.equal(out, fn(x, r, *params, norm.eps)[0])
    norm.eps = float("nan")
    with torch.inference_mode(), pytest.raises(ValueError, match="^eps must be a finite number"):
        norm(x, r)
