"""Wide rows by teams of programs (addnorm.ops.triton.team_kernels, launched by addnorm.ops.triton.team_launch): the math of K
programs per row against the float64 oracle, forward and every gradient, for K = 1 ... 8; what is promised bit for
bit (a row's bits do not depend on the batch or its position; residual_out not on K); the choice of K from N only;
the occupancy arithmetic that sizes the team grid.

In Triton's interpreter (no GPU) the team's math runs through the two-kernel fallback, which shares every helper
with the team kernel; on a GPU the tests at the end run the team kernel itself (in a subprocess with a timeout: a
team that never meets would hang) and compare its bits with the fallback's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from addnorm import add_layer_norm, add_rms_norm  # noqa: E402
from addnorm.ops.triton import launch as T  # noqa: E402
from addnorm.ops.triton import plan as P  # noqa: E402
from addnorm.ops.triton import team_launch as W  # noqa: E402
from addnorm.testing import assert_close, oracle  # noqa: E402

LN, RMS = False, True


@pytest.fixture(autouse=True)
def _triton_here(device):
    reason = T.unavailable_reason(device)
    if reason is not None:
        pytest.skip(reason)


def _team(monkeypatch, k: int, **kw) -> None:
    tuning = W.WideTuning(team=k, **kw)
    monkeypatch.setattr(W, "wide_tuning", lambda: tuning)


def _inputs(m, n, dtype, device, *, residual=True, weight=True, bias=True, residual_dtype=None):
    x = torch.randn(m, n, dtype=dtype, device=device).requires_grad_(True)
    r = torch.randn(m, n, dtype=residual_dtype or dtype, device=device).requires_grad_(True) if residual else None
    w = (1 + 0.5 * torch.randn(n, dtype=dtype, device=device)).requires_grad_(True) if weight else None
    b = (0.5 * torch.randn(n, dtype=dtype, device=device)).requires_grad_(True) if bias else None
    return x, r, w, b


def _run(is_rms, x, r, w, b, dout, dres_out, **kw):
    """Forward and backward on the triton backend: (out, residual_out, dx, dresidual, dweight, dbias)."""
    for t in (x, r, w, b):
        if t is not None:
            t.grad = None
    if is_rms:
        out, res = add_rms_norm(x, r, w, 1e-5, backend="triton", **kw)
    else:
        out, res = add_layer_norm(x, r, w, b, 1e-5, backend="triton", **kw)
    torch.autograd.backward((out, res), (dout, dres_out))
    grads = tuple(t.grad if t is not None else None for t in (x, r, w, None if is_rms else b))
    return (out.detach(), res.detach(), *grads)


def _check(is_rms, x, r, w, b, **kw):
    """The team's results against the float64 oracle: out, residual_out and every gradient."""
    m = x.shape[0]
    dout = torch.randn(x.shape, dtype=kw.get("out_dtype", x.dtype), device=x.device)
    res_dtype = kw.get("residual_dtype") or (r.dtype if r is not None else x.dtype)
    dres_out = torch.randn(x.shape, dtype=res_dtype, device=x.device)
    got = _run(is_rms, x, r, w, b, dout, dres_out, **kw)
    ref = oracle(
        x,
        r,
        w,
        None if is_rms else b,
        eps=1e-5,
        is_rms=is_rms,
        dout=dout,
        dresidual_out=dres_out,
        residual_dtype=kw.get("residual_dtype"),
        zero_centered_weight=kw.get("zero_centered_weight", False),
        cast_before_weight=kw.get("cast_before_weight", False),
    )
    out, res, dx, dr, dw, db = got
    assert_close(out, ref["out"], "out")
    assert_close(res, ref["residual_out"], "residual_out")
    assert_close(dx, ref["dx"], "dx", grad=True)
    if r is not None:
        assert_close(dr, ref["dresidual"], "dresidual", grad=True)
    if w is not None:
        assert_close(dw, ref["dweight"], "dweight", grad=True, reduced_rows=m)
    if b is not None and not is_rms:
        assert_close(db, ref["dbias"], "dbias", grad=True, reduced_rows=m)
    return got


