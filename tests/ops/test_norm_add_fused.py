"""The fused norm-then-add kernels (issue 37): norm_add_norm against a float64 oracle, forward and every gradient
(from both outputs), on every backend (Triton in its interpreter at tiny sizes), over dtypes, options and awkward
shapes; the fused forward against the composition bit for bit; the in-place forms and their refusals; batch
invariance; the custom ops under opcheck and torch.compile; bad input."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import backends
from addnorm.ops.add_norm import add_layer_norm, add_rms_norm
from addnorm.ops.norm_add import norm_add, norm_add_, norm_add_norm, norm_add_norm_
from addnorm.testing import assert_close

ALL = ["torch", "reference", "cpu", "triton"]
KERNELS = ["cpu", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = {"3x40": (3, 40), "0 rows": (0, 24), "1 row": (1, 33), "2x5x77": (2, 5, 77)}


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _rounded(t, dtype):
    """t rounded to dtype as stored, its gradient passed straight through."""
    return t + (t.detach().to(dtype).double() - t.detach())


def _norm64(x, w, b, *, eps, is_rms, zc, cast_dtype):
    xhat = x if is_rms else x - x.mean(-1, keepdim=True)
    xhat = xhat * torch.rsqrt(xhat.square().mean(-1, keepdim=True) + eps)
    if cast_dtype is not None and (w is not None or b is not None):
        xhat = _rounded(xhat, cast_dtype)
    if w is not None:
        xhat = xhat * (w + 1 if zc else w)
    return xhat + b if b is not None else xhat


def chain_oracle(t, *, eps1, eps2, rms1, rms2, zc=(False, False), cbw=(False, False)):
    """(leaves, out2, h) of the sandwich chain in float64, written apart from the code under test: N1's output
    rounded to y's dtype, the sum to the promoted dtype, N2 of h as stored rounded to h's dtype."""
    leaves = {k: v.detach().double().requires_grad_(True) for k, v in t.items() if v is not None}
    y_dt, h_dt = t["y"].dtype, torch.promote_types(t["y"].dtype, t["residual"].dtype)
    n1 = _norm64(
        leaves["y"], leaves.get("w1"), leaves.get("b1"), eps=eps1, is_rms=rms1, zc=zc[0],
        cast_dtype=y_dt if cbw[0] else None,
    )  # fmt: skip
    h = _rounded(_rounded(n1, y_dt) + leaves["residual"], h_dt)
    n2 = _norm64(
        h, leaves.get("w2"), leaves.get("b2"), eps=eps2, is_rms=rms2, zc=zc[1], cast_dtype=h_dt if cbw[1] else None
    )
    return leaves, _rounded(n2, h_dt), h


def _inputs(shape, dtype, seed, *, b1, b2, residual_dtype=None, strided=False):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]

    def rnd(*s, scale=2.0):
        return (torch.randn(*s, generator=g) * scale + 0.5).to(dtype)

    y = rnd(*shape[:-1], n + 7)[..., :n] if strided else rnd(*shape)  # strided: rows of a wider buffer
    vec = lambda s, c: (c + s * torch.randn(n, generator=g)).to(dtype).requires_grad_(True)  # noqa: E731
    return dict(
        y=y.requires_grad_(True),
        residual=rnd(*shape).to(residual_dtype or dtype).requires_grad_(True),
        w1=vec(0.2, 1.0),
        b1=vec(0.1, 0.0) if b1 else None,
        w2=vec(0.2, 1.0),
        b2=vec(0.1, 0.0) if b2 else None,
    )


def _chain(t, backend, *, rms1, rms2, eps1=1e-5, eps2=1e-6, **kw):
    return norm_add_norm(
        t["y"], t["residual"], t["w1"], t["w2"], t["b1"], t["b2"], eps1, eps2,
        norm="rms" if rms1 else "layer", norm2="rms" if rms2 else "layer", backend=backend, **kw,
    )  # fmt: skip


def _check_grads(t, leaves, rows):
    for name, leaf in leaves.items():
        actual = t[name].grad
        assert actual is not None, f"no gradient reached {name}"
        reduced = rows if name[0] in "wb" else 1
        assert_close(actual, leaf.grad, f"d{name}", grad=True, reduced_rows=reduced)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norms", ["rms-rms", "layer-rms", "rms-layer"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chain_forward_and_every_gradient_match_the_float64_oracle(backend, dtype, norms, shape):
    _skip_unavailable(backend)
    if backend == "triton" and (dtype != torch.float32 or norms != "layer-rms") and shape != "3x40":
        pytest.skip("Triton's interpreter is slow: the reduced dtypes and other norms at one shape")
    rms1, rms2 = (k == "rms" for k in norms.split("-"))
    t = _inputs(SHAPES[shape], dtype, 1, b1=not rms1, b2=not rms2, strided=shape == "2x5x77")
    out2, h = _chain(t, backend, rms1=rms1, rms2=rms2)
    leaves, want2, want_h = chain_oracle(t, eps1=1e-5, eps2=1e-6, rms1=rms1, rms2=rms2)
    assert out2.dtype == h.dtype == dtype and out2.shape == h.shape == t["y"].shape
    assert_close(h, want_h, "h")
    assert_close(out2, want2, "out2")
    g = torch.Generator().manual_seed(2)
    c2, ch = (torch.randn(h.shape, generator=g).to(dtype) for _ in range(2))
    torch.autograd.backward((out2, h), (c2, ch))
    torch.autograd.backward((want2, want_h), (c2.double(), ch.double()))
    _check_grads(t, leaves, max(1, h.numel() // h.shape[-1]))


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("which", ["out2 only", "h only"])
def test_chain_gradient_from_one_output(backend, which):
    _skip_unavailable(backend)
    t = _inputs((4, 40), torch.float32, 3, b1=True, b2=False)
    out2, h = _chain(t, backend, rms1=False, rms2=True)
    leaves, want2, want_h = chain_oracle(t, eps1=1e-5, eps2=1e-6, rms1=False, rms2=True)
    (out2 if which == "out2 only" else h).sum().backward()
    (want2 if which == "out2 only" else want_h).sum().backward()
    if which == "h only":  # nothing reached the second norm's parameters
        assert t["w2"].grad is None or not t["w2"].grad.any()
        leaves.pop("w2")
    _check_grads(t, leaves, 4)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("option", ["zero_centered_weight", "cast_before_weight"])
@pytest.mark.parametrize("pair", [(True, False), (False, True)], ids=["first", "second"])
def test_chain_options_per_norm_match_the_oracle_in_bf16(backend, option, pair):
    _skip_unavailable(backend)
    t = _inputs((4, 48), torch.bfloat16, 4, b1=True, b2=False)
    out2, h = _chain(t, backend, rms1=False, rms2=True, **{option: pair})
    key = "zc" if option == "zero_centered_weight" else "cbw"
    leaves, want2, want_h = chain_oracle(t, eps1=1e-5, eps2=1e-6, rms1=False, rms2=True, **{key: pair})
    assert_close(h, want_h, "h")
    assert_close(out2, want2, "out2")
    (out2.float().sum() + h.float().square().sum()).backward()
    (want2.sum() + want_h.square().sum()).backward()
    _check_grads(t, leaves, 4)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtypes", ["bf16 y, fp32 residual", "fp16 y, bf16 residual", "fp32 y, fp64 residual"])
def test_mixed_dtypes_take_the_promoted_sum(backend, dtypes):
    """h has torch's promoted dtype; an fp64 residual under fp32 y (two statistics dtypes) composes the norms."""
    _skip_unavailable(backend)
    y_dt, r_dt = {
        "bf16 y, fp32 residual": (torch.bfloat16, torch.float32),
        "fp16 y, bf16 residual": (torch.float16, torch.bfloat16),
        "fp32 y, fp64 residual": (torch.float32, torch.float64),
    }[dtypes]
    t = _inputs((3, 40), y_dt, 5, b1=False, b2=True, residual_dtype=r_dt)
    out2, h = _chain(t, backend, rms1=True, rms2=False)
    leaves, want2, want_h = chain_oracle(t, eps1=1e-5, eps2=1e-6, rms1=True, rms2=False)
    assert h.dtype == out2.dtype == torch.promote_types(y_dt, r_dt)
    assert_close(h, want_h, "h", dtype=y_dt)
    assert_close(out2, want2, "out2", dtype=y_dt)
    (out2.sum() + h.sum()).backward()
    (want2.sum() + want_h.sum()).backward()
    assert t["residual"].grad.dtype == r_dt
    for name, leaf in leaves.items():
        assert_close(t[name].grad, leaf.grad, f"d{name}", grad=True, reduced_rows=3, dtype=y_dt)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norms", ["rms-rms", "layer-layer"])
