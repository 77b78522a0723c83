"""Batch invariance (issue 26; docs/kernels.md, "Batch invariance"): a row's outputs, forward (out, residual_out,
quantized q and scales) and backward (dx, dresidual), are bitwise the same whatever the batch size, the other rows'
contents and the row's position, on every backend and through ``auto``. Not covered, by nature: dweight/dbias (sums
over rows), dropout (its mask hashes the element's index in the batch), the linear of add_norm_linear (a BLAS
matmul). Triton runs in its interpreter here, which cannot show GPU bits: the launch plans' independence from M is
checked directly."""

from __future__ import annotations

import itertools

import pytest
import torch

import addnorm
from addnorm.ops import backends
from addnorm.ops.triton import plan

ALL = ["auto", "torch", "reference", "cpu", "triton"]
BATCHES = (1, 2, 5, 33)  # M: 1 is where reductions and launch plans most like to take another path


def _batches(backend):
    # the cpu backward splits columns over threads below 64 rows and rows above: a batch past that too
    return BATCHES if backend == "triton" else (*BATCHES, 70)


def _skip_unavailable(backend):
    if backend != "auto" and (reason := backends.unavailable_reason(backend, torch.device("cpu"))) is not None:
        pytest.skip(reason)


def _bits(t):
    """t's bits as integers: compares -0.0 with 0.0 and NaN with NaN as the distinct bit patterns they are."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(got, want, what):
    assert torch.equal(_bits(got), _bits(want)), f"{what}: max |diff| {(got.double() - want.double()).abs().max()}"


def _placements(n, batches=BATCHES, seed=0):
    """(M, position) pairs with a batch each: ``rows(like)`` puts the row under test (``like``, shape (n,)) at the
    position among rows of other random contents and scales."""
    g = torch.Generator().manual_seed(seed)
    for m in batches:
        for pos in sorted({0, m // 2, m - 1}):
            scales = torch.logspace(-2, 2, m)[torch.randperm(m, generator=g)].unsqueeze(1)
            noise = [torch.randn(m, n, generator=g) * scales for _ in range(3)]

            def rows(like, i=0, pos=pos, noise=noise):
                t = noise[i].to(like.dtype, copy=True)
                t[pos] = like
                return t

            yield m, pos, rows


def _row_inputs(n, x_dtype, r_dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(x_dtype)
    r = (3 * torch.randn(n, generator=g)).to(r_dtype)
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(x_dtype)
    b = (0.2 * torch.randn(n, generator=g)).to(x_dtype)
    return x, r, w, b


def _call(is_rms, x, r, w, b, backend, **kw):
    if is_rms:
        return addnorm.add_rms_norm(x, r, w, 1e-6, backend=backend, **kw)
    return addnorm.add_layer_norm(x, r, w, b, 1e-5, backend=backend, **kw)


DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-fp32stream": (torch.bfloat16, torch.float32),
}


def _widths(backend):
    # the interpreter is slow: tiny rows; 1024 is the width (the numba and ATen loops change at 8, 16, 64)
    return (7, 100) if backend == "triton" else (7, 100, 1024)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=str)
def test_forward_row_does_not_depend_on_the_batch(backend, is_rms, dtypes):
    _skip_unavailable(backend)
    x_dtype, r_dtype = DTYPES[dtypes]
    for n in _widths(backend):
        x, r, w, b = _row_inputs(n, x_dtype, r_dtype)
        want = None
        for m, pos, rows in _placements(n, _batches(backend)):
            out, res = _call(is_rms, rows(x, 0), rows(r, 1), w, b, backend, cast_before_weight=True)
            got = out[pos], res[pos]
            if want is None:
                want = got
                continue
            _assert_same_bits(got[0], want[0], f"out, N={n}, M={m}, row {pos}")
            _assert_same_bits(got[1], want[1], f"residual_out, N={n}, M={m}, row {pos}")


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("dtypes", ["fp32", "bf16-fp32stream"], ids=str)
def test_backward_row_does_not_depend_on_the_batch(backend, is_rms, dtypes):
    _skip_unavailable(backend)
    x_dtype, r_dtype = DTYPES[dtypes]
    for n in _widths(backend):
        x, r, w, b = _row_inputs(n, x_dtype, r_dtype)
        g = torch.Generator().manual_seed(2)
        dout_row = torch.randn(n, generator=g).to(x_dtype)
        dres_row = torch.randn(n, generator=g).to(r_dtype)
        want = None
        for m, pos, rows in _placements(n, _batches(backend), seed=3):
            xs, rs = rows(x, 0).requires_grad_(), rows(r, 1).requires_grad_()
            ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
            out, res = _call(is_rms, xs, rs, ws, bs, backend)
            dout = rows(dout_row, 2)
            dres = torch.randn(m, n).to(r_dtype)
            dres[pos] = dres_row
            torch.autograd.backward((out, res), (dout, dres))
            got = xs.grad[pos], rs.grad[pos]
            if want is None:
                want = got
                continue
            _assert_same_bits(got[0], want[0], f"dx, N={n}, M={m}, row {pos}")
            _assert_same_bits(got[1], want[1], f"dresidual, N={n}, M={m}, row {pos}")


@pytest.fixture
def two_threads(torch_threads):
    torch_threads(2)


@pytest.mark.parametrize("backend", ["auto", "torch", "reference", "cpu"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_a_lone_wide_row_gets_its_bits_in_a_batch_with_two_threads(backend, is_rms, two_threads):
    # ATen sums a single output of >= 32K elements in two passes split over threads, and every other row count one
    # row per thread (contract.lone_wide_row): with 2 threads a lone fp32 row of 40000 differed by ~2e-6
    _skip_unavailable(backend)
    n = 40000
    x, r, w, b = _row_inputs(n, torch.float32, torch.float32)
    g = torch.Generator().manual_seed(4)
    dout_row = torch.randn(n, generator=g)
    results = []
    for threads, (m, pos, rows) in itertools.product((2, 1), _placements(n, batches=(1, 3))):
        torch.set_num_threads(threads)
        xs, rs = rows(x, 0).requires_grad_(), rows(r, 1).requires_grad_()
        out, res = _call(is_rms, xs, rs, w, b, backend)
        (out * rows(dout_row, 2)).sum().backward()
        results.append(((threads, m, pos), (out[pos], res[pos], xs.grad[pos], rs.grad[pos])))
    (_, want), *rest = results
    for where, got in rest:
        for name, a, e in zip(("out", "residual_out", "dx", "dresidual"), got, want, strict=True):
            _assert_same_bits(a, e, f"{name} at (threads, M, row) {where}")


def test_auto_gives_a_row_the_same_bits_in_a_batch_of_4_and_of_64(monkeypatch):
    # the case: auto used to run the torch backend below 32K elements and the cpu backend above, whose fp32
    # sums differ (4.8e-7 on these rows); the choice no longer depends on the size
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g)
    w, b = torch.randn(1024, generator=g), torch.randn(1024, generator=g)
    small = addnorm.add_layer_norm(x[:4].clone(), r[:4].clone(), w, b)
    big = addnorm.add_layer_norm(x, r, w, b)
    for a, e in zip(small, big, strict=True):
        _assert_same_bits(a, e[:4], "auto, batch 4 vs 64")


def test_auto_resolves_from_the_device_alone():
    # resolve_backend takes no size: what auto picks cannot depend on M (nor on N)
    cpu = torch.device("cpu")
    with pytest.raises(TypeError):
        backends.resolve_backend("auto", cpu, 10)
    assert not hasattr(backends, "AUTO_CPU_MIN_ELEMENTS")


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_in_place_row_does_not_depend_on_the_batch(backend, is_rms):
    _skip_unavailable(backend)
    for n in _widths(backend):
        x, r, w, b = _row_inputs(n, torch.bfloat16, torch.float32)
        want = None
        for m, pos, rows in _placements(n, seed=6):
            xs, rs = rows(x, 0), rows(r, 1)
            if is_rms:
                addnorm.add_rms_norm_(xs, rs, w, 1e-6, backend=backend)
            else:
                addnorm.add_layer_norm_(xs, rs, w, b, backend=backend)
            got = xs[pos], rs[pos]
            if want is None:
                want = got
                continue
            _assert_same_bits(got[0], want[0], f"x (the norm), N={n}, M={m}, row {pos}")
            _assert_same_bits(got[1], want[1], f"residual (the sum), N={n}, M={m}, row {pos}")


QUANT_MODES = {  # each mode with one of the dtypes (the interpreter is slow; tests/ops/test_quant*.py cross them)
    "static-e4m3": dict(quant_dtype=torch.float8_e4m3fn, scale=torch.tensor(0.02)),
    "per-token-int8": dict(quant_dtype=torch.int8),
    "per-group-e4m3": dict(quant_dtype=torch.float8_e4m3fn, group_size=32),
    "per-token-ub-e5m2": dict(quant_dtype=torch.float8_e5m2, scale_ub=torch.tensor(2.0)),
}


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", QUANT_MODES, ids=str)
def test_quantized_row_does_not_depend_on_the_batch(backend, mode):
    _skip_unavailable(backend)
    n = 64
    x, r, w, _ = _row_inputs(n, torch.bfloat16, torch.bfloat16)
    want = None
    # one row per program on every backend's quantized path: fewer batches in the (slow) interpreter
    for m, pos, rows in _placements(n, (1, 33) if backend == "triton" else BATCHES, seed=7):
        q, res, scales = addnorm.add_rms_norm_quant(rows(x, 0), rows(r, 1), w, backend=backend, **QUANT_MODES[mode])
        got = q[pos], res[pos], (scales if mode.startswith("static") else scales[pos])
        if want is None:
            want = got
            continue
        for name, a, e in zip(("q", "residual_out", "scales"), got, want, strict=True):
            _assert_same_bits(a, e, f"{name}, M={m}, row {pos}")


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu"])
def test_add_norm_multi_row_does_not_depend_on_the_batch(backend):
    # the composed path (x1, rowscale) around the fused kernel; rowscale is one of the row's own inputs
    _skip_unavailable(backend)
    n = 100
    x, r, w, b = _row_inputs(n, torch.float32, torch.float32)
    x1 = torch.randn(n)
    want = None
    for m, pos, rows in _placements(n, seed=8):
        rowscale = torch.rand(m) + 0.5
        rowscale[pos] = 0.75
        o = addnorm.add_norm_multi(
            rows(x, 0), rows(r, 1), w, b, x1=rows(x1, 2), rowscale=rowscale, weight1=w * 2, backend=backend
        )
        got = o.out[pos], o.residual_out[pos], o.out1[pos]
        if want is None:
            want = got
            continue
        for name, a, e in zip(("out", "residual_out", "out1"), got, want, strict=True):
            _assert_same_bits(a, e, f"{name}, M={m}, row {pos}")


# ---- Triton's launch plans: from N (and the flags, dtypes), never from M ------------------------------------------

PLAN_WIDTHS = (1, 7, 64, 100, 128, 1000, 1024, 4096, 4097, 8192, 8193, 16384, 16385, 65536, 100000)
PLAN_BATCHES = (1, 2, 3, 7, 8, 31, 64, 1000, 65537)


def _meta(cfg):
    """The constexprs and launch options of a plan, without the grid, the persistent program count or the looped
    backward's row groups (those set which program takes which rows, not how a row is summed)."""
    if len(cfg) == 3:  # (rows path?, grid or program count, meta): the forward, or the backward's rows kernel
        return cfg[2]
    _, tiles, _groups, sums, meta = cfg  # the looped backward
    return tiles, sums, meta


