"""The numba CPU backend against the float64 oracle: every option, dtype and gradient; dropout bit-exact against
the reference hash; strided rows; determinism across runs and thread counts; torch.compile; warm-start cost."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from addnorm.ops.add_norm import add_layer_norm, add_rms_norm
from addnorm.ops.backends import resolve_backend
from addnorm.ops.contract import dropout_keep_mask
from addnorm.ops.cpu import launch as cpu
from addnorm.reference import add_norm_bwd_ref, add_norm_ref
from addnorm.testing import assert_close, oracle

pytestmark = pytest.mark.skipif(cpu.unavailable_reason(torch.device("cpu")) is not None, reason="numba missing")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def _run_cpu(x, residual, weight, bias, *, is_rms, eps, residual_dtype=None, zc=False, dout, dres_out):
    """Forward and backward through the public API with backend='cpu'; returns outputs and leaf gradients."""
    xl, rl, wl, bl = (_leaf(t) for t in (x, residual, weight, bias))
    if is_rms:
        out, res = add_rms_norm(xl, rl, wl, eps, residual_dtype=residual_dtype, zero_centered_weight=zc, backend="cpu")
    else:
        out, res = add_layer_norm(
            xl, rl, wl, bl, eps, residual_dtype=residual_dtype, zero_centered_weight=zc, backend="cpu"
        )
    torch.autograd.backward([out, res], [dout, dres_out.to(res.dtype)])
    grads = {"d" + k: t.grad for k, t in (("x", xl), ("residual", rl), ("weight", wl), ("bias", bl)) if t is not None}
    return out.detach(), res.detach(), grads


def _check(x, residual, weight, bias, *, is_rms, eps=1e-5, residual_dtype=None, zc=False):
    bias = None if is_rms else bias  # RMSNorm has no bias
    dout = torch.randn(x.shape).to(x.dtype)
    rd = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    dres_out = torch.randn(x.shape).to(rd)
    out, res, grads = _run_cpu(
        x,
        residual,
        weight,
        bias,
        is_rms=is_rms,
        eps=eps,
        residual_dtype=residual_dtype,
        zc=zc,
        dout=dout,
        dres_out=dres_out,
    )
    exp = oracle(
        x,
        residual,
        weight,
        bias,
        eps=eps,
        is_rms=is_rms,
        residual_dtype=residual_dtype,
        zero_centered_weight=zc,
        dout=dout,
        dresidual_out=dres_out,
    )
    assert out.dtype == x.dtype and res.dtype == rd
    assert_close(out, exp["out"], "out")
    assert_close(res, exp["residual_out"], "residual_out")
    rows = x.numel() // x.shape[-1]
    for name, g in grads.items():
        reduced = rows if name in ("dweight", "dbias") else 1
        assert_close(g, exp[name], name, grad=True, reduced_rows=reduced)


# --------------------------------------------------------------------------------------------------------------
# Against the float64 oracle
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("shape", [(1, 7), (37, 100), (2, 3, 33)], ids=str)
def test_matches_oracle(dtype, is_rms, shape):
    n = shape[-1]
    x, r = (torch.randn(shape) * 2).to(dtype), torch.randn(shape).to(dtype)
    w, b = (1 + 0.5 * torch.randn(n)).to(dtype), (0.1 * torch.randn(n)).to(dtype)
    _check(x, r, w, b, is_rms=is_rms, eps=1e-5 if is_rms else 1e-3)


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("has_res", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("affine", ["none", "w", "wb", "zc"])
def test_options(is_rms, has_res, affine):
    m, n = 19, 75
    x = torch.randn(m, n)
    r = torch.randn(m, n) if has_res else None
    w = 0.3 * torch.randn(n) + (0 if affine == "zc" else 1) if affine != "none" else None
    b = torch.randn(n) if affine == "wb" else None
    _check(x, r, w, b, is_rms=is_rms, zc=affine == "zc", eps=1e-6)


@pytest.mark.parametrize(
    "x_dtype,res_dtype,residual_dtype",
    [
        (torch.bfloat16, torch.float32, None),  # fp32 residual stream, bf16 activations
        (torch.float16, torch.float32, None),
        (torch.bfloat16, None, torch.float32),  # no residual input, but residual_out kept in fp32
        (torch.float32, torch.float32, torch.bfloat16),  # sum in fp32, rounded to bf16 once
        (torch.float32, torch.float64, None),  # an fp64 residual makes the statistics fp64
    ],
    ids=str,
)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
def test_mixed_residual_dtype(x_dtype, res_dtype, residual_dtype, is_rms):
    m, n = 13, 64
    x = torch.randn(m, n).to(x_dtype)
    r = torch.randn(m, n).to(res_dtype) if res_dtype is not None else None
    w, b = torch.randn(n).to(x_dtype), torch.randn(n).to(x_dtype)
    _check(x, r, w, b, is_rms=is_rms, residual_dtype=residual_dtype)


def test_large_offset_keeps_the_variance():
    """Rows riding on a large common offset: a one-pass E[h^2] - E[h]^2 in fp32 would lose every digit of the
    variance (h^2 ~ 1e8 has an ulp of 8, the variance is ~2); two passes over the cached row keep it."""
    h = (torch.randn(8, 256) * 1.4 + 1e4).double()
    x = h.float()
    _, _, mean, rstd = cpu.forward(
        x,
        None,
        None,
        None,
        eps=1e-5,
        is_rms=False,
        dropout_p=0.0,
        seed=0,
        residual_dtype=torch.float32,
        zero_centered_weight=False,
        store_residual_out=False,
    )
    exact = torch.rsqrt(x.double().var(dim=-1, unbiased=False) + 1e-5)
    # fp32's own mean is off by ~|mean| * 2^-24 * a few; that alone limits the relative error to ~1e-4
    torch.testing.assert_close(rstd.double(), exact, rtol=1e-3, atol=0)
    _check(torch.randn(8, 256) + 30, torch.randn(8, 256), torch.randn(256), torch.randn(256), is_rms=False)
    _check(torch.randn(8, 256), None, torch.randn(256), None, is_rms=True, eps=torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
def test_empty_rows(is_rms):
    x, r = torch.randn(0, 16), torch.randn(0, 16)
    w, b = torch.randn(16), torch.randn(16)
    out, res, grads = _run_cpu(
        x, r, w, b, is_rms=is_rms, eps=1e-5, dout=torch.randn(0, 16), dres_out=torch.randn(0, 16)
    )
    assert out.shape == (0, 16) and res.shape == (0, 16)
    assert torch.equal(grads["dweight"], torch.zeros(16))
    assert grads["dx"].shape == (0, 16)


# --------------------------------------------------------------------------------------------------------------
# Conversions, strides, dropout
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
def test_half_rounding_matches_torch(half):
    """residual_out = x rounded to a half type must equal torch's own cast bit for bit: ties to even, overflow,
    subnormals, inf and NaN."""
    fi = torch.finfo(half)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            float("inf"),
            -float("inf"),
            float("nan"),
            fi.max * 1.001,
            fi.tiny / 3,
            1 + fi.eps / 2,
            1 + 1.5 * fi.eps,
            -(1 + fi.eps / 2),
            65519.0,
            65520.0,
            3.4e38,
        ]
    )
    x = torch.cat([special, torch.randn(4082) * torch.logspace(-8, 8, 4082)]).reshape(-1, 32)
    out, res, _, _ = cpu.forward(
        x,
        None,
        None,
        None,
        eps=1e-5,
        is_rms=True,
        dropout_p=0.0,
        seed=0,
        residual_dtype=half,
        zero_centered_weight=False,
        store_residual_out=True,
    )
    expected = x.to(half)
    same = (res.view(torch.int16) == expected.view(torch.int16)) | (res.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} elements round differently from torch"


def test_strided_rows_and_grads_without_copies():
    m, n = 21, 48
    big_x, big_r, big_g = torch.randn(m, n + 11), torch.randn(m, n + 5), torch.randn(m, 2 * n)
    x, r = big_x[:, 3 : 3 + n], big_r[:, 5:]  # rows strided, last dim contiguous
    dout = big_g[:, n:]  # row stride 2n
    w, b = torch.randn(n), torch.randn(n)
    kw = dict(eps=1e-5, is_rms=False, dropout_p=0.0, seed=0, residual_dtype=torch.float32, zero_centered_weight=False)
    strided = cpu.forward(x, r, w, b, store_residual_out=True, **kw)
    contig = cpu.forward(x.contiguous(), r.contiguous(), w, b, store_residual_out=True, **kw)
    for a, c in zip(strided, contig):
        assert torch.equal(a, c)
    bkw = dict(
        is_rms=False,
        dropout_p=0.0,
        seed=0,
        zero_centered_weight=False,
        x_dtype=torch.float32,
        residual_dtype=torch.float32,
        bias_dtype=torch.float32,
    )
    _, res, mean, rstd = contig
    g1 = cpu.backward(dout, big_x[:, :n], res, w, mean, rstd, **bkw)
    g2 = cpu.backward(dout.contiguous(), big_x[:, :n].contiguous(), res, w, mean, rstd, **bkw)
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)


def test_expanded_upstream_gradient():
    """out.sum().backward() hands the backward a stride-0 gradient."""
    x, r, w = torch.randn(6, 40), torch.randn(6, 40), torch.randn(40)
    xl, wl = _leaf(x), _leaf(w)
    add_rms_norm(xl, r, wl, 1e-5, backend="cpu")[0].sum().backward()
    exp = oracle(x, r, w, None, eps=1e-5, is_rms=True, dout=torch.ones(6, 40))
    assert_close(xl.grad, exp["dx"], "dx", grad=True)
    assert_close(wl.grad, exp["dweight"], "dweight", grad=True, reduced_rows=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer", "rms"])
def test_dropout_same_mask_as_reference(dtype, is_rms):
    m, n, p, seed = 23, 90, 0.3, 1234567
    x, r = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
    w, b = torch.randn(n).to(dtype), (None if is_rms else torch.randn(n).to(dtype))
    kw = dict(eps=1e-5, is_rms=is_rms, dropout_p=p, seed=seed, residual_dtype=dtype, zero_centered_weight=False)
    out, res, mean, rstd = cpu.forward(x, r, w, b, store_residual_out=True, **kw)
    ref_out, ref_res, ref_mean, ref_rstd = add_norm_ref(x, r, w, b, **kw)
    assert torch.equal(res, ref_res)  # same mask, same division, same rounding: bit for bit
    assert_close(out, ref_out.double(), "out")
    # without a residual, residual_out is zero exactly where the mask drops
    _, alone, _, _ = cpu.forward(x, None, w, b, store_residual_out=True, **kw)
    keep = dropout_keep_mask(seed, m, n, p)
    assert torch.equal(alone != 0, keep & (x != 0))
    dout, dres_out = torch.randn(m, n).to(dtype), torch.randn(m, n).to(dtype)
    bkw = dict(dropout_p=p, seed=seed, zero_centered_weight=False, x_dtype=dtype)
    grads = cpu.backward(
        dout,
        dres_out,
        res,
        w,
        mean,
        rstd,
        residual_dtype=dtype,
        is_rms=is_rms,
        bias_dtype=None if b is None else dtype,
        **bkw,
    )
    ref = add_norm_bwd_ref(
        dout, dres_out, res, w, mean, rstd, residual_dtype=dtype, bias_dtype=None if b is None else dtype, **bkw
    )
    assert torch.equal(grads[0] == 0, (ref[0] == 0))  # dx dropped at the same places
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), grads, ref):
        if e is not None:
            assert_close(a, e.double(), name, grad=True, reduced_rows=m if name in ("dweight", "dbias") else 1)


def test_dropout_through_the_custom_op_uses_its_seed():
    m, n, p = 17, 33, 0.25
    x, r, w = torch.randn(m, n), torch.randn(m, n), torch.randn(n)
    out, res, _, _, seed = torch.ops.addnorm.add_norm_fwd(
        x, r, w, None, 1e-5, True, p, torch.float32, False, True, "cpu"
    )
    ref_out, ref_res, _, _ = add_norm_ref(x, r, w, None, eps=1e-5, is_rms=True, dropout_p=p, seed=int(seed))
    assert torch.equal(res, ref_res)
    assert_close(out, ref_out.double(), "out")


# --------------------------------------------------------------------------------------------------------------
# Threads, determinism, compile, start-up
# --------------------------------------------------------------------------------------------------------------


def test_deterministic_and_thread_count_independent(monkeypatch):
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 0)  # take the parallel path even at this small size
    m, n = 300, 72
    x, r = torch.randn(m, n), torch.randn(m, n)
    w, b = torch.randn(n), torch.randn(n)
    dout, dres_out = torch.randn(m, n), torch.randn(m, n)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 2):
            torch.set_num_threads(threads)
            results.append(_run_cpu(x, r, w, b, is_rms=False, eps=1e-5, dout=dout, dres_out=dres_out))
    finally:
        torch.set_num_threads(before)
    for out, res, grads in results[1:]:
        # chunks of rows depend on M only, so even the reduced dweight/dbias are bitwise equal
        assert torch.equal(out, results[0][0]) and torch.equal(res, results[0][1])
        for k, g in grads.items():
            assert torch.equal(g, results[0][2][k]), k
    exp = oracle(x, r, w, b, eps=1e-5, is_rms=False, dout=dout, dresidual_out=dres_out)
    assert_close(results[1][2]["dweight"], exp["dweight"], "dweight", grad=True, reduced_rows=m)


def test_torch_compile_fullgraph_matches_eager():
    x, r, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)

    def f(x, r, w):
        out, res = add_rms_norm(x, r, w, 1e-6, backend="cpu")
        return out * 2 + res

    def grads(fn):
        xl, wl = _leaf(x), _leaf(w)
        y = fn(xl, r, wl)
        y.sum().backward()
        return y.detach(), xl.grad, wl.grad

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for a, e in zip(grads(compiled), grads(f)):
        assert torch.equal(a, e)


def test_auto_is_cpu_and_reasons():
    assert resolve_backend("auto", torch.device("cpu")) in ("cpu", "torch")  # ADDNORM_BACKEND may override
    assert cpu.unavailable_reason(torch.device("cpu")) is None
    assert "CPU tensors" in cpu.unavailable_reason(torch.device("meta"))


def test_reason_without_numba():
    code = (
        "import sys; sys.modules['numba'] = None\n"  # makes `import numba` raise ImportError
        "import addnorm.ops.cpu.launch as c\nprint(c.unavailable_reason('cpu'))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "numba is not installed" in res.stdout


def test_warm_start_loads_kernels_from_cache():
    """A fresh process finds the compiled kernels in numba's cache: no compilation on the first call."""
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    add_rms_norm(x, r, w, backend="cpu")  # populates the caches for these signatures if they were cold
    add_rms_norm(x, r, w.requires_grad_(), backend="cpu")
    code = textwrap.dedent("""
        import json, time, torch
        t0 = time.perf_counter()
        from addnorm.ops.add_norm import add_rms_norm
        from addnorm.ops.cpu import launch as cpu
        x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
        t1 = time.perf_counter()
        add_rms_norm(x, r, w, backend="cpu")  # the decode launch (nothing requires grad)
        add_rms_norm(x, r, w.requires_grad_(), backend="cpu")  # the general launch
        t2 = time.perf_counter()
        kernels = (cpu.fwd_serial, cpu.fast_launch.DTYPES[torch.float32])
        print(json.dumps({"misses": sum(sum(k.stats.cache_misses.values()) for k in kernels),
                          "hits": [sum(k.stats.cache_hits.values()) for k in kernels],
                          "import_s": t1 - t0, "first_call_s": t2 - t1}))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["misses"] == 0 and min(info["hits"]) >= 1, info


def _inputs_for_fork_test():
    # numpy, not torch ops: torch's own OpenMP regions are no safer in such a child than numba's
    a = np.sin(np.arange(300 * 72, dtype=np.float32)).reshape(300, 72)
    return torch.from_numpy(a), torch.from_numpy(np.cos(a))


def _forward_in_child(queue):
    assert torch.get_num_threads() >= 2  # inherited: without the guard, numba would start its pool here
    out = add_rms_norm(*_inputs_for_fork_test(), backend="cpu")[0]
    queue.put(hashlib.sha256(out.numpy().tobytes()).hexdigest())


def test_forked_child_after_parallel_parent(monkeypatch):
    """GNU OpenMP does not survive fork(): numba terminates a child that starts a parallel region after its parent
    did. Such a child (a DataLoader worker, say) must fall back to the serial kernels and still get the result."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = add_rms_norm(*_inputs_for_fork_test(), backend="cpu")[0]  # the parent starts its thread pool
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_forward_in_child, args=(queue,))
        child.start()
    finally:
        torch.set_num_threads(before)
    child.join(timeout=60)
    if child.is_alive():  # GNU OpenMP deadlocks in such a child: don't leave it behind
        child.kill()
        child.join()
    assert child.exitcode == 0, f"child exited with {child.exitcode} (None or < 0: hung or killed)"
    assert queue.get(timeout=10) == hashlib.sha256(expected.numpy().tobytes()).hexdigest()


