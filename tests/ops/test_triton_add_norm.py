"""The Triton backend against the float64 oracle: forward, every gradient, dropout, determinism, both kernel paths.

Runs on CUDA when present, else on CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so sizes
stay tiny. The looped (wide-row) path is reached at small N by shrinking the launcher's block limits.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from addnorm import add_layer_norm, add_rms_norm, layer_norm, rms_norm  # noqa: E402
from addnorm.ops.backends import unavailable_reason  # noqa: E402
from addnorm.ops.triton import launch as T  # noqa: E402
from addnorm.ops.triton import plan as P  # noqa: E402
from addnorm.reference import stats_naive  # noqa: E402
from addnorm.testing import assert_close, oracle  # noqa: E402

LN, RMS = False, True
TINY = P.Tuning(max_fwd_block_n=64, max_bwd_block_n=64, max_bwd_block_n_rms_16bit=64, loop_block_n=32)


@pytest.fixture(autouse=True)
def _triton_here(device):
    reason = T.unavailable_reason(device)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def looped(monkeypatch):
    """Force the looped path: rows wider than 64 elements no longer fit 'registers'."""
    monkeypatch.setattr(P, "tuning", lambda: TINY)


def _inputs(m, n, dtype, device, *, residual=True, weight=True, bias=True, residual_dtype=None, stride_pad=0):
    """Leaf tensors; with stride_pad > 0, x and residual are column slices of wider buffers (strided rows)."""

    def rows(dt):
        big = torch.randn(m, n + stride_pad, dtype=dt, device=device)
        return big[:, stride_pad:].requires_grad_(True) if stride_pad else big.requires_grad_(True)

    x = rows(dtype)
    r = rows(residual_dtype or dtype) if residual else None
    w = (1 + 0.5 * torch.randn(n, dtype=dtype, device=device)).requires_grad_(True) if weight else None
    b = (0.5 * torch.randn(n, dtype=dtype, device=device)).requires_grad_(True) if bias else None
    return x, r, w, b


def check_against_oracle(is_rms, x, r, w, b, *, eps=1e-5, dresidual_out=True, **kw):
    """Run the Triton backend forward and backward and compare out, residual_out and every gradient."""
    if is_rms:
        out, res_out = add_rms_norm(x, r, w, eps, backend="triton", **kw)
    else:
        out, res_out = add_layer_norm(x, r, w, b, eps, backend="triton", **kw)
    dout = torch.randn_like(out)
    dres_out = torch.randn_like(res_out) if dresidual_out else None
    torch.autograd.backward((out, res_out) if dresidual_out else (out,), (dout, dres_out) if dresidual_out else (dout,))
    ref = oracle(
        x,
        r,
        w,
        None if is_rms else b,
        eps=eps,
        is_rms=is_rms,
        dout=dout,
        dresidual_out=dres_out,
        residual_dtype=kw.get("residual_dtype"),
        zero_centered_weight=kw.get("zero_centered_weight", False),
        cast_before_weight=kw.get("cast_before_weight", False),
        out_dtype=kw.get("out_dtype"),
    )
    m = x.shape[0]
    assert out.dtype == kw.get("out_dtype", x.dtype)
    assert_close(out, ref["out"], "out")
    assert_close(res_out, ref["residual_out"], "residual_out")
    assert_close(x.grad, ref["dx"], "dx", grad=True)
    if r is not None:
        assert r.grad.dtype == r.dtype
        assert_close(r.grad, ref["dresidual"], "dresidual", grad=True)
    if w is not None:
        assert_close(w.grad, ref["dweight"], "dweight", grad=True, reduced_rows=m)
    if b is not None and not is_rms:
        assert_close(b.grad, ref["dbias"], "dbias", grad=True, reduced_rows=m)
    return out, res_out


# --------------------------------------------------------------------------------------------------------------
# Against the oracle
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_dtypes(device, dtype, is_rms):
    check_against_oracle(is_rms, *_inputs(3, 200, dtype, device))


@pytest.mark.parametrize(
    "m, n, dtype, is_rms, opts",
    [
        (0, 37, torch.float32, LN, {}),
        (1, 37, torch.bfloat16, RMS, {}),
        (5, 100, torch.float32, LN, dict(residual=False)),
        (5, 100, torch.float16, LN, dict(weight=False, bias=False)),
        (5, 100, torch.float32, LN, dict(weight=False)),  # bias alone
        (5, 100, torch.float32, RMS, dict(residual=False, weight=False)),
        (7, 300, torch.bfloat16, LN, dict(residual_dtype=torch.float32)),  # fp32 residual stream, bf16 x
        (7, 300, torch.bfloat16, RMS, dict(residual_dtype=torch.float32)),
        (3, 130, torch.float16, RMS, dict(stride_pad=5)),  # strided rows, no copies
        (3, 130, torch.float32, LN, dict(stride_pad=3, residual_dtype=torch.float32)),
        # the sum is rounded to the stored dtype (bf16 here) and the norm sees exactly that rounded value
        (5, 100, torch.float32, RMS, dict(store_as=torch.bfloat16)),
        (5, 100, torch.bfloat16, LN, dict(store_as=torch.float32)),  # bf16 residual, fp32 stream from here on
    ],
)
def test_options(device, m, n, dtype, is_rms, opts):
    opts = dict(opts)
    residual_dtype = opts.get("residual_dtype") or opts.pop("store_as", None)
    inputs = _inputs(m, n, dtype, device, **opts)
    kw = {"residual_dtype": residual_dtype} if residual_dtype is not None else {}
    out, res_out = check_against_oracle(is_rms, *inputs, **kw)
    if residual_dtype is not None:
        assert res_out.dtype == residual_dtype and out.dtype == dtype


class _Launches:
    """Stands in for a kernel and records that the launcher picked it."""

    def __init__(self, kernel, seen, name):
        self.kernel, self.seen, self.name = kernel, seen, name

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((self.name, kw.get("num_warps")))
            return self.kernel[grid](*args, **kw)

        return launch


@pytest.mark.parametrize(
    "dtype, residual_dtype, is_rms, one_pass",
    [
        (torch.bfloat16, None, RMS, True),  # 2-byte h and dout: RMSNorm's backward in one pass up to the wider limit
        (torch.float16, None, RMS, True),
        (torch.bfloat16, torch.float32, RMS, False),  # an fp32 residual stream: row sums + tiles, as before
        (torch.float32, None, RMS, False),
        (torch.bfloat16, None, LN, False),  # LayerNorm keeps max_bwd_block_n
    ],
)
def test_rms_backward_wide_rows_in_one_pass(device, monkeypatch, dtype, residual_dtype, is_rms, one_pass):
    """Tuning.max_bwd_block_n_rms_16bit, scaled down (64 -> 256 here, 8192 -> 16384 as shipped): which kernels the
    backward launches, with how many warps, and that both routes still match the oracle."""
    tuning = P.Tuning(
        max_fwd_block_n=64,
        max_bwd_block_n=64,
        max_bwd_block_n_rms_16bit=256,
        wide_bwd_elems_per_thread=2,
        rows_block_elems=256,
        loop_block_n=32,
    )
    monkeypatch.setattr(P, "tuning", lambda: tuning)
    seen = []
    for name in ("bwd_rows_kernel", "bwd_row_sums_kernel", "bwd_tiles_kernel"):
        monkeypatch.setattr(T, name, _Launches(getattr(T, name), seen, name))
    kw = {"residual_dtype": residual_dtype} if residual_dtype else {}
    check_against_oracle(is_rms, *_inputs(5, 200, dtype, device), **kw)
    if one_pass:  # one row of 256 elements (rows_block_elems) at 2 a thread: 4 warps
        assert seen == [("bwd_rows_kernel", 4)]
    else:
        assert [name for name, _ in seen] == ["bwd_row_sums_kernel", "bwd_tiles_kernel"]


def test_backward_warps_as_shipped():
    """The shipped limits: RMSNorm's backward rows of 16384 run 16 warps (32 elements a thread; 32 warps would cap
    a thread at 64 registers and spill), narrower rows keep 8 elements a thread."""
    assert P.tuning().max_bwd_block_n_rms_16bit == 16384
    assert P.warp_count(16384, P.tuning().wide_bwd_elems_per_thread) == 16
    assert P.warp_count(8192) == 32 and P.warp_count(4096) == 16


def test_backward_grid_sizes_per_path(monkeypatch):
    """The persistent rows backward runs programs_per_sm (2) programs per SM, the looped backward's row groups x
    column tiles about looped_programs_per_sm (4) per SM: the H200 sweep's best for each (tune.txt)."""
    monkeypatch.setattr(P, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    rows = P.bwd_config(100000, 1024, True, False, True, False, True, False, False, False, False, cuda)
    assert rows[0] is True and rows[1] == 2 * 132
    looped = P.bwd_config(100000, 65536, True, False, True, False, True, False, False, False, False, cuda)
    assert looped[0] is False and looped[1] == 65536 // P.tuning().loop_block_n
    assert looped[2] == -(-4 * 132 // looped[1])  # row groups: 4 programs per SM over the column tiles
    few_rows = P.bwd_config(3, 65536, True, False, True, False, True, False, False, False, False, cuda)
    assert few_rows[2] == 3  # never more groups than rows


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_zero_centered_weight(device, is_rms):
    x, r, w, b = _inputs(4, 96, torch.float32, device)
    with torch.no_grad():
        w.mul_(0.1)  # Gemma stores w near 0 and applies 1 + w
    check_against_oracle(is_rms, x, r, w, b, zero_centered_weight=True)


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
@pytest.mark.parametrize("path", ["rows", "looped"])
def test_cast_before_weight(device, is_rms, path, monkeypatch):
    """Llama's order on both kernel paths; the fwd output matches the reference backend's (same two roundings)."""
    if path == "looped":
        monkeypatch.setattr(P, "tuning", lambda: TINY)
    x, r, w, b = _inputs(5, 100, torch.bfloat16, device)
    out, _ = check_against_oracle(is_rms, x, r, w, b, cast_before_weight=True)
    fn = add_rms_norm if is_rms else add_layer_norm
    args = (x, r, w, 1e-5) if is_rms else (x, r, w, b, 1e-5)
    with torch.no_grad():
        want, _ = fn(*args, cast_before_weight=True, backend="reference")
        once, _ = fn(*args, backend="triton")
    # equal up to the rare element where an fp32 rsqrt differs in its last bit; one rounding differs far more often
    assert (out != want).float().mean() < 0.01 < (once != want).float().mean()


@pytest.mark.parametrize("path", ["rows", "looped"])
def test_out_dtype(device, path, monkeypatch):
    """An fp32 residual stream whose normalized output is written in bf16 (and the reverse), with Llama's cast."""
    if path == "looped":
        monkeypatch.setattr(P, "tuning", lambda: TINY)
    check_against_oracle(RMS, *_inputs(5, 100, torch.float32, device), out_dtype=torch.bfloat16)
    check_against_oracle(LN, *_inputs(3, 90, torch.bfloat16, device), out_dtype=torch.float32, cast_before_weight=True)


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_backward_reloading_the_weight_per_row_block(device, is_rms, monkeypatch):
    """The wide-row variant of the backward's rows kernel (weight reloaded per row block, not held in registers)."""
    tuning = P.Tuning(reload_weight_above=0)
    monkeypatch.setattr(P, "tuning", lambda: tuning)
    x, r, w, b = _inputs(9, 100, torch.bfloat16, device)
    with torch.no_grad():
        w.mul_(0.1)
    check_against_oracle(is_rms, x, r, w, b, zero_centered_weight=True, cast_before_weight=True)


def test_small_n_packs_rows(device):
    """QK-norm shapes: several rows per program (BLOCK_M > 1), rows crossing program boundaries."""
    m, n = 37, 128
    block_m, _ = P._rows_blocks(n, P.tuning().max_fwd_block_n)
    assert 1 < block_m < m  # two programs, the second one partly past the last row
    check_against_oracle(RMS, *_inputs(m, n, torch.bfloat16, device))


def test_leading_dims_and_plain_norms(device):
    x = torch.randn(2, 3, 50, device=device)
    w, b = torch.randn(50, device=device), torch.randn(50, device=device)
    ln = layer_norm(x, w, b, 1e-5, backend="triton")
    torch.testing.assert_close(ln, torch.nn.functional.layer_norm(x, (50,), w, b, 1e-5), atol=2e-5, rtol=2e-5)
    rms = rms_norm(x, w, 1e-6, backend="triton")
    torch.testing.assert_close(rms, torch.nn.functional.rms_norm(x, (50,), w, 1e-6), atol=2e-5, rtol=2e-5)
    assert ln.shape == x.shape


# --------------------------------------------------------------------------------------------------------------
# The looped path (rows too wide for registers)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, is_rms, opts",
    [
        (torch.float32, LN, {}),
        (torch.bfloat16, RMS, dict(residual_dtype=torch.float32)),
        (torch.float64, LN, dict(stride_pad=2)),
        (torch.float16, RMS, dict(residual=False, weight=False)),
    ],
)
def test_looped_path(device, looped, dtype, is_rms, opts):
    assert P._rows_blocks(200, P.tuning().max_fwd_block_n) is None
    residual_dtype = opts.get("residual_dtype")
    kw = {"residual_dtype": residual_dtype} if residual_dtype is not None else {}
    check_against_oracle(is_rms, *_inputs(3, 200, dtype, device, **opts), **kw)


@pytest.mark.parametrize("path", ["rows", "looped"])
def test_stats_do_not_cancel(device, monkeypatch, path):
    """A large common offset: E[h^2] - E[h]^2 in fp32 loses every digit of the variance (shown with the naive
    reference); the kernels' two-pass / Welford-Chan statistics keep it."""
    if path == "looped":
        monkeypatch.setattr(P, "tuning", lambda: TINY)
    x = (1e4 + torch.randn(2, 200, dtype=torch.float64)).float().to(device)
    _, _, _, rstd = T.forward(
        x,
        None,
        None,
        None,
        eps=1e-5,
        is_rms=False,
        dropout_p=0.0,
        seed=0,
        residual_dtype=x.dtype,
        zero_centered_weight=False,
        store_residual_out=False,
    )
    var64 = x.double().var(dim=-1, unbiased=False)
    rstd64 = torch.rsqrt(var64 + 1e-5)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-4, atol=0)
    naive = torch.rsqrt(stats_naive(x.cpu(), torch.float32)[1].double().clamp_min(0) + 1e-5).to(device)
    assert not torch.allclose(naive, rstd64, rtol=1e-2, atol=0)  # the offset really does defeat naive stats