def test_fused_forward_is_the_composition_bit_for_bit(backend, dtype, norms):
    """The fused kernels give the bits of the same backend's unfused norm followed by PyTorch's add (and its next
    norm): the fusion moves fewer bytes and changes no result."""
    _skip_unavailable(backend)
    rms1, rms2 = (k == "rms" for k in norms.split("-"))
    with torch.no_grad():
        t = _inputs((5, 72), dtype, 6, b1=not rms1, b2=not rms2)
        for zc, cbw in ((False, False), (True, True)):
            kw = dict(zero_centered_weight=zc, cast_before_weight=cbw, backend=backend)
            if rms1:
                n1 = add_rms_norm(t["y"], None, t["w1"], 1e-5, **kw)[0]
            else:
                n1 = add_layer_norm(t["y"], None, t["w1"], t["b1"], 1e-5, **kw)[0]
            want_h = t["residual"] + n1
            if rms2:
                want2 = add_rms_norm(want_h, None, t["w2"], 1e-6, **kw)[0]
            else:
                want2 = add_layer_norm(want_h, None, t["w2"], t["b2"], 1e-6, **kw)[0]
            out2, h = _chain(t, backend, rms1=rms1, rms2=rms2, zero_centered_weight=zc, cast_before_weight=cbw)
            assert torch.equal(h, want_h) and torch.equal(out2, want2), (zc, cbw)
            got = norm_add(t["y"], t["residual"], t["w1"], t["b1"], 1e-5, norm="rms" if rms1 else "layer", **kw)
            assert torch.equal(got, want_h)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_rows_too_wide_for_a_kernel_compose_the_norms(backend, monkeypatch):
    """Triton keeps a row in registers up to MAX_N elements; wider rows take the unfused kernels (same contract)."""
    _skip_unavailable(backend)
    import importlib

    from addnorm.ops import norm_add_ops

    module = importlib.import_module("addnorm.ops.norm_add")  # (the package exports a function of that name)

    calls = []
    monkeypatch.setitem(norm_add_ops.MAX_N, backend, 32)
    monkeypatch.setattr(module, "kernel_norm_add", lambda *a: calls.append(a))  # must not be reached
    t = _inputs((2, 40), torch.float32, 7, b1=False, b2=False)
    out2, h = _chain(t, backend, rms1=True, rms2=True)
    _, want2, want_h = chain_oracle(t, eps1=1e-5, eps2=1e-6, rms1=True, rms2=True)
    assert not calls
    assert_close(h, want_h, "h")
    assert_close(out2, want2, "out2")


