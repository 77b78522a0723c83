"""The functional add + norm contract, on the backends that run everywhere (torch and reference), against
PyTorch and the float64 oracle; bad input; edge cases; torch.compile."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import addnorm
from addnorm.ops import backends
from addnorm.testing import TOLERANCES, assert_close, oracle

BACKENDS = ["torch", "reference"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _call(is_rms, x, r, w, b, eps, **kw):
    if is_rms:
        return addnorm.add_rms_norm(x, r, w, eps, **kw)
    return addnorm.add_layer_norm(x, r, w, b, eps, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_layer_norm_and_rms_norm(backend):
    x = torch.randn(4, 3, 33)
    ln = torch.nn.LayerNorm(33)
    torch.nn.init.normal_(ln.weight)
    torch.nn.init.normal_(ln.bias)
    with torch.no_grad():
        torch.testing.assert_close(addnorm.layer_norm(x, ln.weight, ln.bias, 1e-5, backend=backend), ln(x))
        w = torch.randn(33)
        torch.testing.assert_close(addnorm.rms_norm(x, w, backend=backend), F.rms_norm(x, (33,), w))


CASES = [
    # (shape, is_rms, residual, weight, bias, zero_centered, residual_dtype)
    ((7, 33), False, True, True, True, False, None),
    ((1, 50), True, True, True, False, False, None),
    ((0, 16), False, True, True, True, False, None),
    ((2, 3, 17), True, False, True, False, True, None),
    ((5, 24), False, False, False, False, False, None),
    ((3, 40), True, True, False, False, False, torch.float32),
    ((4, 31), False, True, True, False, True, torch.float32),
    ((3, 29), True, True, True, False, False, torch.bfloat16),  # residual stream rounded below x's precision
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'rms' if c[1] else 'ln'}")
def test_forward_and_every_gradient_vs_float64_oracle(backend, dtype, case):
    shape, is_rms, has_res, has_w, has_b, zc, rd = case
    n = shape[-1]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    r = torch.randn(shape, dtype=dtype, requires_grad=True) if has_res else None
    w = (torch.randn(n, dtype=dtype) * 0.5 + (0 if zc else 1)).requires_grad_() if has_w else None
    b = torch.randn(n, dtype=dtype, requires_grad=True) if has_b else None
    out, res_out = _call(is_rms, x, r, w, b, 1e-5, zero_centered_weight=zc, residual_dtype=rd, backend=backend)
    want_rd = rd or dtype
    assert out.dtype == dtype and res_out.dtype == want_rd and out.shape == x.shape == res_out.shape

    dout = torch.randn(shape, dtype=dtype)
    dres = torch.randn(shape, dtype=want_rd)
    ((out.double() * dout.double()).sum() + (res_out.double() * dres.double()).sum()).backward()
    exp = oracle(
        x, r, w, b, eps=1e-5, is_rms=is_rms, residual_dtype=rd, zero_centered_weight=zc, dout=dout, dresidual_out=dres
    )
    m = math.prod(shape[:-1])
    # the torch backend's autograd rounds gradients through a lower-precision residual stream: allow for it
    low = max((dtype, want_rd), key=lambda d: TOLERANCES[d].rtol)
    assert_close(out, exp["out"], "out", dtype=low)
    assert_close(res_out, exp["residual_out"], "residual_out")
    assert_close(x.grad, exp["dx"], "dx", grad=True, dtype=low)
    if r is not None:
        assert_close(r.grad, exp["dresidual"], "dresidual", grad=True, dtype=low)
    if w is not None:
        assert_close(w.grad, exp["dweight"], "dweight", grad=True, reduced_rows=m, dtype=low)
    if b is not None:
        assert_close(b.grad, exp["dbias"], "dbias", grad=True, reduced_rows=m, dtype=low)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    x, r = (torch.randn(3, 9, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(9, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda *a: addnorm.add_layer_norm(*a, backend=backend), (x, r, w, b))
    assert torch.autograd.gradcheck(
        lambda x, r, w: addnorm.add_rms_norm(x, r, w, 1e-6, zero_centered_weight=True, backend=backend), (x, r, w)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [False, True])
def test_residual_out_is_the_stored_sum_and_out_normalizes_it_exactly(backend, is_rms):
    x = torch.randn(6, 64, dtype=torch.bfloat16)
    r = torch.randn(6, 64, dtype=torch.bfloat16) * 30
    w = torch.randn(64, dtype=torch.bfloat16)
    out, res_out = _call(is_rms, x, r, w, None, 1e-5, backend=backend)
    assert torch.equal(res_out, (x.float() + r.float()).bfloat16())
    # fused and unfused code agree bit for bit: the value normalized is residual_out as stored
    unfused = (
        addnorm.rms_norm(res_out, w, 1e-5, backend=backend)
        if is_rms
        else addnorm.layer_norm(res_out, w, None, 1e-5, backend=backend)
    )
    assert torch.equal(out, unfused)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_residual_stream_with_bf16_x(backend):
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    r = torch.randn(4, 32, dtype=torch.float32)
    out, res_out = addnorm.add_rms_norm(x, r, residual_dtype=torch.float32, backend=backend)
    assert out.dtype == torch.bfloat16 and res_out.dtype == torch.float32
    assert torch.equal(res_out, x.float() + r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_non_contiguous_inputs(backend):
    big = torch.randn(5, 80, dtype=torch.float64)
    x = big[:, 7:40]  # rows strided, last dim contiguous
    xt = torch.randn(33, 5, dtype=torch.float64).t()  # last dim strided
    w = torch.randn(33, dtype=torch.float64)
    for inp in (x, xt):
        got, res = addnorm.add_layer_norm(inp, xt, w, None, backend=backend)
        want = F.layer_norm(inp + xt, (33,), w, None, 1e-5)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(res, inp + xt)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_give_empty_outputs_and_gradients(backend):
    x = torch.randn(0, 12, requires_grad=True)
    w = torch.randn(12, requires_grad=True)
    out, res = addnorm.add_rms_norm(x, None, w, backend=backend)
    assert out.shape == (0, 12) and res.shape == (0, 12)
    out.sum().backward()
    assert x.grad.shape == (0, 12) and torch.equal(w.grad, torch.zeros(12))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [False, True])
def test_nan_and_inf_stay_in_their_rows(backend, is_rms):
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    out, _ = _call(is_rms, x, None, torch.ones(16), torch.zeros(16), 1e-5, backend=backend)
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[3]).all()
    assert not torch.isfinite(out[1]).all() and not torch.isfinite(out[2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_constant_rows_give_the_bias(backend, dtype):
    x = torch.full((3, 40), 3.25, dtype=dtype)
    b = torch.linspace(-1, 1, 40, dtype=dtype)
    out = addnorm.layer_norm(x, torch.ones(40, dtype=dtype), b, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, b.expand(3, 40), atol=1e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms", [False, True])
def test_fp16_at_the_edge_of_its_range_gives_finite_statistics(backend, is_rms):
    x = (torch.rand(3, 1024) * 2 - 1).half() * 65504
    x[:, 0] = 65504
    out, _ = _call(is_rms, x, None, None, None, 1e-5, backend=backend)
    assert torch.isfinite(out).all()
    want = F.rms_norm(x.float(), (1024,), eps=1e-5) if is_rms else F.layer_norm(x.float(), (1024,), eps=1e-5)
    torch.testing.assert_close(out.float(), want, atol=4e-3, rtol=4e-3)


# ---- dropout ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_keeps_fraction_scales_and_zeroes_grad_where_dropped(backend):
    p = 0.3
    x = (torch.rand(64, 96) + 0.5).requires_grad_()  # nonzero everywhere, so zeros mean "dropped"
    out, res = addnorm.add_layer_norm(x, None, dropout_p=p, backend=backend)
    kept = res != 0
    frac = kept.double().mean().item()
    assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / kept.numel())
    torch.testing.assert_close(res[kept], x.detach()[kept] / (1 - p))
    res.sum().backward()
    assert torch.equal(x.grad == 0, ~kept)
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 1 / (1 - p)))


def test_reference_backend_dropout_mask_is_the_seeded_hash():
    from addnorm.ops.contract import dropout_keep_mask

    torch.manual_seed(5)
    x = torch.rand(8, 40) + 0.5
    res = torch.ops.addnorm.add_norm_fwd(x, None, None, None, 1e-5, True, 0.25, torch.float32, False, True, "reference")
    seed = int(res[4])
    assert torch.equal(res[1] != 0, dropout_keep_mask(seed, 8, 40, 0.25))


# ---- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(x=torch.randn(2, 8), weight=torch.randn(7)), ValueError, ["weight", "(8,)", "(7,)"]),
        (dict(x=torch.randn(2, 8), bias=torch.randn(2, 8)), ValueError, ["bias", "(8,)"]),
        (dict(x=torch.randn(2, 8), residual=torch.randn(2, 9)), ValueError, ["residual", "(2, 8)", "(2, 9)"]),
        (dict(x=torch.ones(2, 8, dtype=torch.int64)), TypeError, ["x", "int64"]),
        (dict(x=torch.randn(2, 8), residual=torch.ones(2, 8, dtype=torch.int32)), TypeError, ["residual", "int32"]),
        (dict(x=torch.randn(2, 8), eps=-1.0), ValueError, ["eps", "-1.0"]),
        (dict(x=torch.randn(2, 8), eps=float("nan")), ValueError, ["eps"]),
        (dict(x=torch.randn(2, 8), dropout_p=1.0), ValueError, ["dropout_p"]),
        (dict(x=torch.randn(2, 0)), ValueError, ["last dimension"]),
        (dict(x=torch.randn(2, 8), residual_dtype=torch.int8), TypeError, ["residual_dtype"]),
        (dict(x=torch.randn(2, 8), out_dtype=torch.int32), TypeError, ["out_dtype", "int32"]),
        (dict(x=[1.0, 2.0]), TypeError, ["x", "list"]),
        (dict(x=torch.randn(2, 8), backend="cuda-magic"), ValueError, ["backend", "cuda-magic"]),
    ],
)
def test_bad_input_names_the_argument(kwargs, exc, words):
    with pytest.raises(exc) as info:
        addnorm.add_layer_norm(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_device_mismatch_is_rejected():
    with pytest.raises(ValueError, match="residual must be on"):
        addnorm.add_layer_norm(torch.randn(2, 8), torch.randn(2, 8, device="cuda"))


# ---- backend selection -----------------------------------------------------------------------------------------


def test_env_var_overrides_auto(monkeypatch):
    monkeypatch.setenv("ADDNORM_BACKEND", "reference")
    assert backends.resolve_backend("auto", torch.device("cpu")) == "reference"
    monkeypatch.setenv("ADDNORM_BACKEND", "bogus")
    with pytest.raises(ValueError, match="ADDNORM_BACKEND"):
        backends.resolve_backend("auto", torch.device("cpu"))


def test_the_override_is_read_stripped_and_auto_means_none(monkeypatch):
    monkeypatch.delenv("ADDNORM_BACKEND", raising=False)
    assert backends.backend_override() is None
    for value, want in (("", None), ("  ", None), ("auto", None), (" auto ", None), (" cpu\n", "cpu"), ("x", "x")):
        monkeypatch.setenv("ADDNORM_BACKEND", value)
        assert backends.backend_override() == want, value


def test_addnorm_backend_has_one_reader():
    """Every place under ops/ that looks ADDNORM_BACKEND up lies inside backends.backend_override (the fast path,
    the general path and the torch.func fallback all ask it), so the override cannot mean one thing here and another
    there. (`addnorm info` prints the variable's raw value: a report, not a choice of backend.)"""
    import inspect
    from pathlib import Path

    ops = Path(backends.__file__).parent
    lines, start = inspect.getsourcelines(backends.backend_override)
    owner = {("backends.py", start + i) for i in range(len(lines))}
    readers = set()
    for path in ops.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            looks_up = any(call in line for call in ("environ.get(", "environ[", "getenv(", "_ENV_TABLE.get("))
            if looks_up and ("ENV_VAR" in line or "ADDNORM_BACKEND" in line or "_ENV_KEY" in line):
                readers.add((str(path.relative_to(ops)), i))
    assert readers and readers <= owner, sorted(readers - owner)


def test_auto_takes_the_cpu_backend_for_cpu_tensors_of_every_size(monkeypatch):
    # no size switch (batch invariance: tests/ops/test_batch_invariance.py); torch only when numba is missing
    monkeypatch.delenv("ADDNORM_BACKEND", raising=False)
    cpu = torch.device("cpu")
    want = "cpu" if backends.unavailable_reason("cpu", cpu) is None else "torch"
    assert backends.resolve_backend("auto", cpu) == want


def test_unavailable_backend_says_why_and_what_to_install(monkeypatch, fresh_registry):
    monkeypatch.setitem(
        backends.KERNEL_BACKENDS,
        "cpu",
        backends.KernelBackend("cpu", "addnorm.ops._does_not_exist", "`pip install numba`"),
    )
    with pytest.raises(backends.BackendUnavailableError, match="pip install numba"):
        addnorm.rms_norm(torch.randn(2, 4), backend="cpu")
    # auto falls back to what runs
    assert backends.resolve_backend("auto", torch.device("cpu")) == "torch"


# ---- properties --------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(shift=st.floats(-100, 100), scale=st.floats(0.01, 100), n=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_layer_norm_invariant_to_shift_and_positive_scale(shift, scale, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n, dtype=torch.float64, generator=g)
    base = addnorm.layer_norm(x, eps=0.0, backend="torch")
    torch.testing.assert_close(
        addnorm.layer_norm(x * scale + shift, eps=0.0, backend="torch"), base, atol=1e-8, rtol=1e-8
    )


@settings(max_examples=25, deadline=None)
@given(scale=st.floats(0.01, 100), n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rms_norm_invariant_to_positive_scale(scale, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n, dtype=torch.float64, generator=g)
    base = addnorm.rms_norm(x, eps=0.0, backend="reference")
    torch.testing.assert_close(addnorm.rms_norm(x * scale, eps=0.0, backend="reference"), base, atol=1e-8, rtol=1e-8)


# ---- torch.compile -----------------------------------------------------------------------------------------------


def test_compile_fullgraph_through_the_custom_ops_matches_eager():
    def f(x, r, w, b):
        out, res = addnorm.add_layer_norm(x, r, w, b, backend="reference")
        return out * 2 + res

    args = [
        torch.randn(4, 24, requires_grad=True),
        torch.randn(4, 24, requires_grad=True),
        torch.randn(24, requires_grad=True),
        torch.randn(24, requires_grad=True),
    ]
    eager = f(*args)
    grads_eager = torch.autograd.grad(eager.square().sum(), args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    grads_compiled = torch.autograd.grad(compiled.square().sum(), args)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(grads_compiled, grads_eager):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_with_auto_backend_before_any_eager_call(fresh_registry):
    """auto's resolution (imports, environment) must not be traced: it is a constant of the compiled graph."""

    def f(x, r):
        return addnorm.add_rms_norm(x, r, eps=1e-6)[0]

    x, r = torch.randn(3, 20), torch.randn(3, 20)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, r), f(x, r))


# ---- cast_before_weight: Hugging Face Llama's rounding order ----------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("rd", [None, torch.float32], ids=["stream-x", "stream-fp32"])
def test_cast_before_weight_forward_and_every_gradient_vs_oracle(backend, dtype, is_rms, rd):
    x, r = (torch.randn(9, 45, dtype=dtype, requires_grad=True) for _ in range(2))
    w = (1 + 0.5 * torch.randn(45)).to(dtype).requires_grad_()
    b = None if is_rms else torch.randn(45, dtype=dtype, requires_grad=True)
    out, res_out = _call(is_rms, x, r, w, b, 1e-5, residual_dtype=rd, cast_before_weight=True, backend=backend)
    dout, dres = torch.randn_like(out), torch.randn_like(res_out)
    torch.autograd.backward((out, res_out), (dout, dres))
    exp = oracle(
        x, r, w, b, eps=1e-5, is_rms=is_rms, residual_dtype=rd, cast_before_weight=True, dout=dout, dresidual_out=dres
    )
    assert_close(out, exp["out"], "out")
    for name, t in (("dx", x), ("dresidual", r), ("dweight", w), ("dbias", b)):
        if t is not None:
            assert_close(t.grad, exp[name], name, grad=True, reduced_rows=9 if name in ("dweight", "dbias") else 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_before_weight_is_llamas_formula_bit_for_bit(backend):
    """bf16 out == HF LlamaRMSNorm's ``weight * (h * rsqrt(mean(h^2) + eps)).to(bf16)``; the default (one rounding,
    after the weight) differs from it in many elements, so the option is what makes the two agree."""
    x, r = (torch.randn(64, 96) * 3).bfloat16(), torch.randn(64, 96).bfloat16()
    w = (1 + 0.5 * torch.randn(96)).bfloat16()
    out, res_out = addnorm.add_rms_norm(x, r, w, 1e-6, cast_before_weight=True, backend=backend)
    h = res_out.float()
    llama = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(res_out, x + r) and torch.equal(out, llama)
    fused_once, _ = addnorm.add_rms_norm(x, r, w, 1e-6, backend=backend)
    assert (fused_once != llama).float().mean() > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_before_weight_changes_nothing_without_a_cast_or_an_affine_step(backend):
    x, r, w = torch.randn(5, 24), torch.randn(5, 24), torch.randn(24)
    for args in ((x, r, w), (x.bfloat16(), r.bfloat16(), None)):  # fp32: the cast is exact; no weight: no cast
        plain = addnorm.add_rms_norm(*args, 1e-5, backend=backend)
        cast = addnorm.add_rms_norm(*args, 1e-5, cast_before_weight=True, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(plain, cast))


def test_cast_before_weight_under_compile_matches_eager():
    x, r = (torch.randn(4, 40, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w = (1 + torch.randn(40)).bfloat16().requires_grad_()

    def f(x, r, w):
        return addnorm.add_rms_norm(x, r, w, 1e-6, cast_before_weight=True, backend="reference")[0]

    eager = f(x, r, w)
    grads_eager = torch.autograd.grad(eager.float().square().sum(), (x, r, w))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)
    grads_compiled = torch.autograd.grad(compiled.float().square().sum(), (x, r, w))
    assert torch.equal(compiled, eager)
    for a, b in zip(grads_compiled, grads_eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu", "triton"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_cast_before_weight_dweight_uses_the_rounded_value(backend, is_rms):
    """One row, an fp32 weight: dweight is exactly dout * round(xhat) (no sum, no rounding after), so a backend that
    used the unrounded xhat is off by bf16's rounding error and this test sees it."""
    if backends.unavailable_reason(backend, torch.device("cpu")) is not None:
        pytest.skip(backends.unavailable_reason(backend, torch.device("cpu")))
    x = torch.randn(1, 77).bfloat16()
    w = (1 + torch.randn(77)).requires_grad_()
    b = None if is_rms else torch.zeros(77)
    xq = _call(is_rms, x, None, None, None, 1e-5, backend=backend)[0]  # the normalized value, rounded to bf16
    out, _ = _call(is_rms, x, None, w, b, 1e-5, cast_before_weight=True, backend=backend)
    dout = torch.randn(1, 77).bfloat16()
    out.backward(dout)
    assert torch.equal(w.grad, (dout.float() * xq.float())[0])


# ---- out_dtype ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "x_dtype, out_dtype",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float64, torch.float16)],
    ids=str,
)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_out_dtype_forward_and_every_gradient_vs_oracle(backend, x_dtype, out_dtype, is_rms):
    """e.g. an fp32 residual stream whose normalized output feeds a bf16 matmul: out is written in bf16 directly."""
    x, r = (torch.randn(7, 33, dtype=x_dtype, requires_grad=True) for _ in range(2))
    w = (1 + 0.5 * torch.randn(33)).to(x_dtype).requires_grad_()
    b = None if is_rms else torch.randn(33, dtype=x_dtype, requires_grad=True)
    out, res_out = _call(is_rms, x, r, w, b, 1e-5, out_dtype=out_dtype, backend=backend)
    assert out.dtype == out_dtype and res_out.dtype == x_dtype
    dout, dres = torch.randn_like(out), torch.randn_like(res_out)
    torch.autograd.backward((out, res_out), (dout, dres))
    exp = oracle(x, r, w, b, eps=1e-5, is_rms=is_rms, out_dtype=out_dtype, dout=dout, dresidual_out=dres)
    low = max((x_dtype, out_dtype), key=lambda d: TOLERANCES[d].rtol)  # dout arrives in out's precision
    assert_close(out, exp["out"], "out")
    assert_close(res_out, exp["residual_out"], "residual_out")
    for name, t in (("dx", x), ("dresidual", r), ("dweight", w), ("dbias", b)):
        if t is not None:
            assert t.grad.dtype == t.dtype
            assert_close(
                t.grad, exp[name], name, grad=True, dtype=low, reduced_rows=7 if name in ("dweight", "dbias") else 1
            )


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu", "triton"])
def test_cast_before_weight_rounds_to_out_dtype_in_the_backward_too(backend):
    """fp32 x, bf16 out: the forward rounds xhat to bf16 (out's dtype, not x's) and dweight sums dout * that value;
    with one row and an fp32 weight the gradient is that product exactly."""
    if backends.unavailable_reason(backend, torch.device("cpu")) is not None:
        pytest.skip(backends.unavailable_reason(backend, torch.device("cpu")))
    x = torch.randn(1, 77)
    w = (1 + torch.randn(77)).requires_grad_()
    xq = addnorm.add_rms_norm(x, None, None, 1e-5, out_dtype=torch.bfloat16, backend=backend)[0]
    out, _ = addnorm.add_rms_norm(x, None, w, 1e-5, cast_before_weight=True, out_dtype=torch.bfloat16, backend=backend)
    assert torch.equal(out, (xq.float() * w.detach()).bfloat16())
    dout = torch.randn(1, 77).bfloat16()
    out.backward(dout)
    assert torch.equal(w.grad, (dout.float() * xq.float())[0])


def test_out_dtype_under_compile_matches_eager():
    x, r = (torch.randn(4, 40, requires_grad=True) for _ in range(2))
    w = torch.randn(40, requires_grad=True)

    def f(x, r, w):
        out, res = addnorm.add_rms_norm(x, r, w, 1e-6, out_dtype=torch.bfloat16, backend="reference")
        return out.float().square().sum() + res.sum()

    eager = f(x, r, w)
    grads_eager = torch.autograd.grad(eager, (x, r, w))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w)
    grads_compiled = torch.autograd.grad(compiled, (x, r, w))
    assert torch.equal(compiled, eager)
    for a, b in zip(grads_compiled, grads_eager):
        assert torch.equal(a, b)


# ---- as users call it, on every backend that runs here ----------------------------------------------------------

ALL_BACKENDS = ["torch", "reference", "cpu", "triton"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # Triton's interpreter computes 1/0 with numpy, which warns
def test_zero_variance_row_with_eps_0_is_nan_like_torch_not_an_exception(backend, is_rms):
    """rstd = 1/sqrt(0) = inf: IEEE arithmetic gives NaN in out and in every gradient, as torch does. (The numba
    kernels raised ZeroDivisionError, Python's rule for float division, in the middle of a training step.)"""
    _skip_unavailable(backend)
    x = torch.full((2, 8), 0.0 if is_rms else 3.0, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    out, _ = _call(is_rms, x, None, w, None, 0.0, backend=backend)
    out.sum().backward()
    assert out.isnan().all() and x.grad.isnan().all() and w.grad.isnan().all()


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_second_derivative_through_a_kernel_backend_is_a_clear_error_not_a_wrong_number(backend):
    """The kernel backwards are first order. Differentiating their gradients again used to give a wrong number
    (reference: its torch code built a partial graph) or 'element 0 of tensors does not require grad'."""
    _skip_unavailable(backend)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    out, _ = addnorm.add_layer_norm(x, torch.randn(3, 8, dtype=torch.float64), w, backend=backend)
    gx, gw = torch.autograd.grad(out.square().sum(), (x, w), create_graph=True)
    with pytest.raises(RuntimeError, match=f"'{backend}' backend has no second derivative.*backend='torch'"):
        (gx.sum() + gw.sum()).backward()


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_create_graph_for_first_order_use_gives_the_same_gradients(backend):
    """create_graph=True (e.g. a gradient penalty elsewhere in the model) must not change first-order gradients."""
    _skip_unavailable(backend)
    x, r = (torch.randn(3, 8, requires_grad=True) for _ in range(2))
    w = torch.randn(8, requires_grad=True)

    def grads(create_graph):
        out, res = addnorm.add_rms_norm(x, r, w, 1e-6, backend=backend)
        return torch.autograd.grad(out.square().sum() + res.sum(), (x, r, w), create_graph=create_graph)

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a.detach(), b)


def test_torch_backend_has_second_derivatives():
    x, r = (torch.randn(3, 9, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(9, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradgradcheck(lambda *a: addnorm.add_layer_norm(*a, backend="torch"), (x, r, w, b))
    assert torch.autograd.gradgradcheck(lambda x, w: addnorm.add_rms_norm(x, None, w, backend="torch"), (x, w))


@pytest.mark.parametrize("n", [8, 1 << 13], ids=["tiny", "cpu-sized"])  # 5 x 8192: auto picks cpu outside vmap
def test_auto_under_torch_func_transforms_uses_the_torch_backend(n):
    xs = torch.randn(5, n)
    w, b = torch.randn(n), torch.randn(n)
    out = torch.func.vmap(lambda x: addnorm.add_layer_norm(x, None, w, b)[0])(xs)
    torch.testing.assert_close(out, F.layer_norm(xs, (n,), w, b))
    gw = torch.func.grad(lambda w: addnorm.add_rms_norm(xs, xs, w, 1e-6)[0].square().sum())(w)
    w_ = w.clone().requires_grad_()
    addnorm.add_rms_norm(xs, xs, w_, 1e-6, backend="torch")[0].square().sum().backward()
    torch.testing.assert_close(gw, w_.grad)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_kernel_backend_asked_for_under_vmap_says_so(backend, monkeypatch):
    _skip_unavailable(backend)
    w = torch.randn(8)
    with pytest.raises(
        RuntimeError, match=f"'{backend}' backend \\(backend='{backend}'\\) does not support torch.func"
    ):
        torch.func.vmap(lambda x: addnorm.rms_norm(x, w, backend=backend))(torch.randn(2, 3, 8))
    monkeypatch.setenv(backends.ENV_VAR, backend)
    with pytest.raises(RuntimeError, match="ADDNORM_BACKEND"):
        torch.func.grad(lambda x: addnorm.rms_norm(x, w).sum())(torch.randn(3, 8))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_activation_checkpointing_recomputes_the_same_dropout_and_gradients(backend, reentrant):
    """torch.utils.checkpoint replays the forward with the RNG state restored: the same seed, so the same dropout
    mask. The non-reentrant mode also allows the backward only one read of ctx.saved_tensors."""
    from torch.utils.checkpoint import checkpoint

    _skip_unavailable(backend)
    w = torch.randn(16, requires_grad=True)
    x, r = (torch.randn(4, 16, requires_grad=True) for _ in range(2))

    def f(x, r):
        return addnorm.add_layer_norm(x, r, w, None, dropout_p=0.3, backend=backend)[0].square().sum()

    def grads(run):
        for t in (x, r, w):
            t.grad = None
        torch.manual_seed(5)
        run().backward()
        return [t.grad for t in (x, r, w)]

    plain = grads(lambda: f(x, r))
    ckpt = grads(lambda: checkpoint(f, x, r, use_reentrant=reentrant))
    for a, b in zip(ckpt, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_numpy_scalar_eps_and_dropout_p_are_accepted_like_torch(backend):
    """np.float32 is no subclass of float (np.float64 is): configs read through numpy hand such scalars over, and
    torch.nn.functional takes them. They were rejected as 'eps must be a finite number'."""
    np = pytest.importorskip("numpy")
    _skip_unavailable(backend)
    x = torch.randn(3, 8)
    got = addnorm.add_layer_norm(x, x, None, None, np.float32(1e-3), dropout_p=np.float32(0.0), backend=backend)[0]
    torch.testing.assert_close(got, F.layer_norm(2 * x, (8,), eps=1e-3))
    torch.testing.assert_close(
        addnorm.rms_norm(x, None, np.float32(0.5), backend=backend), F.rms_norm(x, (8,), eps=0.5)
    )
