"""The quantized add + norm's edges on every backend: saturation, NaN and Inf, all-zero rows, scale_ub, the
in-place forms and ``out=``; and its refusals (group_size, scale, quant_dtype, requires grad, overlapping memory,
FP8 on a GPU below sm_89)."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops.quant.contract import QMAX, min_scale
from tests.ops.quant_oracle import ALL, QDTYPES, QIDS, inputs, skip_unavailable

NAN_CODE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F}


def _codes(q):
    return q.view(torch.uint8) if q.dtype != torch.int8 else q


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("qd", QDTYPES, ids=QIDS)
def test_static_scale_saturates_at_qmax(backend, qd):
    skip_unavailable(backend)
    x, r, w, _ = inputs((4, 192), torch.bfloat16, torch.bfloat16)
    tiny = torch.tensor([1e-9])  # |y| / 1e-9 is far beyond every format's range
    q, _, _ = addnorm.add_rms_norm_quant(x, r, w, quant_dtype=qd, scale=tiny, backend=backend)
    y = addnorm.add_rms_norm(x, r, w, out_dtype=torch.float32, backend="torch")[0]
    want = torch.where(y > 0, QMAX[qd], -QMAX[qd])
    assert torch.equal(q.to(torch.float32), want)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("qd", QDTYPES, ids=QIDS)
def test_nan_and_inf(backend, qd):
    """A NaN weight makes its column's y NaN, an Inf weight its column's y +-Inf (the rows stay finite)."""
    skip_unavailable(backend)
    x, r, w, _ = inputs((3, 64), torch.float32, torch.float32)
    w[3], w[5] = float("nan"), float("inf")
    nan = NAN_CODE.get(qd, 0)
    # static: NaN -> the NaN code (int8: 0), Inf saturates
    q, _, _ = addnorm.add_rms_norm_quant(x, r, w, quant_dtype=qd, scale=torch.tensor([0.05]), backend=backend)
    assert (_codes(q[:, 3]).to(torch.int64) & (0x7F if qd != torch.int8 else 0xFF) == nan).all()
    y = addnorm.add_rms_norm(x, r, w, out_dtype=torch.float32, backend="torch")[0]
    assert torch.equal(q[:, 5].to(torch.float32), torch.sign(y[:, 5]) * QMAX[qd])
    # dynamic: the NaN makes every row's scale NaN, hence all its fp8 codes NaN (int8: 0)
    q, _, s = addnorm.add_rms_norm_quant(x, r, w, quant_dtype=qd, backend=backend)
    assert s.isnan().all()
    if qd == torch.int8:
        assert (q == 0).all()
    else:
        assert q.to(torch.float32).isnan().all()
    # dynamic, Inf only: scale Inf, the Inf element NaN (Inf * 0), the rest 0; with scale_ub: Inf saturates
    w[3] = 1.0
    q, _, s = addnorm.add_rms_norm_quant(x, r, w, quant_dtype=qd, backend=backend)
    assert s.isinf().all()
    rest = torch.cat([q[:, :5], q[:, 6:]], 1)
    assert (rest.to(torch.float32) == 0).all()
    assert (q[:, 5] == 0).all() if qd == torch.int8 else q[:, 5].to(torch.float32).isnan().all()
    q, _, s = addnorm.add_rms_norm_quant(x, r, w, quant_dtype=qd, scale_ub=2.0, backend=backend)
    assert torch.equal(s, torch.full((3, 1), 2.0 / QMAX[qd]))
    assert torch.equal(q[:, 5].to(torch.float32), torch.sign(y[:, 5]) * QMAX[qd])


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("qd", QDTYPES, ids=QIDS)
def test_all_zero_rows_get_the_floor_scale_and_zeros(backend, qd):
    skip_unavailable(backend)
    x, r, w, _ = inputs((4, 256), torch.bfloat16, torch.bfloat16)
    r[1], r[3, 128:] = -x[1], -x[3, 128:]  # row 1 and the second group of row 3 sum to zero
    for is_rms in (True, False):
        fn = addnorm.add_rms_norm_quant if is_rms else addnorm.add_layer_norm_quant
        q, _, s = fn(x, r, w, quant_dtype=qd, group_size=128, backend=backend)
        assert s[1].eq(min_scale(qd)).all() and (q[1].to(torch.float32) == 0).all()
        assert torch.isfinite(s).all()
        if is_rms:  # (LayerNorm: the row's mean is not 0, so half a row of zeros is not a zero group)
            assert s[3, 1] == min_scale(qd) and (q[3, 128:].to(torch.float32) == 0).all()


@pytest.mark.parametrize("backend", ALL)
def test_scale_ub_bounds_the_scale(backend):
    skip_unavailable(backend)
    x, r, w, _ = inputs((8, 256), torch.bfloat16, torch.bfloat16)
    _, _, s_free = addnorm.add_rms_norm_quant(x, r, w, backend=backend)
    ub = float(s_free.median()) * 448.0
    for bound in (ub, torch.tensor([ub])):
        q, _, s = addnorm.add_rms_norm_quant(x, r, w, scale_ub=bound, backend=backend)
        assert torch.equal(s, torch.minimum(s_free, torch.tensor(ub / 448.0)))
        clipped = s_free.flatten() > s.flatten()
        assert clipped.any() and (q[clipped].to(torch.float32).abs().amax(1) == 448).all()


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_in_place_forms(backend, is_rms):
    """residual <- x + residual, q as the out-of-place op's; contiguous, row-strided and 3-D residuals."""
    skip_unavailable(backend)
    x, r, w, b = inputs((6, 256), torch.bfloat16, torch.float32)
    wide = torch.zeros(6, 300)
    for resid in (r.clone(), wide[:, 10:266], r.clone().view(2, 3, 256)):
        resid.copy_(r.view(resid.shape))
        xx = x.view(resid.shape)
        kw = dict(quant_dtype=torch.float8_e5m2, group_size=128, backend=backend)
        if is_rms:
            want = addnorm.add_rms_norm_quant(xx, resid.clone(), w, **kw)
            got = addnorm.add_rms_norm_quant_(xx, resid, w, **kw)
        else:
            want = addnorm.add_layer_norm_quant(xx, resid.clone(), w, b, **kw)
            got = addnorm.add_layer_norm_quant_(xx, resid, w, b, **kw)
        assert got[1] is resid and torch.equal(resid, want[1])
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[2], want[2])
    assert torch.equal(wide[:, :10], torch.zeros(6, 10)) and torch.equal(wide[:, 266:], torch.zeros(6, 34))


