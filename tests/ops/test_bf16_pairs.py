"""The bf16 pairs forward of the fused norm-then-add ops (:mod:`addnorm.ops.cpu.bf16_pairs`): bit for bit the
general kernels' forward (h, N2(h) and the saved statistics), over RMSNorm and LayerNorm, with and without weights
and biases, zero-centered weights, cast_before_weight, widths odd and even and around the block size, rows starting
at odd elements or strided out of step, NaN, inf and rows beyond the plain statistics' range (the guard), in place
and out of place, norm_add and norm_add_norm. ``MIN_ELEMENTS`` is lowered so small calls take the pairs, and each
test checks that they did; calls the pairs do not serve (mixed dtypes, a NaN weight) reach the general kernels."""

from __future__ import annotations

import itertools

import pytest
import torch

from addnorm.ops import backends
from addnorm.ops.norm_add import norm_add, norm_add_, norm_add_norm, norm_add_norm_

if backends.unavailable_reason("cpu", torch.device("cpu")) is None:
    from addnorm.ops.cpu import bf16_pairs as P
    from addnorm.ops.cpu import norm_add_launch as L

OFF = 1 << 62  # MIN_ELEMENTS that no call reaches: the general kernels
WIDTHS = [1, 2, 3, 31, 33, 64, 100, 515]  # pairs from 0 to 257, whole 16-word blocks and a remainder


@pytest.fixture(autouse=True)
def _cpu_backend():
    reason = backends.unavailable_reason("cpu", torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def pairs(monkeypatch):
    """The pairs at any size; the list of their launches ("fwd_serial" / "fwd_parallel")."""
    seen = []
    monkeypatch.setattr(P, "MIN_ELEMENTS", 0)
    for name in ("fwd_serial", "fwd_parallel"):
        real = getattr(P, name)
        monkeypatch.setattr(P, name, lambda *a, _real=real, _name=name: seen.append(_name) or _real(*a))
    return seen


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _same(got, want, what):
    for a, b, name in zip(got, want, ("h", "out2", "stats"), strict=True):
        if a is None:
            assert b is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name)
        assert torch.equal(_bits(a.contiguous()), _bits(b.contiguous())), (what, name)


def _rows(m, n, layout, g, scale=2.0):
    """(m, n) bf16 rows: contiguous; "strided": rows of a buffer n + 7 wide (row starts alternate between even and
    odd elements); "offset": every row starts one element into a buffer n + 1 wide."""
    if layout == "strided":
        return (torch.randn(m, n + 7, generator=g) * scale + 0.5).to(torch.bfloat16)[:, :n]
    if layout == "offset":
        return (torch.randn(m, n + 1, generator=g) * scale + 0.5).to(torch.bfloat16)[:, 1:]
    return (torch.randn(m, n, generator=g) * scale + 0.5).to(torch.bfloat16)


def _forward(monkeypatch, min_elements, y, r, vectors, opts, has_norm2, in_place, layout="contiguous"):
    """(h, out2, stats) of the launch's forward_into on copies of y and r laid out as ``layout``: in place (h into
    r, out2 into y) or into fresh outputs laid out the same way."""
    y, r = _like(y, layout), _like(r, layout)
    m, n = y.shape
    stats = torch.zeros((4, m), dtype=torch.float32)
    if in_place:
        h, out2 = r, (y if has_norm2 else None)
    else:
        h = _like(torch.zeros(m, n, dtype=r.dtype), layout)
        out2 = _like(torch.zeros(m, n, dtype=r.dtype), layout) if has_norm2 else None
    with monkeypatch.context() as mp:
        mp.setattr(P, "MIN_ELEMENTS", min_elements)
        L.forward_into(h, out2, stats, y, r, *vectors, has_norm2=has_norm2, **opts)
    return h.clone(), None if out2 is None else out2.clone(), stats


def _like(t, layout):
    """A copy of (m, n) t: contiguous, or the rows of a wider buffer (see _rows)."""
    m, n = t.shape
    if layout == "contiguous":
        return t.clone(memory_format=torch.contiguous_format)
    wide = n + 7 if layout == "strided" else n + 1
    buf = torch.zeros(m, wide, dtype=t.dtype)
    view = buf[:, :n] if layout == "strided" else buf[:, 1:]
    view.copy_(t)
    return view