# --------------------------------------------------------------------------------------------------------------
# Against the oracle: K = 1 ... 8, N with full, partial and empty chunks
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_team_matches_oracle(device, monkeypatch, k, is_rms):
    # N cycles through 64 (chunks of 64/K: full), 96 (the last chunk partial; K = 7, 8 leave empty chunks) and
    # 200 (not a multiple of 16)
    n = (64, 96, 200)[k % 3]
    _team(monkeypatch, k)
    launched = []
    for name in ("fwd_partials_kernel", "fwd_finish_kernel", "bwd_partials_kernel", "bwd_finish_kernel"):
        kernel = getattr(W, name)
        monkeypatch.setattr(W, name, _Recorder(kernel, launched, name))
    _check(is_rms, *_inputs(5, n, torch.float32, device))
    # the interpreter runs the two-kernel form (a spin-wait would never end there), K programs a row
    grids = dict(launched)
    assert set(grids) == {"fwd_partials_kernel", "fwd_finish_kernel", "bwd_partials_kernel", "bwd_finish_kernel"}
    assert grids["fwd_partials_kernel"] == (5, k) and grids["bwd_finish_kernel"][0] == k


class _Recorder:
    """Stands in for a kernel: records (name, grid), then launches it."""

    def __init__(self, kernel, seen, name):
        self.kernel, self.seen, self.name = kernel, seen, name

    def __getitem__(self, grid):
        self.seen.append((self.name, grid))
        return self.kernel[grid]


@pytest.mark.parametrize(
    "k, n, dtype, is_rms, opts",
    [
        (4, 200, torch.bfloat16, LN, dict(residual_dtype=torch.float32)),  # fp32 stream, bf16 x
        (3, 96, torch.bfloat16, RMS, {}),
        (5, 130, torch.float16, RMS, dict(zero_centered_weight=True, cast_before_weight=True)),
        (2, 100, torch.float64, LN, {}),  # fp64 statistics
        (6, 100, torch.float32, LN, dict(residual=False, bias=False)),
        (8, 64, torch.float32, RMS, dict(weight=False)),
    ],
)
def test_team_options(device, monkeypatch, k, n, dtype, is_rms, opts):
    opts = dict(opts)
    kw = {key: opts.pop(key) for key in ("residual_dtype", "zero_centered_weight", "cast_before_weight") if key in opts}
    _team(monkeypatch, k)
    _check(is_rms, *_inputs(4, n, dtype, device, residual_dtype=kw.get("residual_dtype"), **opts), **kw)


def test_team_dropout_draws_the_contracts_mask(device, monkeypatch):
    """Dropout through a team: the rows kernel's keep-mask for the same seed (the contract's hash of i * N + j),
    regenerated by the backward; the results against the oracle given that mask."""
    m, n, p = 3, 96, 0.3
    x = torch.randn(m, n, device=device) + 3  # no exact zeros in x
    r = torch.zeros(m, n, device=device, requires_grad=True)  # residual_out = dropout(x): the mask is visible
    w, b = (torch.randn(n, device=device, requires_grad=True) for _ in "wb")
    masks = []
    for k in (0, 3):
        _team(monkeypatch, k)
        torch.manual_seed(1)
        xg = x.clone().requires_grad_(True)
        out, res = add_layer_norm(xg, r, w, b, dropout_p=p, backend="triton")
        masks.append(res.detach() != 0)
    assert torch.equal(masks[0], masks[1])
    dout, dres = torch.randn_like(out), torch.randn_like(res)
    r.grad = w.grad = b.grad = None
    torch.autograd.backward((out, res), (dout, dres))
    ref = oracle(xg, r, w, b, eps=1e-5, is_rms=False, keep=masks[1], dropout_p=p, dout=dout, dresidual_out=dres)
    assert_close(out, ref["out"], "out")
    assert_close(res, ref["residual_out"], "residual_out")
    assert_close(xg.grad, ref["dx"], "dx", grad=True)
    assert torch.all(xg.grad[~masks[1]] == 0)
    assert_close(w.grad, ref["dweight"], "dweight", grad=True, reduced_rows=m)