def test_calls_leave_torchs_thread_count_alone():
    """numba's OpenMP pool start resets the process-wide thread count torch shares; the backend restores it.
    A fresh process, because the pool starts once."""
    code = (
        "import torch, addnorm\n"
        "torch.set_num_threads(1)\n"
        "x = torch.randn(2048, 512, requires_grad=True)\n"
        "o, h = addnorm.add_rms_norm(x, x, backend='cpu'); o.sum().backward()\n"
        "print(torch.get_num_threads())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_cast_before_weight_is_the_reference_bit_for_bit_and_gradients_match_the_oracle(dtype, is_rms):
    x, r = (torch.randn(37, 130).to(dtype).requires_grad_() for _ in range(2))
    w = (1 + 0.5 * torch.randn(130)).to(dtype).requires_grad_()
    b = None if is_rms else torch.randn(130).to(dtype).requires_grad_()
    fn = add_rms_norm if is_rms else add_layer_norm
    args = (x, r, w, 1e-5) if is_rms else (x, r, w, b, 1e-5)
    out, res = fn(*args, cast_before_weight=True, backend="cpu")
    with torch.no_grad():
        want, _ = fn(*args, cast_before_weight=True, backend="reference")
    assert torch.equal(out, want)
    dout, dres = torch.randn_like(out), torch.randn_like(res)
    torch.autograd.backward((out, res), (dout, dres))
    exp = oracle(x, r, w, b, eps=1e-5, is_rms=is_rms, cast_before_weight=True, dout=dout, dresidual_out=dres)
    for name, t in (("dx", x), ("dresidual", r), ("dweight", w), ("dbias", b)):
        if t is not None:
            assert_close(t.grad, exp[name], name, grad=True, reduced_rows=37 if name in ("dweight", "dbias") else 1)


@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_out_dtype_matches_the_reference_and_gradients_match_the_oracle(is_rms):
    x, r = (torch.randn(37, 130).requires_grad_() for _ in range(2))  # an fp32 stream, a bf16 output
    w = (1 + 0.5 * torch.randn(130)).requires_grad_()
    b = None if is_rms else torch.randn(130).requires_grad_()
    fn = add_rms_norm if is_rms else add_layer_norm
    args = (x, r, w, 1e-5) if is_rms else (x, r, w, b, 1e-5)
    out, res = fn(*args, out_dtype=torch.bfloat16, backend="cpu")
    with torch.no_grad():
        want, _ = fn(*args, out_dtype=torch.bfloat16, backend="reference")
    assert out.dtype == torch.bfloat16 and res.dtype == torch.float32
    # fp32 statistics summed in another order can move a bf16 rounding by one ulp, rarely
    assert (out != want).float().mean() < 0.01
    torch.testing.assert_close(out.float(), want.float(), atol=0, rtol=2**-7)
    dout, dres = torch.randn_like(out), torch.randn_like(res)
    torch.autograd.backward((out, res), (dout, dres))
    exp = oracle(x, r, w, b, eps=1e-5, is_rms=is_rms, out_dtype=torch.bfloat16, dout=dout, dresidual_out=dres)
    for name, t in (("dx", x), ("dresidual", r), ("dweight", w), ("dbias", b)):
        if t is not None:
            assert_close(
                t.grad,
                exp[name],
                name,
                grad=True,
                dtype=torch.bfloat16,
                reduced_rows=37 if name in ("dweight", "dbias") else 1,
            )


# two cases, not the full product: each new type signature compiles the parallel kernel anew (~20 s)
@pytest.mark.parametrize(
    "is_rms, dtype, dropout",
    [(False, torch.float32, True), (True, torch.bfloat16, False)],
    ids=["layer-fp32-drop", "rms-bf16"],
)
def test_few_rows_backward_splits_columns_bitwise_like_serial(monkeypatch, is_rms, dtype, dropout):
    """M < 64 (one dweight chunk): the backward runs parallel over column blocks, with the serial kernel's results
    bit for bit (each column still sums its rows in order), dropout mask included."""
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu, "COLS_BLOCK_MIN", 16)  # several column blocks at this small N, one ragged
    m, n = 5, 200
    g = torch.Generator().manual_seed(4)
    x, r = torch.randn(m, n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    w, b = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    dout, dres_out = torch.randn(m, n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    calls = []
    real = cpu.bwd_cols_parallel
    monkeypatch.setattr(cpu, "bwd_cols_parallel", lambda *a: calls.append(1) or real(*a))
    p = 0.3 if dropout else 0.0
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b)]
            torch.manual_seed(9)
            fn = add_rms_norm if is_rms else add_layer_norm
            args = (leaves[0], leaves[1], leaves[2]) if is_rms else tuple(leaves)
            out, res = fn(*args, eps=1e-5, dropout_p=p, residual_dtype=torch.float32, backend="cpu")
            torch.autograd.backward([out, res], [dout, dres_out.float()])
            results.append([t.grad for t in (leaves if not is_rms else leaves[:3])])
    finally:
        torch.set_num_threads(before)
    assert calls == [1]  # the 2-thread run took the column split, the 1-thread run the serial kernel
    for a, b_ in zip(results[0], results[1]):
        assert torch.equal(a, b_)