def test_second_derivative_is_refused_by_the_kernels():
    t = _inputs((2, 16), torch.float32, 8, b1=False, b2=False)
    out2, h = _chain(t, "cpu", rms1=True, rms2=True)
    (g,) = torch.autograd.grad(out2.square().sum(), t["y"], create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        g.sum().backward()


# --------------------------------------------------------------------------------------------------------------
# In place
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "strided rows", "transposed"])
def test_inplace_forms_equal_the_out_of_place_ops(backend, dtype, layout):
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(9)

    def make():
        if layout == "transposed":  # last dim not contiguous: computed out of place and copied back
            return torch.randn(40, 6, generator=g).to(dtype).t()
        if layout == "strided rows":
            return torch.randn(6, 47, generator=g).to(dtype)[:, :40]
        return torch.randn(6, 40, generator=g).to(dtype)

    y, r = make(), make()
    w1, w2, b1 = (torch.randn(40, generator=g).to(dtype) for _ in range(3))
    kw = dict(zero_centered_weight=True, backend=backend)
    with torch.no_grad():
        want_h = norm_add(y, r, w1, b1, 1e-5, norm="layer", **kw)
        want2, _ = norm_add_norm(y, r, w1, w2, b1, None, 1e-5, None, norm="layer", norm2="rms", **kw)
        r1 = r.clone()
        assert norm_add_(y.clone(), r1, w1, b1, 1e-5, norm="layer", **kw) is r1
        assert torch.equal(r1, want_h)
        y2, r2 = y.clone(), r.clone()
        out = norm_add_norm_(y2, r2, w1, w2, b1, None, 1e-5, None, norm="layer", norm2="rms", **kw)
        assert out[0] is y2 and out[1] is r2
        assert torch.equal(r2, want_h) and torch.equal(y2, want2)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_inplace_refusals_write_nothing(backend):
    y, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)
    y0, r0 = y.clone(), r.clone()
    with pytest.raises(RuntimeError, match="y requires grad"):
        norm_add_(y.clone().requires_grad_(), r, w, backend=backend)
    with pytest.raises(RuntimeError, match="weight1 requires grad and grad mode is on"):
        norm_add_norm_(y, r, w.clone().requires_grad_(), w, backend=backend)
    with pytest.raises(ValueError, match="y and residual must not share memory"):
        norm_add_(y, y, w, backend=backend)
    buf = torch.randn(2, 4, 16)
    with pytest.raises(ValueError, match="must not overlap in memory"):
        norm_add_norm_(buf[0], buf.view(8, 16)[2:6], w, w, backend=backend)
    with pytest.raises(ValueError, match="residual has elements that share memory"):
        norm_add_(y, torch.randn(16).expand(4, 16), w, backend=backend)
    with pytest.raises(TypeError, match=r"residual \(torch.bfloat16\) cannot hold h"):
        norm_add_(y, r.bfloat16(), w, backend=backend)
    with pytest.raises(TypeError, match=r"y \(torch.bfloat16\) cannot hold N2\(h\)"):
        norm_add_norm_(y.bfloat16(), r, w, w, backend=backend)
    assert torch.equal(y, y0) and torch.equal(r, r0)
    norm_add_(buf[0], buf[1], w, backend=backend)  # two disjoint views of one buffer are fine