# --------------------------------------------------------------------------------------------------------------
# What is promised bit for bit
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_a_rows_bits_do_not_depend_on_the_batch(device, monkeypatch, is_rms):
    """For a given K, each row's out, residual_out, dx and dresidual are the same bits alone, in a batch, or at
    another position (K, CHUNK and warps come from N only)."""
    _team(monkeypatch, 3)
    x, r, w, b = _inputs(6, 96, torch.bfloat16, device)
    dout, dres = torch.randn_like(x), torch.randn_like(x)
    full = _run(is_rms, x, r, w, b, dout, dres)
    order = torch.tensor([4, 1], device=device)
    for rows in (order, order[:1]):
        xs = x.detach()[rows].requires_grad_(True)
        rs = r.detach()[rows].requires_grad_(True)
        part = _run(is_rms, xs, rs, w, b, dout[rows], dres[rows])
        for name, a, f in zip(("out", "residual_out", "dx", "dresidual"), part[:4], full[:4]):
            assert torch.equal(a, f[rows]), name


def test_residual_out_is_the_same_bits_for_every_k(device, monkeypatch):
    """residual_out is a rounded sum, no reduction: every K (and the rows path) stores the same bits. The
    statistics combine different partials for different K, so out and the gradients agree within tolerance only
    (test_team_matches_oracle)."""
    x, r, w, b = _inputs(3, 96, torch.bfloat16, device)
    stored = []
    for k in (0, 1, 2, 5, 8):
        _team(monkeypatch, k)
        stored.append(add_rms_norm(x, r, w, 1e-5, backend="triton")[1].detach())
    assert all(torch.equal(s, stored[0]) for s in stored)


def test_in_place_through_a_team(device, monkeypatch):
    """add_rms_norm_: x and residual overwritten; the fallback reads residual_out back, as stored, for out."""
    from addnorm import add_rms_norm_

    _team(monkeypatch, 4)
    x, r, w, _ = (t.detach() if t is not None else None for t in _inputs(3, 200, torch.float32, device))
    expected = add_rms_norm(x, r, w, 1e-5, backend="triton")
    got = add_rms_norm_(x.clone(), r.clone(), w, 1e-5, backend="triton")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# --------------------------------------------------------------------------------------------------------------
# Choosing K: from N only, opt-in
# --------------------------------------------------------------------------------------------------------------