def _opts(rms1, rms2, zc, cbw, vectors, eps1=1e-5, eps2=1e-6):
    w1, b1, w2, b2 = vectors
    return dict(
        eps1=eps1, eps2=eps2, is_rms1=rms1, is_rms2=rms2, zc1=zc, zc2=zc,
        # as norm_add._plan: the cast only with a weight or bias
        cast1=cbw and (w1 is not None or b1 is not None), cast2=cbw and (w2 is not None or b2 is not None),
    )  # fmt: skip


def _vectors(n, g, affine, rms1, rms2, dtype=torch.bfloat16):
    def vec(c, s):
        return (c + s * torch.randn(n, generator=g)).to(dtype)

    w1, w2 = (vec(1.0, 0.3), vec(1.0, 0.3)) if affine else (None, None)
    b1 = vec(0.0, 0.2) if affine == "w+b" and not rms1 else None
    b2 = vec(0.0, 0.2) if affine == "w+b" and not rms2 else None
    return w1, b1, w2, b2


@pytest.mark.parametrize("has_norm2", [False, True], ids=["norm_add", "norm_add_norm"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset"])
def test_pairs_give_the_general_kernels_bits(monkeypatch, pairs, has_norm2, in_place, layout):
    g = torch.Generator().manual_seed(1)
    cases = itertools.product(WIDTHS, [(True, True), (False, False), (False, True), (True, False)],
                              [None, "w", "w+b"], [False, True], [False, True])  # fmt: skip
    for n, (rms1, rms2), affine, zc, cbw in cases:
        if not has_norm2 and not rms2:
            continue  # (norm2 unused)
        y, r = _rows(5, n, layout, g), _rows(5, n, layout, g)
        vectors = _vectors(n, g, affine, rms1, rms2)
        opts = _opts(rms1, rms2, zc, cbw, vectors)
        what = (n, rms1, rms2, affine, zc, cbw)
        want = _forward(monkeypatch, OFF, y, r, vectors, opts, has_norm2, in_place, layout)
        launches = len(pairs)
        got = _forward(monkeypatch, 0, y, r, vectors, opts, has_norm2, in_place, layout)
        assert len(pairs) == launches + 1, what
        _same(got, want, what)


def _special_rows(n, g):
    """Rows of NaN, inf, both infinities, values ~1e30 and ~1e-30 (beyond the plain fp32 statistics: the guard's
    scaled pass), zeros, huge residuals (h overflows to inf), and ordinary rows between them."""
    y = (torch.randn(10, n, generator=g) * 2).to(torch.bfloat16)
    r = (torch.randn(10, n, generator=g) * 2).to(torch.bfloat16)
    y[0, n // 2] = float("nan")
    y[1, 0] = float("inf")
    y[2, 0], y[2, n - 1] = float("inf"), float("-inf")
    y[3] = (torch.randn(n, generator=g) * 1e30).to(torch.bfloat16)
    y[4] = (torch.randn(n, generator=g) * 1e-30).to(torch.bfloat16)
    y[5] = 0
    r[6] = 3e38  # h = r + N(y) overflows to inf where N(y) > 0
    r[7, n - 1] = float("nan")
    y[8] = (torch.randn(n, generator=g) * 1e30 + 3e30).to(torch.bfloat16)  # LayerNorm: a mean far from 0
    return y, r


@pytest.mark.parametrize("has_norm2", [False, True], ids=["norm_add", "norm_add_norm"])
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("n", [64, 33])
def test_special_values_and_guarded_rows_give_the_general_bits(monkeypatch, pairs, has_norm2, in_place, n):
    g = torch.Generator().manual_seed(2)
    y, r = _special_rows(n, g)
    for (rms1, rms2), affine, cbw, eps in itertools.product(
        [(True, True), (False, False), (False, True)], [None, "w+b"], [False, True], [1e-6, 0.0]
    ):
        vectors = _vectors(n, g, affine, rms1, rms2)
        opts = _opts(rms1, rms2, False, cbw, vectors, eps1=eps, eps2=eps)
        want = _forward(monkeypatch, OFF, y, r, vectors, opts, has_norm2, in_place)
        launches = len(pairs)
        got = _forward(monkeypatch, 0, y, r, vectors, opts, has_norm2, in_place)
        assert len(pairs) == launches + 1
        _same(got, want, (rms1, rms2, affine, cbw, eps))
        assert got[0][0].isnan().all() and got[2][1, 0].isnan()  # (the NaN row stays NaN: the inputs did their job)


@pytest.mark.parametrize("prefetch_rows", [0, 1, 3, 50])
def test_the_prefetch_distance_changes_no_bits(monkeypatch, pairs, prefetch_rows):
    g = torch.Generator().manual_seed(3)
    y, r = _rows(7, 100, "contiguous", g), _rows(7, 100, "contiguous", g)
    vectors = _vectors(100, g, "w+b", False, False)
    opts = _opts(False, False, False, False, vectors)
    want = _forward(monkeypatch, OFF, y, r, vectors, opts, True, True)
    monkeypatch.setattr(P, "PREFETCH_ROWS", prefetch_rows)
    _same(_forward(monkeypatch, 0, y, r, vectors, opts, True, True), want, prefetch_rows)
    assert pairs


def test_the_public_ops_take_the_pairs_with_the_general_bits(monkeypatch, pairs):
    """72 x 4096 (over the parallel threshold: the parallel driver), every public op; the same calls with the pairs
    off, and the torch backend's composition, give the same bits."""
    g = torch.Generator().manual_seed(4)
    y, r = _rows(72, 4096, "contiguous", g), _rows(72, 4096, "contiguous", g)
    w1, w2 = (torch.randn(4096, generator=g).to(torch.bfloat16) for _ in range(2))

    def run():
        with torch.no_grad():
            h = norm_add(y, r, w1, None, 1e-6, backend="cpu")
            out2, h2 = norm_add_norm(y, r, w1, w2, eps1=1e-6, eps2=1e-6, backend="cpu")
            y_, r_ = y.clone(), r.clone()
            norm_add_(y_, r_, w1, None, 1e-6, backend="cpu")
            y2, r2 = y.clone(), r.clone()
            norm_add_norm_(y2, r2, w1, w2, eps1=1e-6, eps2=1e-6, backend="cpu")
        return h, out2, h2, r_, y2, r2

    got = run()
    assert pairs == ["fwd_parallel"] * 4 or (torch.get_num_threads() < 2 and len(pairs) == 4), pairs
    monkeypatch.setattr(P, "MIN_ELEMENTS", OFF)
    want = run()
    assert len(pairs) == 4
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    with torch.no_grad():
        out2, h = norm_add_norm(y, r, w1, w2, eps1=1e-6, eps2=1e-6, backend="torch")
    assert torch.equal(_bits(got[2]), _bits(h)) and torch.equal(_bits(got[1]), _bits(out2))


def test_the_size_threshold(monkeypatch, pairs):
    monkeypatch.setattr(P, "MIN_ELEMENTS", 1 << 20)
    g = torch.Generator().manual_seed(5)
    for m, want in ((255, 0), (256, 1)):  # 256 x 4096 = 2^20 values
        y, r = _rows(m, 4096, "contiguous", g), _rows(m, 4096, "contiguous", g)
        with torch.no_grad():
            norm_add_(y, r, None, None, 1e-6, backend="cpu")
        assert len(pairs) == want


def test_calls_the_pairs_do_not_serve_reach_the_general_kernels(monkeypatch, pairs):
    """A residual of another dtype (h is fp32), and a NaN weight (fp32, whose low bits the pairs' intermediate
    rounding could carry into the exponent: bf16_words.via_bf16): the general kernels, their bits."""
    g = torch.Generator().manual_seed(6)
    y, r = _rows(4, 40, "contiguous", g), _rows(4, 40, "contiguous", g)
    w = torch.randn(40, generator=g)
    w[3] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)  # a NaN with every payload bit set
    none = (None, None, None, None)
    h = _forward(monkeypatch, 0, y, r.float(), none, _opts(True, True, False, False, none), False, False)[0]
    assert h.dtype == torch.float32 and not pairs
    vectors = (w, None, None, None)
    opts = _opts(True, True, False, False, vectors)
    got = _forward(monkeypatch, 0, y, r, vectors, opts, False, True)
    assert not pairs and got[0][:, 3].isnan().all()
    _same(got, _forward(monkeypatch, OFF, y, r, vectors, opts, False, True), "nan weight")


@pytest.mark.parametrize("rms2", [True, False], ids=["rms2", "layernorm2"])
def test_the_chain_writes_every_nan_of_h_as_0x7fc0(monkeypatch, pairs, rms2):
    """norm_add_norm's norm-add pass keeps NaNs as they come (bf16_words.pack_raw): inf * 0 (a row with an inf,
    rstd 0) gives x86's negative NaN, 0xFFC0 as bf16, which the fix-up after h's statistics makes 0x7FC0, as every
    other path writes; rows without NaN are untouched."""
    g = torch.Generator().manual_seed(7)
    y, r = _rows(4, 64, "contiguous", g), _rows(4, 64, "contiguous", g)
    y[1, 3] = float("inf")  # rstd1 0: N1(y) = inf * 0 = NaN at [1, 3], 0 elsewhere
    r[2, 5] = float("nan")
    vectors = _vectors(64, g, "w", True, rms2)
    opts = _opts(True, rms2, False, False, vectors)
    got = _forward(monkeypatch, 0, y, r, vectors, opts, True, True)
    assert pairs
    h = got[0]
    nan = h.isnan()
    assert nan.sum() == 2 and nan[1, 3] and nan[2, 5]
    assert (_bits(h)[nan] == 0x7FC0).all()
    assert got[2][3, 1].isnan() and got[2][3, 2].isnan() and not got[2][3, [0, 3]].isnan().any()
    _same(got, _forward(monkeypatch, OFF, y, r, vectors, opts, True, True), "nan in h")


def _n2_rows(n, g, layernorm2):
    """Rows for N2's pass without the NaN selects (bf16_pairs._fwd_row's canon2): ordinary rows, and rows where a
    NaN arises or stays: NaN in y and in r (h NaN), inf in y (rstd1 0: inf * 0), inf in r (h inf: rstd2 0, inf * 0
    in N2), a row ~1e30 (h's statistics rescaled by the guard), and a value whose N2 value is 0 at column 2 (RMSNorm:
    h 0 there; LayerNorm: a constant row). Column n - 2 holds a large value (N2 value ~3 or more)."""
    y = (torch.randn(8, n, generator=g) * 2).to(torch.bfloat16)
    r = (torch.randn(8, n, generator=g) * 2).to(torch.bfloat16)
    r[:, n - 2] = 24
    y[0, n // 2] = float("nan")
    r[1, 0] = float("nan")
    y[2, 1] = float("inf")
    r[3, 1] = float("inf")
    r[4] = (torch.randn(n, generator=g) * 1e30).to(torch.bfloat16)
    if layernorm2:
        y[5], r[5] = 0, 1  # h = 1 everywhere (N1(0) = 0): h - mean2 = 0
    else:
        y[5, 2], r[5, 2] = 0, 0  # h[5, 2] = 0 + N1(0) * w1 = 0
    return y, r


@pytest.mark.parametrize("layout", ["contiguous", "strided", "offset"])
@pytest.mark.parametrize("n", [64, 33])
@pytest.mark.parametrize("rms2", [True, False], ids=["rms2", "layernorm2"])
@pytest.mark.parametrize("vector2", ["finite", "inf w2", "-inf b2"])
def test_n2s_pass_without_the_nan_selects_gives_the_general_bits(monkeypatch, pairs, layout, n, rms2, vector2):
    """N2's pass stores without the NaN selects only for ordinary rows with finite N2 weights and biases: the rows
    where a NaN arises (inf * 0 gives x86's negative NaN, 0xFFC0 as bf16) still store it as 0x7FC0, the general
    kernels' bits; an inf weight times a 0 value, and a -inf bias plus a finite weight's overflow to inf, make a
    NaN in an ordinary row, so a call with either keeps the selects."""
    if vector2 == "-inf b2" and rms2:
        pytest.skip("(RMSNorm has no bias here)")
    g = torch.Generator().manual_seed(8)
    y, r = _n2_rows(n, g, not rms2)
    vectors = list(_vectors(n, g, "w" if rms2 else "w+b", True, rms2))
    if vector2 == "inf w2":
        vectors[2][2] = float("inf")
    elif vector2 == "-inf b2":
        vectors[2][n - 2], vectors[3][n - 2] = 3e38, float("-inf")
    for cbw, in_place in itertools.product([False, True], [False, True]):
        opts = _opts(True, rms2, False, cbw, vectors)
        want = _forward(monkeypatch, OFF, y, r, vectors, opts, True, in_place, layout)
        launches = len(pairs)
        got = _forward(monkeypatch, 0, y, r, vectors, opts, True, in_place, layout)
        assert len(pairs) == launches + 1
        _same(got, want, (vector2, cbw, in_place))
        out2, stats = got[1], got[2]
        nan = out2.isnan()
        assert (_bits(out2)[nan] == 0x7FC0).all()
        assert nan[0].all() and nan[1].all() and nan[3, 1]  # (the inputs did their job: NaN rows, inf * 0)
        assert 0 < stats[3, 4] < 2**-50  # the ~1e30 row: rescaled (rstd2 beyond the guard's range)
        if vector2 == "inf w2":
            assert nan[5, 2] and not nan[6:].any()  # 0 * inf, in an ordinary row
        elif vector2 == "-inf b2":
            assert nan[6:, n - 2].all()  # (~3 * 3e38 = inf) + -inf
        else:
            assert not nan[4:].any()


def test_each_call_kind_compiles_its_own_driver(monkeypatch, pairs):
    # the flags are constants of a kind's driver, compiled on its first call: one compile no longer holds every
    # kind's loops (14 minutes before a first large bf16 call returned)
    g = torch.Generator().manual_seed(5)
    y, r = _rows(3, 70, "contiguous", g), _rows(3, 70, "contiguous", g)
    vectors = _vectors(70, g, "w", True, True)
    before = dict(P._DRIVERS)
    for has_norm2, in_place in [(False, True), (True, True), (True, True), (True, False)]:  # the second kind twice
        _forward(monkeypatch, 0, y, r, vectors, _opts(True, True, False, False, vectors), has_norm2, in_place)
    assert pairs == ["fwd_serial"] * 4
    new = [k for k, d in P._DRIVERS.items() if before.get(k) is not d]
    assert len(new) <= 3 and all(not parallel for _, _, parallel in new)
    assert all(len(d.signatures) == 1 for d in P._DRIVERS.values())  # one kind, one compile
    assert len({id(d) for d in P._DRIVERS.values()}) == len(P._DRIVERS)
    for has_norm2, in_place in [(False, True), (True, True), (True, False)]:
        assert (P._kind((True, True, False, False, has_norm2, True, True, False, False)), in_place, False) in P._DRIVERS
    # without N2 its flags are not read: one driver whatever they are
    assert P._kind((1, 1, 0, 0, 0, 1, 1, 1, 1)) == P._kind((1, 1, 0, 0, 0, 0, 0, 0, 0)) == (True, True) + (False,) * 7
    assert P._kind((1, 1, 0, 0, 1, 1, 1, 0, 0)) == (True, True, False, False, True, True, True, False, False)


_CACHED_KIND = """
import sys
import torch
from addnorm.ops.cpu import bf16_pairs as P
from addnorm.ops.cpu import norm_add_launch as L
P.MIN_ELEMENTS = 0
y, r = torch.randn(3, 40).bfloat16(), torch.randn(3, 40).bfloat16()
opts = dict(eps1=1e-6, eps2=1e-6, is_rms1=True, is_rms2=True, zc1=False, zc2=False, cast1=False, cast2=False)
for kind in sys.argv[1:]:  # "rms": RMSNorm, "ln": LayerNorm, in place without weights
    L.forward_into(r, None, torch.zeros(4, 3), y, r, None, None, None, None, has_norm2=False,
                   **dict(opts, is_rms1=kind == "rms"))
    d = P._driver(P._kind((kind == "rms",) + (False,) * 8), True, False)
    print(kind, sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()))
"""


def test_a_kinds_driver_is_read_back_from_numbas_cache(tmp_path):
    # a driver is a closure over its flags, and numba's cache keys closures on their values: a later process reads
    # each kind back rather than compiling it again, and never another kind's code (numba would then run RMSNorm's
    # loops for a LayerNorm call: wrong bits that no test within one process would see)
    import os
    import subprocess
    import sys

    def run(*kinds):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
        done = subprocess.run([sys.executable, "-c", _CACHED_KIND, *kinds], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.split("\n")[:-1]

    assert run("rms") == ["rms 0 1"]  # compiled into the empty cache
    assert run("ln", "rms") == ["ln 0 1", "rms 1 0"]  # the other kind compiled, the first read back
