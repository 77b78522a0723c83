"""Every public op's bool options are Python bools: anything else (1, 0, "no", a tensor, numpy's bool, None) is a
TypeError naming the option and the value, raised before anything is computed or written, never read by
truthiness (where ``"no"`` is True and ``torch.tensor(0.)`` False). numpy.bool_ is refused too, as norm_add's
flags refuse it (it is no ``bool`` subclass; ``bool(flag)`` is the fix)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import addnorm
from addnorm import nn as ann
from addnorm.compat import flash_attn as fa
from addnorm.compat.liger import liger_fused_add_rms_norm

N = 16
BAD = {
    "1": 1,
    "0": 0,
    "no": "no",
    "empty-str": "",
    "0.5": 0.5,
    "None": None,
    "tensor0": torch.tensor(0.0),
    "tensorTrue": torch.tensor(True),
    "np.True_": np.True_,
    "np.False_": np.False_,
}


def _t(*shape):
    return torch.randn(*shape)


def _q(fn, **kw):
    return fn(_t(2, N), _t(2, N), _t(N), quant_dtype=torch.int8, backend="torch", **kw)


def _q_(fn, ln, **kw):
    b = (_t(N),) if ln else ()
    return fn(_t(2, N), _t(2, N), _t(N), *b, quant_dtype=torch.int8, backend="torch", **kw)


# public op -> (call with the flag keywords, its bool options)
ZC_CBW = ("zero_centered_weight", "cast_before_weight")
OPS = {
    "add_rms_norm": (lambda **kw: addnorm.add_rms_norm(_t(2, N), _t(2, N), _t(N), backend="torch", **kw), ZC_CBW),
    "add_layer_norm": (
        lambda **kw: addnorm.add_layer_norm(_t(2, N), _t(2, N), _t(N), _t(N), backend="torch", **kw),
        ZC_CBW,
    ),
    "rms_norm": (lambda **kw: addnorm.rms_norm(_t(2, N), _t(N), backend="torch", **kw), ("cast_before_weight",)),
    "layer_norm": (
        lambda **kw: addnorm.layer_norm(_t(2, N), _t(N), _t(N), backend="torch", **kw),
        ("cast_before_weight",),
    ),
    "add_rms_norm_": (lambda **kw: addnorm.add_rms_norm_(_t(2, N), _t(2, N), _t(N), backend="torch", **kw), ZC_CBW),
    "add_layer_norm_": (
        lambda **kw: addnorm.add_layer_norm_(_t(2, N), _t(2, N), _t(N), _t(N), backend="torch", **kw),
        ZC_CBW,
    ),
    "add_norm_multi": (
        lambda **kw: addnorm.add_norm_multi(_t(2, N), _t(2, N), _t(N), _t(N), backend="torch", **kw),
        ("is_rms", *ZC_CBW, "return_dropout_mask"),
    ),
    "add_norm_multi-x1": (  # the composed route (x1 and weight1): the flags are read outside the fused op
        lambda **kw: addnorm.add_norm_multi(
            _t(2, N), _t(2, N), _t(N), _t(N), x1=_t(2, N), weight1=_t(N), backend="torch", **kw
        ),
        ("is_rms", *ZC_CBW, "return_dropout_mask"),
    ),
    "add_norm_linear": (
        lambda **kw: addnorm.add_norm_linear(_t(2, N), _t(2, N), _t(N), None, _t(4, N), backend="torch", **kw),
        ("is_rms", "zero_centered_weight"),
    ),
    "norm_add": (lambda **kw: addnorm.norm_add(_t(2, N), _t(2, N), _t(N), backend="torch", **kw), ZC_CBW),
    "norm_add_": (lambda **kw: addnorm.norm_add_(_t(2, N), _t(2, N), _t(N), backend="torch", **kw), ZC_CBW),
    "norm_add_norm": (
        lambda **kw: addnorm.norm_add_norm(_t(2, N), _t(2, N), _t(N), _t(N), backend="torch", **kw),
        ZC_CBW,
    ),
    "norm_add_norm_": (
        lambda **kw: addnorm.norm_add_norm_(_t(2, N), _t(2, N), _t(N), _t(N), backend="torch", **kw),
        ZC_CBW,
    ),
    "add_rms_norm_quant": (lambda **kw: _q(addnorm.add_rms_norm_quant, **kw), ZC_CBW),
    "add_layer_norm_quant": (lambda **kw: _q(addnorm.add_layer_norm_quant, **kw), ZC_CBW),
    "add_rms_norm_quant_": (lambda **kw: _q_(addnorm.add_rms_norm_quant_, False, **kw), ZC_CBW),
    "add_layer_norm_quant_": (lambda **kw: _q_(addnorm.add_layer_norm_quant_, True, **kw), ZC_CBW),
    "nn.RMSNorm": (lambda **kw: ann.RMSNorm(N, **kw)(_t(2, N), _t(2, N)), ZC_CBW),
    "nn.LayerNorm": (lambda **kw: ann.LayerNorm(N, **kw)(_t(2, N), _t(2, N)), ZC_CBW),
}
CASES = [(op, flag) for op, (_, flags) in OPS.items() for flag in flags]
# compat.flash_attn reads its flags by truthiness, as flash-attention does (a drop-in takes what upstream takes)
FA_OPS = {
    "flash_attn.layer_norm_fn": (
        lambda **kw: fa.layer_norm_fn(_t(2, N), _t(N), _t(N), _t(2, N), backend="torch", **kw),
        ("prenorm", "residual_in_fp32", "zero_centered_weight", "is_rms_norm", "return_dropout_mask"),
    ),
    "flash_attn.rms_norm_fn": (
        lambda **kw: fa.rms_norm_fn(_t(2, N), _t(N), None, _t(2, N), backend="torch", **kw),
        ("prenorm", "residual_in_fp32", "zero_centered_weight"),
    ),
    "flash_attn.layer_norm_linear_fn": (
        lambda **kw: fa.layer_norm_linear_fn(_t(2, N), _t(N), _t(N), _t(4, N), None, _t(2, N), backend="torch", **kw),
        ("prenorm", "residual_in_fp32", "is_rms_norm"),
    ),
    "flash_attn.RMSNorm": (lambda **kw: fa.RMSNorm(N, **kw)(_t(2, N)), ("zero_centered_weight",)),
    "flash_attn.LayerNorm": (lambda **kw: fa.LayerNorm(N, **kw)(_t(2, N)), ("zero_centered_weight",)),
}
FA_CASES = [(op, flag) for op, (_, flags) in FA_OPS.items() for flag in flags]


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize(("op", "flag"), CASES, ids=[f"{op}-{flag}" for op, flag in CASES])
def test_a_flag_that_is_no_bool_is_refused_by_name(op, flag, bad):
    value = BAD[bad]
    # (norm_add_norm's flags may also be a pair, one per norm, and say so)
    msg = f"^{flag} must be a bool( or a pair of bools)?, got {re.escape(repr(value))}$"
    with torch.no_grad(), pytest.raises(TypeError, match=msg):
        OPS[op][0](**{flag: value})


@pytest.mark.parametrize("value", [False, True])
@pytest.mark.parametrize(("op", "flag"), CASES, ids=[f"{op}-{flag}" for op, flag in CASES])
def test_a_real_bool_is_taken(op, flag, value):
    with torch.no_grad():
        OPS[op][0](**{flag: value})


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("op", ["add_rms_norm_", "add_layer_norm_"])
def test_the_in_place_refusal_comes_before_the_fast_path_writes(op, backend):
    from addnorm.ops import backends

    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    x, r, w = _t(1, N), _t(1, N), _t(N)
    before = x.clone(), r.clone()
    with torch.no_grad(), pytest.raises(TypeError, match="^zero_centered_weight must be a bool, got 0$"):
        getattr(addnorm, op)(x, r, w, zero_centered_weight=0, backend=backend)
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])


def test_a_module_flag_changed_after_construction_is_refused_at_the_call():
    m = ann.RMSNorm(N)
    m.zero_centered_weight = np.True_  # e.g. copied from a numpy config array
    with torch.no_grad(), pytest.raises(TypeError, match="^zero_centered_weight must be a bool, got np.True_$"):
        m(_t(2, N), _t(2, N))


def test_add_norm_multi_refuses_a_bool_dropout_p_on_the_composed_route():
    with pytest.raises(ValueError, match="^dropout_p must be in"):
        addnorm.add_norm_multi(_t(2, N), _t(2, N), _t(N), x1=_t(2, N), dropout_p=False, backend="torch")


def test_liger_passes_a_bool_for_a_numpy_offset():
    # np.float64(1.0) == 1 is a numpy bool: the shim must hand the op a real one
    x, r, w = _t(2, N), _t(2, N), _t(N)
    y, s = liger_fused_add_rms_norm(x, r, w, 1e-6, offset=np.float64(1.0), backend="torch")
    y1, s1 = liger_fused_add_rms_norm(x, r, w, 1e-6, offset=1.0, backend="torch")
    assert torch.equal(y, y1) and torch.equal(s, s1)


@pytest.mark.parametrize(("truthy", "falsy"), [(1, 0), (np.True_, np.False_), (torch.tensor(1.0), torch.tensor(0.0))])
@pytest.mark.parametrize(("op", "flag"), FA_CASES, ids=[f"{op}-{flag}" for op, flag in FA_CASES])
def test_flash_attn_takes_flags_by_truthiness_as_flash_attention_does(op, flag, truthy, falsy):
    fn = FA_OPS[op][0]
    for value, as_bool in ((truthy, True), (falsy, False)):
        torch.manual_seed(0)
        got = fn(**{flag: value})
        torch.manual_seed(0)
        want = fn(**{flag: as_bool})
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b)