def test_team_size_is_opt_in_and_from_n_only(monkeypatch):
    limit = P.tuning().max_fwd_block_n
    off = W.WideTuning(enabled=False)
    on = W.WideTuning(enabled=True)
    assert W.team_size(262144, wide=off) == 0  # off by default: no GPU has measured the team kernels yet
    assert W.team_size(limit, wide=on) == 0  # the rows path keeps what it holds in registers
    assert W.team_size(limit + 1, wide=on) == -(-(limit + 1) // on.chunk)
    assert W.team_size(65536, wide=on) == 65536 // on.chunk
    assert W.team_size(262144, wide=on) == 262144 // on.chunk  # 32 programs of 8192
    assert W.team_size(262144, backward=True, wide=on) == 262144 // on.bwd_chunk
    assert W.team_size(10**7, wide=on) == on.max_team
    assert W.team_size(64, wide=W.WideTuning(team=5)) == 5  # forced: tests, every width
    monkeypatch.setenv(W.ENV, "1")
    previous = W.set_wide_tuning(W.WideTuning(chunk=4096))
    try:
        tuning = W.refresh()
        assert tuning.enabled and tuning.chunk == 4096  # the env var read again, the other fields kept
        assert W.wide_tuning() is tuning
    finally:
        W.set_wide_tuning(previous)


def test_team_plans_do_not_depend_on_m(device):
    """K, CHUNK and the warps of every team kernel are the same for one row and for a million (issue 26)."""
    wide = W.WideTuning(enabled=True)
    flags = (True, True, False, True, False, False, True, False, True)
    plans = [W.fwd_plan(wide, W.team_size(65536, wide=wide), m, 65536, *flags) for m in (1, 7, 10**6)]
    assert all(p == plans[0] for p in plans)
    assert plans[0][:2] == (8, 8192) and plans[0][2]["num_warps"] == 32
    # narrow, dresidual_out, weight, bias, RMS, zero-centered, dropout, dresidual, cast, device
    bflags = (True, True, True, False, True, False, False, True, False, device)
    bplans = [W.bwd_plan(wide, W.team_size(65536, True, wide), m, 65536, *bflags) for m in (1, 10**6)]
    assert bplans[0] == bplans[1]
    assert bplans[0][:2] == (16, 4096) and bplans[0][2]["num_warps"] == 16


@pytest.mark.parametrize("enabled", [True, False], ids=["on", "off"])
def test_the_launchers_take_teams_past_the_rows_path_when_on(device, monkeypatch, enabled):
    """The automatic choice through the launchers, scaled down (rows path to 64 columns, chunks of 32 forward and
    16 backward): N = 200 runs teams of 7 and 13 programs when the team path is on, the looped kernels when off."""
    plan_tuning = P.Tuning(max_fwd_block_n=64, max_bwd_block_n=64, max_bwd_block_n_rms_16bit=64)
    monkeypatch.setattr(P, "tuning", lambda: plan_tuning)
    wide = W.WideTuning(enabled=enabled, chunk=32, bwd_chunk=16)
    monkeypatch.setattr(W, "wide_tuning", lambda: wide)
    launched = []
    for module, names in (
        (W, ("fwd_partials_kernel", "fwd_finish_kernel", "bwd_partials_kernel", "bwd_finish_kernel")),
        (T, ("fwd_looped_kernel", "bwd_row_sums_kernel", "bwd_tiles_kernel")),
    ):
        for name in names:
            monkeypatch.setattr(module, name, _Recorder(getattr(module, name), launched, name))
    _check(LN, *_inputs(3, 200, torch.bfloat16, device))
    grids = dict(launched)
    if enabled:
        assert grids == {
            "fwd_partials_kernel": (3, 7),
            "fwd_finish_kernel": (3, 7),
            "bwd_partials_kernel": (3, 13),
            "bwd_finish_kernel": (13, 1),  # the interpreter's 4 persistent programs, over 13 chunks: 1 row group
        }
    else:
        assert set(grids) == {"fwd_looped_kernel", "bwd_row_sums_kernel", "bwd_tiles_kernel"}


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(team=-1), "WideTuning.team must be an integer >= 0"),
        (dict(chunk=3000), "WideTuning.chunk must be a power of two"),
        (dict(bwd_chunk=0), "WideTuning.bwd_chunk must be an integer >= 1"),
        (dict(max_team=True), "WideTuning.max_team must be an integer"),
    ],
)
def test_wide_tuning_refuses_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        W.WideTuning(**kw)


