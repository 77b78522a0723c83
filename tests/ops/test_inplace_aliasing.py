"""Aliasing in the in-place ops by byte range (issue 26 item 4): views of one buffer whose bytes are disjoint (a
serving workspace: ``add_rms_norm_(buf[0], buf[1], w)``) are accepted and give the oracle's result on every backend;
overlapping byte ranges are refused before anything is written, and so are views whose elements interleave within
overlapping ranges (the check compares ranges: conservative, and the message says so). The quantized forms and
their ``out=`` follow the same rule."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops import backends
from addnorm.ops.contract import byte_span
from addnorm.reference import add_norm_ref

ALL = ["auto", "torch", "reference", "cpu", "triton"]


def _skip_unavailable(backend):
    if backend != "auto" and (reason := backends.unavailable_reason(backend, torch.device("cpu"))) is not None:
        pytest.skip(reason)


def _call(is_rms, x, r, w, b, backend):
    if is_rms:
        return addnorm.add_rms_norm_(x, r, w, 1e-6, backend=backend)
    return addnorm.add_layer_norm_(x, r, w, b, 1e-5, backend=backend)


def _workspaces(dtype):
    """(name, buffer, x view, residual view): disjoint byte ranges of one buffer."""
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, 5, 48, generator=g).to(dtype)
    yield "buf[0], buf[1]", buf, buf[0], buf[1]
    yield "buf[1], buf[0]", buf, buf[1], buf[0]  # residual before x in memory
    flat = torch.randn(3 * 5 * 48, generator=g).to(dtype)
    yield "offset views, a gap between", flat, flat[:240].view(5, 48), flat[480:].view(5, 48)
    yield "adjacent, last byte meets first", flat, flat[240:480].view(5, 48), flat[480:].view(5, 48)
    rows = torch.randn(10, 48, generator=g).to(dtype)
    yield "strided rows, disjoint ranges", rows, rows[0:5:2], rows[6:9]  # rows 0, 2, 4 and 6..8


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_disjoint_views_of_one_buffer_are_accepted_and_give_the_oracle(backend, is_rms, dtype):
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(1)
    w = (1 + 0.3 * torch.randn(48, generator=g)).to(dtype)
    b = (0.2 * torch.randn(48, generator=g)).to(dtype)
    for name, buf, x, r in _workspaces(dtype):
        want_out, want_res, _, _ = add_norm_ref(
            x.clone(), r.clone(), w, None if is_rms else b, eps=1e-6 if is_rms else 1e-5, is_rms=is_rms
        )
        outside = torch.ones_like(buf, dtype=torch.bool)  # the buffer's other bytes must be left alone
        for t in (x, r):  # (every buffer here is contiguous from offset 0: t's strides index it as they index buf)
            outside.view(-1).as_strided(t.shape, t.stride(), t.storage_offset()).fill_(False)
        before = buf.clone()
        xo, ro = _call(is_rms, x, r, w, b, backend)
        assert xo is x and ro is r, name
        torch.testing.assert_close(r, want_res, rtol=0, atol=0, msg=name)  # the sum is rounded once: exact
        torch.testing.assert_close(x, want_out, msg=name)
        assert torch.equal(buf[outside], before[outside]), f"{name}: bytes outside x and residual were written"


def _overlapping(dtype=torch.float32):
    """(name, x, residual, what the message shows) of views whose byte ranges intersect."""
    buf = torch.randn(2, 4, 64).to(dtype)
    flat = torch.randn(512).to(dtype)
    e = torch.finfo(dtype).bits // 8
    yield "partial overlap", buf[0, :3], buf[0, 1:], f"x spans bytes [0, {192 * e}) and residual [{64 * e}, {256 * e})"
    yield "offset views", flat[:256].view(4, 64), flat[128:384].view(4, 64), f"[{128 * e}, {384 * e})"
    yield "a strided view across x", flat[:256].view(4, 64), flat.view(4, 128)[:, 32:96], "[128, 1920)"
    yield "another view object of x's memory", buf[0], buf[0].view(4, 64), "[0, 1024) and residual [0, 1024)"
    # elements interleave (even and odd columns), ranges overlap: refused conservatively, and the message says so
    yield "interleaved columns", buf[1][:, 0::2], buf[1][:, 1::2], "compares ranges, not elements"


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_overlapping_byte_ranges_are_refused_before_anything_is_written(backend, is_rms):
    _skip_unavailable(backend)
    for name, x, r, shown in _overlapping():
        n = x.shape[-1]
        w, b = torch.ones(n), torch.zeros(n)
        storage = x.untyped_storage()
        before = torch.tensor([], dtype=torch.uint8).set_(storage).clone()
        with pytest.raises(ValueError, match="x and residual must not overlap in memory") as e:
            _call(is_rms, x, r, w, b, backend)
        assert shown in str(e.value), f"{name}: {e.value}"
        assert torch.equal(torch.tensor([], dtype=torch.uint8).set_(storage), before), name


def test_the_same_tensor_twice_is_still_refused_with_its_message():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="x and residual must not share memory"):
        addnorm.add_rms_norm_(x, x, torch.ones(16))


def test_byte_span_covers_first_to_last_element_of_a_strided_view():
    buf = torch.zeros(6, 10)  # fp32
    base = buf.data_ptr()
    assert [s - base for s in byte_span(buf)] == [0, 240]
    assert [s - base for s in byte_span(buf[1:3, 2:5])] == [48, 100]  # (1,2) .. (2,4): bytes 48 .. 100
    assert [s - base for s in byte_span(buf[:, 3])] == [12, 216]  # a column: every row's gap included
    assert [s - base for s in byte_span(buf[0].expand(3, 10))] == [0, 40]  # stride 0: one row of bytes


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_quantized_in_place_and_out_follow_the_byte_range_rule(backend):
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, generator=g)
    buf = torch.randn(2, 4, 64, generator=g)
    x, r = buf[0], buf[1]
    want = addnorm.add_rms_norm_quant(x.clone(), r.clone(), w, quant_dtype=torch.int8, backend=backend)
    q, res, s = addnorm.add_rms_norm_quant_(x, r, w, quant_dtype=torch.int8, backend=backend)  # disjoint: fine
    assert res is r and torch.equal(q, want[0]) and torch.equal(r, want[1]) and torch.equal(s, want[2])
    with pytest.raises(ValueError, match="x and residual must not overlap in memory"):
        addnorm.add_rms_norm_quant_(buf[0, :3], buf[0, 1:], w, quant_dtype=torch.int8, backend=backend)
    # out= in a byte workspace that also holds x: refused where q would land on x's bytes, accepted beside them
    ws = torch.zeros(1024 + 256, dtype=torch.uint8)
    xs = ws[:1024].view(torch.float32).view(4, 64)
    xs.copy_(want[1])  # any values
    r2 = torch.randn(4, 64, generator=g)
    with pytest.raises(ValueError, match=r"out and x must not overlap in memory \(q is written while x is read\)"):
        addnorm.add_rms_norm_quant(xs, r2, w, quant_dtype=torch.int8, out=ws[512:768].view(torch.int8).view(4, 64))
    with pytest.raises(ValueError, match="out and residual must not overlap in memory"):
        addnorm.add_rms_norm_quant(r2, xs, w, quant_dtype=torch.int8, out=ws[:256].view(torch.int8).view(4, 64))
    out = ws[1024:].view(torch.int8).view(4, 64)
    expected = addnorm.add_rms_norm_quant(xs.clone(), r2, w, quant_dtype=torch.int8, backend=backend)[0]
    q, _, _ = addnorm.add_rms_norm_quant(xs, r2, w, quant_dtype=torch.int8, out=out, backend=backend)
    assert q is out and torch.equal(out, expected)


@pytest.mark.parametrize("op", ["add_rms_norm_", "add_layer_norm_", "norm_add_", "norm_add_norm_"])
def test_the_decode_fast_path_serves_disjoint_views_and_leaves_overlap_to_the_general_path(op, monkeypatch):
    """The fast paths judge aliasing by byte range too (not by storage): disjoint views of one buffer take the
    raw-address launch with the general path's bits; overlapping ones never launch and meet the general path's
    refusal, nothing written."""
    import importlib

    from addnorm.ops.cpu import fast_launch, norm_add_fast_launch

    _skip_unavailable("cpu")
    na = importlib.import_module("addnorm.ops.norm_add")
    ani = importlib.import_module("addnorm.ops.add_norm_inplace")
    seen = []
    for mod in (fast_launch, norm_add_fast_launch):
        monkeypatch.setattr(mod, "forward_ptr", lambda *a, _real=mod.forward_ptr: seen.append(1) or _real(*a))
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    calls = {
        "add_rms_norm_": lambda x, r: addnorm.add_rms_norm_(x, r, w, 1e-6, backend="cpu"),
        "add_layer_norm_": lambda x, r: addnorm.add_layer_norm_(x, r, w, b, 1e-5, backend="cpu"),
        "norm_add_": lambda x, r: addnorm.norm_add_(x, r, w, backend="cpu"),
        "norm_add_norm_": lambda x, r: addnorm.norm_add_norm_(x, r, w, w, backend="cpu"),
    }
    call = calls[op]
    buf = torch.randn(2, 3, 48, generator=g)
    want = buf.clone()
    with monkeypatch.context() as m:  # the general path's bits: the fast paths switched off
        m.setattr(ani, "try_add_norm_", lambda *a: False)
        m.setattr(na, "try_norm_add_", lambda *a: False)
        call(want[0], want[1])
    seen.clear()
    with torch.no_grad():
        call(buf[0], buf[1])
    assert seen == [1]
    assert torch.equal(buf, want)
    flat = torch.randn(4 * 48, generator=g)
    before = flat.clone()
    seen.clear()
    with torch.no_grad(), pytest.raises(ValueError, match="must not overlap in memory"):
        call(flat[:144].view(3, 48), flat[48:].view(3, 48))  # one row in common
    assert seen == [] and torch.equal(flat, before)