@pytest.mark.parametrize("n", PLAN_WIDTHS)
def test_triton_plans_do_not_depend_on_the_batch_size(n):
    cpu = torch.device("cpu")
    for flags in itertools.product([False, True], repeat=3):
        is_rms, narrow, has_res = flags
        fwd = {
            m: plan.fwd_config(m, n, has_res, True, not is_rms, is_rms, False, False, has_res, False, True)
            for m in PLAN_BATCHES
        }
        bwd = {
            m: plan.bwd_config(m, n, narrow, has_res, True, not is_rms, is_rms, False, False, has_res, False, cpu)
            for m in PLAN_BATCHES
        }
        for configs in (fwd, bwd):
            first = _meta(configs[1])
            for m, cfg in configs.items():
                assert _meta(cfg) == first, f"N={n}, flags {flags}: M={m} plans {cfg}, M=1 {configs[1]}"
        for m, (rows, grid, meta) in fwd.items():  # the grid still covers every row
            assert grid[0] * (meta["BLOCK_M"] if rows else 1) >= m


# ---- On a GPU: the compiled kernels (what the interpreter cannot show) -------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton kernels need a CUDA GPU")
@pytest.mark.parametrize("n", [128, 1000, 4096, 20000])  # several rows a program, one, and the looped path
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_triton_on_the_gpu_row_does_not_depend_on_the_batch(n, is_rms):
    if (reason := backends.unavailable_reason("triton", torch.device("cuda"))) is not None:
        pytest.skip(reason)
    x, r, w, b = (t.cuda() for t in _row_inputs(n, torch.bfloat16, torch.float32))
    dout_row = torch.randn(n, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).cuda()
    want = None
    # M = 1 and multiples of 16 are what Triton specializes integer arguments on; 4097 spans many programs
    for m, pos, rows in _placements(n, (1, 2, 16, 33, 4097), seed=10):
        xs, rs = rows(x.cpu(), 0).cuda().requires_grad_(), rows(r.cpu(), 1).cuda().requires_grad_()
        out, res = _call(is_rms, xs, rs, w, b, "triton")
        (out.float() * rows(dout_row.cpu(), 2).cuda()).sum().backward()
        q, _, scales = addnorm.add_rms_norm_quant(xs.detach(), rs.detach(), w, quant_dtype=torch.int8, backend="triton")
        got = out[pos], res[pos], xs.grad[pos], rs.grad[pos], q[pos], scales[pos]
        if want is None:
            want = got
            continue
        for name, a, e in zip(("out", "residual_out", "dx", "dresidual", "q", "scales"), got, want, strict=True):
            _assert_same_bits(a, e, f"{name}, N={n}, M={m}, row {pos}")