def test_chunk_covers_the_row():
    for n in (64, 96, 200, 70000, 262144):
        for k in range(1, 9):
            c = W.chunk_of(n, k)
            assert c & (c - 1) == 0 and c * k >= n and c < 2 * -(-n // k)


# --------------------------------------------------------------------------------------------------------------
# Occupancy: programs per SM from the compiled kernel (the numbers, sm_90)
# --------------------------------------------------------------------------------------------------------------


def test_programs_per_sm_from_registers_warps_and_shared_memory():
    # the looped backward's tiles kernel as compiled for sm_90: 54 registers, 16 warps -> 2 per SM (its grid
    # assumed 4): 56 allocated x 512 threads = 28672 of 65536 registers
    assert W.programs_per_sm(54, 16) == 2
    assert W.programs_per_sm(30, 16) == 4  # the looped forward: the 2048-thread limit, not registers
    assert W.programs_per_sm(64, 32) == 1 and W.programs_per_sm(65, 32) == 0  # 32 warps x 65+ registers: none
    assert W.programs_per_sm(57, 16) == 2 and W.programs_per_sm(64, 16) == 2 and W.programs_per_sm(65, 16) == 1
    assert W.programs_per_sm(16, 1) == 32  # the 32-block limit
    assert W.programs_per_sm(32, 4, shared_bytes=100 * 1024) == 2  # shared memory: 228 KB / 100 KB
    small = W.SMLimits(registers=32768, threads=1024, shared_bytes=64 * 1024)
    assert W.programs_per_sm(54, 16, limits=small) == 1


def test_looped_groups_fill_whole_waves():
    """The looped backward's row groups from what the GPU holds (Tuning.looped_programs_per_sm = 4 on 132 SMs: a
    target of 528 programs; the compiled tiles kernel fits 2 per SM: 264 resident)."""
    assert W.looped_groups(64, 264, 528, 10**6) == 8  # N = 262144: 512 programs, 2 waves (the fixed rule: 9, 3)
    assert W.looped_groups(16, 264, 528, 10**6) == 33  # N = 65536: 528, 2 waves, as the fixed rule
    assert W.looped_groups(16, 528, 528, 10**6) == 33  # 4 fit: one wave
    assert W.looped_groups(64, 264, 528, 5) == 5  # never more groups than rows
    assert W.looped_groups(64, 600, 528, 10**6) == 9  # at least one wave
    assert W.looped_groups(1024, 264, 528, 10**6) == 1  # more tiles than a wave holds: one group


# --------------------------------------------------------------------------------------------------------------
# On a GPU: the team kernel itself (spin-waits), in a subprocess under a timeout
# --------------------------------------------------------------------------------------------------------------

_GPU_SCRIPT = textwrap.dedent(
    """
    import torch
    from addnorm import add_layer_norm, add_rms_norm
    from addnorm.ops.triton import team_launch as W

    torch.manual_seed(0)

    def run(is_rms, k, fallback, m, n):
        W.set_wide_tuning(W.WideTuning(team=k, fallback=fallback))
        g = torch.Generator(device="cuda").manual_seed(1)
        x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in "xr")
        w = (1 + torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)).requires_grad_()
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        if is_rms:
            out, res = add_rms_norm(x, r, w, 1e-5, backend="triton")
        else:
            out, res = add_layer_norm(x, r, w, b, 1e-5, backend="triton")
        dout, dres = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g), torch.randn_like(res)
        torch.autograd.backward((out, res), (dout, dres))
        torch.cuda.synchronize()
        return [t.detach().clone() for t in (out, res, x.grad, r.grad)]

    for is_rms in (False, True):
        for k, m, n in ((2, 7, 96), (5, 64, 1000), (8, 300, 4096), (3, 4099, 200)):
            team = run(is_rms, k, False, m, n)
            fallback = run(is_rms, k, True, m, n)
            for name, a, b in zip(("out", "residual_out", "dx", "dresidual"), team, fallback):
                assert torch.equal(a, b), (is_rms, k, m, n, name)
    print("team == fallback, bit for bit")
    """
)


def test_team_kernel_equals_the_fallback_bit_for_bit_on_a_gpu():
    """The team kernel (persistent, spin-waiting) and the two-kernel fallback share the math: same bits. Many
    more rows than teams (m = 4099) make every team reuse both workspace slots many times."""
    if not torch.cuda.is_available():
        pytest.skip("the team kernel needs a GPU (the interpreter runs programs one after another)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bit for bit" in done.stdout