@pytest.mark.parametrize("backend", ALL)
def test_out_receives_q(backend):
    skip_unavailable(backend)
    x, r, w, _ = inputs((3, 128), torch.bfloat16, torch.bfloat16)
    out = torch.empty(3, 128, dtype=torch.int8)
    q, _, _ = addnorm.add_rms_norm_quant(x, r, w, quant_dtype=torch.int8, out=out, backend=backend)
    assert q is out and torch.equal(out, addnorm.add_rms_norm_quant(x, r, w, quant_dtype=torch.int8)[0])
    with pytest.raises(ValueError, match="out must be a torch.int8 tensor"):
        addnorm.add_rms_norm_quant(x, r, w, quant_dtype=torch.int8, out=out[:, :64], backend=backend)


def test_in_place_aliasing():
    buf = torch.randn(2, 4, 64)
    w = torch.ones(64)
    addnorm.add_rms_norm_quant_(buf[0], buf[1], w)  # disjoint slices of one buffer: fine
    with pytest.raises(ValueError, match="must not overlap"):
        addnorm.add_rms_norm_quant_(buf[0, :3], buf[0, 1:], w)
    with pytest.raises(ValueError, match="residual must be a tensor"):
        addnorm.add_rms_norm_quant_(buf[0], None, w)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(group_size=100), ValueError, "group_size 100 must divide"),
        (dict(group_size=0), ValueError, "positive int"),
        (dict(group_size=True), ValueError, "positive int"),
        (dict(group_size=64.0), ValueError, "positive int"),
        (dict(group_size=64, scale=torch.tensor([1.0])), ValueError, "group_size is for dynamic"),
        (dict(scale_ub=1.0, scale=torch.tensor([1.0])), ValueError, "scale_ub bounds dynamic"),
        (dict(scale_ub=-1.0), ValueError, "scale_ub must be"),
        (dict(scale_ub=torch.tensor([1.0, 2.0])), ValueError, "scale_ub must be a float32 tensor of one"),
        (dict(scale_ub=True), ValueError, "scale_ub must be a number > 0"),  # as group_size=True is refused
        (dict(scale_ub=torch.tensor([0.0])), ValueError, r"scale_ub must be > 0, got 0.0"),
        (dict(scale_ub=torch.tensor([-1.0])), ValueError, r"scale_ub must be > 0, got -1.0"),
        (dict(scale_ub=torch.tensor(float("nan"))), ValueError, r"scale_ub must be > 0, got nan"),
        (
            dict(scale=torch.tensor([0.0])),
            ValueError,
            r"scale must be > 0 and finite \(a dequantization scale\), got 0.0",
        ),
        (dict(scale=torch.tensor([-0.5])), ValueError, r"scale must be > 0 and finite .*, got -0.5"),
        (dict(scale=torch.tensor([float("nan")])), ValueError, r"scale must be > 0 and finite .*, got nan"),
        (dict(scale=torch.tensor([float("inf")])), ValueError, r"scale must be > 0 and finite .*, got inf"),
        (
            dict(out=torch.empty(1, 256, dtype=torch.float8_e4m3fn).expand(2, 256)),
            ValueError,
            "out must not be an expanded",
        ),
        (dict(scale=0.5), TypeError, "scale must be a float32 tensor"),
        (dict(scale=torch.tensor([1.0], dtype=torch.float64)), ValueError, "scale must be a float32"),
        (dict(scale=torch.ones(2)), ValueError, "scale must be a float32"),
        (dict(quant_dtype=torch.float16), TypeError, "quant_dtype must be one of"),
        (dict(quant_dtype=torch.uint8), TypeError, "quant_dtype must be one of"),
    ],
)
def test_bad_arguments_are_named(kw, err, match):
    x, r, w, _ = inputs((2, 256), torch.float32, torch.float32)
    with pytest.raises(err, match=match):
        addnorm.add_rms_norm_quant(x, r, w, **kw)


def test_requires_grad_is_an_error_in_grad_mode():
    x, r, w, b = inputs((2, 64), torch.float32, torch.float32)
    for name in ("x", "residual", "weight", "bias"):
        args = dict(x=x.clone(), residual=r.clone(), weight=w.clone(), bias=b.clone())
        args[name].requires_grad_(True)
        with pytest.raises(RuntimeError, match=f"{name} requires grad"):
            addnorm.add_layer_norm_quant(**args)
        with torch.no_grad():
            addnorm.add_layer_norm_quant(**args)  # inference: fine
    rg = r.clone().requires_grad_(True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="residual requires grad"):
        addnorm.add_rms_norm_quant_(x, rg, w)  # written in place: refused even without grad mode


def test_triton_fp8_needs_sm89(monkeypatch):
    from addnorm.ops.triton import quant as triton_quant

    if triton_quant.triton is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(triton_quant, "_INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    reason = triton_quant.unavailable_reason(torch.device("cuda"), torch.float8_e4m3fn)
    assert reason is not None and "sm_89" in reason and "sm_80" in reason
    assert triton_quant.unavailable_reason(torch.device("cuda"), torch.int8) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert triton_quant.unavailable_reason(torch.device("cuda"), torch.float8_e4m3fn) is None