# --------------------------------------------------------------------------------------------------------------
# Batch invariance, custom ops, compile, bad input
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_bits_do_not_depend_on_the_batch(backend, dtype):
    """h, N2(h), dy and dresidual of one row are bitwise the same in batches of 1, 2, 5 and 70 rows at any
    position among rows of other scales."""
    _skip_unavailable(backend)
    n = 72
    row = _inputs((1, n), dtype, 10, b1=True, b2=False)
    got = []
    for m in (1, 2, 5, 70) if backend != "triton" else (1, 2, 5):
        for pos in sorted({0, m // 2, m - 1}):
            g = torch.Generator().manual_seed(m)
            scales = torch.logspace(-2, 2, m).unsqueeze(1)

            def rows(like, g=g, scales=scales, pos=pos, m=m):
                t = (torch.randn(m, n, generator=g) * scales).to(dtype)
                t[pos] = like.detach()[0]
                return t.requires_grad_(True)

            y, r, co2, ch = rows(row["y"]), rows(row["residual"]), rows(row["y"] * 0 + 1), rows(row["y"] * 0 - 1)
            out2, h = norm_add_norm(y, r, row["w1"], row["w2"], row["b1"], None, 1e-5, 1e-6, norm="layer",
                                    norm2="rms", backend=backend)  # fmt: skip
            torch.autograd.backward((out2, h), (co2.detach(), ch.detach()))
            got.append(tuple(t[pos] for t in (h, out2, y.grad, r.grad)))
    for other in got[1:]:
        for name, a, b in zip(("h", "out2", "dy", "dresidual"), got[0], other, strict=True):
            assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32)), name  # fmt: skip


def _op_args(norm2: bool, backend: str):
    g = torch.Generator().manual_seed(11)
    y, r = torch.randn(3, 24, generator=g), torch.randn(3, 24, generator=g)
    w1, b1, w2 = (torch.randn(24, generator=g) for _ in range(3))
    return y, r, w1, b1, w2, None, 1e-5, 1e-6, False, True, True, False, False, False, norm2, torch.float32, backend


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("norm2", [False, True], ids=["norm_add", "norm_add_norm"])
def test_opcheck_custom_ops(norm2, backend):
    _skip_unavailable(backend)
    args = _op_args(norm2, backend)
    fwd_args = tuple(a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.addnorm.norm_add_fwd.default, fwd_args)
    y, r, w1, b1, w2, b2, *opts = args
    h, out2, stats = torch.ops.addnorm.norm_add_fwd(*args)
    bwd = (torch.randn_like(h), torch.randn_like(h) if norm2 else None, y, h, w1, w2, stats)
    bwd += (torch.float32, None, torch.float32, *opts[:9], backend)
    torch.library.opcheck(torch.ops.addnorm.norm_add_bwd.default, bwd)
    inplace = (y.clone(), r.clone(), w1, b1, w2, b2, *opts[:9], backend)
    torch.library.opcheck(torch.ops.addnorm.norm_add_.default, inplace)