@pytest.mark.parametrize(
    "n, dtype, is_rms",
    [
        (65537, torch.bfloat16, LN),
        (65537, torch.float16, RMS),
        (65537, torch.float64, LN),
        (262144, torch.float32, RMS),
    ],
)
def test_wide_row(device, n, dtype, is_rms):
    """Real hidden sizes above 65536 with the default block limits (one row, so the interpreter stays quick)."""
    assert P._rows_blocks(n, P.tuning().max_fwd_block_n) is None
    check_against_oracle(is_rms, *_inputs(1, n, dtype, device))


@pytest.mark.parametrize(
    "m, n, is_rms",
    [(4096, 4096, RMS), (1000, 8192, LN), (300, 16384, RMS), (64, 262144, LN), (20000, 128, RMS)],
)
def test_real_sizes_on_gpu(device, m, n, is_rms):
    """Every launcher choice at the sizes it exists for (bf16, fp32 residual stream): GPU only, the interpreter
    would take minutes. Also checks the full-size persistent backward is bitwise reproducible."""
    if device.type != "cuda":
        pytest.skip("real sizes need a GPU")
    x, r, w, b = _inputs(m, n, torch.bfloat16, device, residual_dtype=torch.float32)
    check_against_oracle(is_rms, x, r, w, b, residual_dtype=torch.float32)
    dout = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        if is_rms:
            out, _ = add_rms_norm(x, r, w, 1e-5, backend="triton")
        else:
            out, _ = add_layer_norm(x, r, w, b, backend="triton")
        runs.append(torch.autograd.grad(out, (w,), dout)[0])
    assert torch.equal(runs[0], runs[1])