def test_compile_fullgraph_equals_eager():
    _skip_unavailable("cpu")
    torch._dynamo.reset()
    t = _inputs((4, 40), torch.float32, 12, b1=True, b2=False)

    def step(y, r, w1, b1, w2):
        out2, h = norm_add_norm(y, r, w1, w2, b1, None, 1e-5, 1e-6, norm="layer", norm2="rms", backend="cpu")
        return (out2 * 2 + h).sum()

    args = (t["y"], t["residual"], t["w1"], t["b1"], t["w2"])
    want = step(*args)
    want_grads = torch.autograd.grad(want, args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    got_grads = torch.autograd.grad(got, args)
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert torch.equal(a, b)

    def serve(y, r, w1, w2):
        norm_add_norm_(y, r, w1, w2, backend="cpu")
        return y, r

    y, r = torch.randn(4, 40), torch.randn(4, 40)
    w = t["w1"].detach()
    with torch.no_grad():
        want = serve(y.clone(), r.clone(), w, w)
        got = torch.compile(serve, fullgraph=True, backend="aot_eager")(y.clone(), r.clone(), w, w)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_input_names_the_argument():
    y, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"weight2 must have shape \(8,\) to match y's last dim"):
        norm_add_norm(y, r, w, torch.ones(9))
    with pytest.raises(ValueError, match="bias1 must be None with norm='rms'"):
        norm_add_norm(y, r, w, w, torch.zeros(8), norm2="layer")
    with pytest.raises(ValueError, match="eps1 must be a finite number"):
        norm_add_norm(y, r, w, w, eps1=float("nan"))
    with pytest.raises(ValueError, match="eps must be a finite number"):
        norm_add(y, r, w, eps=-1.0)
    with pytest.raises(TypeError, match="y must be float16, bfloat16, float32 or float64"):
        norm_add(y.long(), r, w)
    with pytest.raises(ValueError, match="y must have a last dimension"):
        norm_add(torch.randn(2, 0), torch.randn(2, 0))
    with pytest.raises(TypeError, match="weight1 must be float16"):
        norm_add_norm(y, r, w.int(), w)
    with pytest.raises(ValueError, match="zero_centered_weight must be a bool or a pair"):
        norm_add_norm(y, r, zero_centered_weight=(True, False, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norms", ["rms-rms", "layer-layer"])
@pytest.mark.parametrize("cast", [False, True])
def test_decode_fast_path_gives_the_general_launchs_bits(dtype, norms, cast, monkeypatch):
    """Inference calls at decode size take the raw-address launch (addnorm.ops.norm_add_fast); its bits are the
    general launch's, out of place and in place, and it is really taken."""
    _skip_unavailable("cpu")
    from addnorm.ops.cpu import norm_add_fast_launch, norm_add_launch

    rms1, rms2 = (k == "rms" for k in norms.split("-"))
    t = {
        k: (v.detach() if v is not None else None)
        for k, v in _inputs((3, 72), dtype, 13, b1=not rms1, b2=not rms2).items()
    }
    opts = dict(eps1=1e-5, eps2=1e-6, is_rms1=rms1, is_rms2=rms2, zc1=False, zc2=False, cast1=cast, cast2=cast)
    if dtype == torch.float32:
        opts.update(cast1=False, cast2=False)  # (the cast rounds nothing in the statistics dtype: dropped)
    want_h, want2, _ = norm_add_launch.forward(
        t["y"], t["residual"], t["w1"], t["b1"], t["w2"], t["b2"], h_dtype=dtype, has_norm2=True, **opts
    )
    calls = []
    real = norm_add_fast_launch.forward_ptr
    monkeypatch.setattr(norm_add_fast_launch, "forward_ptr", lambda *a: calls.append(1) or real(*a))
    kw = dict(norm="rms" if rms1 else "layer", norm2="rms" if rms2 else "layer", cast_before_weight=cast, backend="cpu")
    args = (t["w1"], t["w2"], t["b1"], t["b2"], 1e-5, 1e-6)
    out2, h = norm_add_norm(t["y"], t["residual"], *args, **kw)
    assert torch.equal(h, want_h) and torch.equal(out2, want2)
    y, r = t["y"].clone(), t["residual"].clone()
    norm_add_norm_(y, r, *args, **kw)
    assert torch.equal(r, want_h) and torch.equal(y, want2)
    h1 = norm_add(
        t["y"], t["residual"], t["w1"], t["b1"], 1e-5, norm=kw["norm"], cast_before_weight=cast, backend="cpu"
    )
    assert torch.equal(h1, want_h)
    assert len(calls) == 3