# --------------------------------------------------------------------------------------------------------------
# Determinism of the two-stage dweight/dbias reduction
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["rows", "looped"])
def test_dweight_dbias_bitwise_reproducible(device, monkeypatch, path):
    if path == "looped":
        monkeypatch.setattr(P, "tuning", lambda: TINY)
    # several persistent programs in the interpreter (rows: 9 row blocks of 4 on 4 programs; looped: 3 column
    # tiles x 2 row groups)
    m, n = (33, 600) if path == "rows" else (9, 70)
    x = torch.randn(m, n, device=device)
    w = torch.randn(n, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    dout = torch.randn(m, n, device=device)
    grads = []
    for _ in range(2):
        out, _ = add_layer_norm(x, None, w, b, backend="triton")
        grads.append(torch.autograd.grad(out, (w, b), dout))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# --------------------------------------------------------------------------------------------------------------
# Dropout: mask from (seed, row, col), regenerated in the backward
# --------------------------------------------------------------------------------------------------------------


def test_dropout(device):
    m, n, p = 7, 300, 0.3
    x = torch.randn(m, n, device=device, requires_grad=True)
    r = torch.zeros(m, n, device=device, requires_grad=True)  # residual_out = dropout(x): the mask is visible
    w = torch.randn(n, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    out, res_out = add_layer_norm(x, r, w, b, dropout_p=p, backend="triton")
    keep = res_out != 0
    # kept fraction within 5 binomial standard deviations of 1 - p
    frac, count = keep.float().mean().item(), m * n
    assert abs(frac - (1 - p)) < 5 * math.sqrt(p * (1 - p) / count)
    torch.testing.assert_close(res_out[keep], x.detach()[keep] / (1 - p), atol=0, rtol=2e-7)
    dout, dres_out = torch.randn_like(out), torch.randn_like(res_out)
    torch.autograd.backward((out, res_out), (dout, dres_out))
    assert torch.all(x.grad[~keep] == 0)
    ref = oracle(x, r, w, b, eps=1e-5, is_rms=False, keep=keep, dropout_p=p, dout=dout, dresidual_out=dres_out)
    for name, actual in (("out", out), ("residual_out", res_out)):
        assert_close(actual, ref[name], name)
    assert_close(x.grad, ref["dx"], "dx", grad=True)
    assert_close(r.grad, ref["dresidual"], "dresidual", grad=True)
    assert_close(w.grad, ref["dweight"], "dweight", grad=True, reduced_rows=m)
    assert_close(b.grad, ref["dbias"], "dbias", grad=True, reduced_rows=m)


def test_dropout_mask_depends_only_on_seed_and_position(device, monkeypatch):
    """The rows and looped paths draw the same mask for the same seed; the next call draws a new one."""
    x = torch.randn(3, 200, device=device) + 3  # no exact zeros in x
    torch.manual_seed(1)
    _, rows_res = add_rms_norm(x, dropout_p=0.5, backend="triton")
    _, next_res = add_rms_norm(x, dropout_p=0.5, backend="triton")
    monkeypatch.setattr(P, "tuning", lambda: TINY)
    torch.manual_seed(1)
    xg = x.clone().requires_grad_(True)
    out, looped_res = add_rms_norm(xg, dropout_p=0.5, backend="triton")
    assert torch.equal(rows_res != 0, looped_res != 0)
    assert not torch.equal(rows_res != 0, next_res != 0)
    out.backward(torch.randn_like(out))  # the looped backward regenerates the same mask
    assert torch.equal(xg.grad == 0, looped_res == 0)


# --------------------------------------------------------------------------------------------------------------
# torch.compile and availability
# --------------------------------------------------------------------------------------------------------------


def test_torch_compile_fullgraph(device):
    def block(x, r, w):
        out, res = add_rms_norm(x, r, w, 1e-6, backend="triton")
        return (out * 2).sum() + res.square().sum()

    x, r, w, _ = _inputs(3, 40, torch.float32, device, bias=False)
    eager = block(x, r, w)
    eager_grads = torch.autograd.grad(eager, (x, r, w))
    # inductor needs a C++ toolchain on CPU; aot_eager still traces the whole graph through the custom ops
    compiled = torch.compile(block, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    got = compiled(x, r, w)
    got_grads = torch.autograd.grad(got, (x, r, w))
    torch.testing.assert_close(got, eager)
    for a, e in zip(got_grads, eager_grads):
        torch.testing.assert_close(a, e)


def test_unavailable_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in T.unavailable_reason(torch.device("cpu"))
    assert "TRITON_INTERPRET=1" in unavailable_reason("triton", "cpu")
    assert "not on meta" in T.unavailable_reason(torch.device("meta"))
    monkeypatch.setattr(T, "triton", None)
    assert "pip install 'addnorm[triton]'" in T.unavailable_reason(torch.device("cuda"))


# Compiled mode differs from the interpreter (scalar types, loop-carried types, specialization): compile every
# kernel the launchers pick, for sm_90, without a GPU (Triton ships ptxas), with tools/sm90_static.py. Runs in
# a subprocess because this process imported the kernels in interpreter mode.
@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401 - the NVIDIA backend must be present

    script = Path(__file__).resolve().parents[2] / "tools" / "sm90_static.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile from scratch, leave no cache behind
    done = subprocess.run(
        [sys.executable, str(script), "--shapes", "test", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert {r["name"] for r in rows} == {
        "fwd_rows_kernel",
        "fwd_looped_kernel",
        "bwd_rows_kernel",
        "bwd_row_sums_kernel",
        "bwd_tiles_kernel",
        "bwd_fixup_kernel",  # the backward's guard (guard_bwd), after every backward
        # the wide rows' team kernels (opt-in) and their two-kernel fallback: compiled mode differs from the
        # interpreter the other tests run them in (the team kernel's spin-wait, the loop-carried row counter)
        "fwd_team_kernel",
        "fwd_partials_kernel",
        "fwd_finish_kernel",
        "bwd_team_kernel",
        "bwd_partials_kernel",
        "bwd_finish_kernel",
        # the quantized add + norm kernel, every scale variant (tools/sm90_static.py's QUANT_SHAPES)
        "quant_rows_kernel",
        # the fused norm-then-add kernels (NORM_ADD_SHAPES)
        "norm_add_fwd_kernel",
        "norm_add_bwd_kernel",
        "norm_add_fixup_kernel",  # its backward's guard (norm_add_guard)
    }
    # the team kernels hold a row's chunk in registers across the team's meeting: no spill at all, and the grid
    # sized from programs/SM must have room for a team
    team = [r for r in rows if "team" in r["name"] or "partials" in r["name"] or "finish" in r["name"]]
    assert all(r["spill_stores"] == r["spill_loads"] == 0 and r["programs_per_sm"] >= 1 for r in team), team
    # A tile that no longer fits in registers spills hundreds of bytes per thread and costs bandwidth on every element;
    # a register or two is noise (Triton 3.6's ptxas spills 8 bytes in bwd_tiles_kernel, 3.9's none). bf16 kernels
    # must stay under 4 registers' worth, and every kernel must fit on an SM.
    assert all(max(r["spill_stores"], r["spill_loads"]) <= 16 for r in rows if r["dtype"] == "bf16"), rows
    assert all(r["programs_per_sm"] >= 1 for r in rows), rows
    # compiled as launches specialize them: aligned pointers and N % 16 == 0 carry tt.divisibility=16 (without it
    # ptxas sees scalar loads that never run). The test shapes' N (300, 70000, 20000) are all multiples of 4 only
    # or of 16: 70000 % 16 == 0, so the wide RMSNorm launch specializes N as well.
    # (the pointers each kernel streams: add + norm forward, backward, quantized, fused norm-then-add)
    streamed = ({"X", "Out", "Rstd"}, {"DOut", "H", "Rstd"}, {"X", "H", "Q"}, {"Y", "R", "H"}, {"Y", "DY"})
    for r in rows:
        div = set(r["divisible"].split(","))
        assert any(s <= div for s in streamed), r
    assert any("N" in r["divisible"].split(",") for r in rows if r["n"] == 70000), rows
    # RMSNorm's backward at N = 16384 in one pass (Tuning.max_bwd_block_n_rms_16bit): 16 warps, no spill past
    # the register-or-two noise (Triton 3.9's ptxas: none; 3.6's on the H200: 12 bytes, where this path measured
    # 3.6 TB/s against 3.2 for the row-sums + tiles path, benchmarks/results/gpu/tune.txt)
    wide = [r for r in rows if r["n"] == 16384 and r["name"].startswith("bwd") and r["name"] != "bwd_fixup_kernel"]
    assert [(r["name"], r["num_warps"]) for r in wide] == [("bwd_rows_kernel", 16)], wide
    assert max(wide[0]["spill_stores"], wide[0]["spill_loads"]) <= 16, wide
    assert not any("N" in r["divisible"].split(",") for r in rows if r["n"] == 300), rows
