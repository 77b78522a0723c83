"""The fast path of :mod:`addnorm.ops.fast_path` at decode sizes: the calls it takes give the general path's
bits, the calls it must not take reach the general path, and every bad argument meets the general path's error.

"The general path" is the same call with the fast path switched off (``try_add_norm`` answering None), so each
comparison is between the two routes of one build: the cpu backend's decode launch (raw addresses into the serial
kernel) against its general launch (numpy views, the weight converted to fp32), and the torch backend's eager ops
against its statistics-dtype composition.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import addnorm
from addnorm.nn import LayerNorm, RMSNorm
from addnorm.ops import add_norm as A
from addnorm.ops import add_norm_inplace as AI
from addnorm.ops import fast_path as D
from addnorm.ops import torch_backend as TB
from addnorm.ops.contract import AddNormSpec
from addnorm.ops.cpu import fast_launch

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    r = (2 * torch.randn(shape, generator=g)).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    b = (0.3 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, r, w, b


@pytest.fixture
def launches(monkeypatch):
    """Counts the decode launches (cpu) and the torch backend's one-dtype calls made through the fast path."""
    seen = {"cpu": 0, "torch": 0}
    real_ptr, real_torch = fast_launch.forward_ptr, D.rms_norm_one_dtype

    def ptr(*args):
        seen["cpu"] += 1
        return real_ptr(*args)

    def one_dtype(*args):
        seen["torch"] += 1
        return real_torch(*args)

    monkeypatch.setattr(fast_launch, "forward_ptr", ptr)
    monkeypatch.setattr(D, "rms_norm_one_dtype", one_dtype)
    return seen


def _general(monkeypatch, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the fast path switched off: what the general path returns (or raises)."""
    with monkeypatch.context() as m:
        m.setattr(A, "try_add_norm", lambda *args: None)
        m.setattr(AI, "try_add_norm_", lambda *args: False)
        return fn(*args, **kwargs)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.numel():  # bit for bit (NaN included)
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    assert torch.equal(a, b)


def _cases(x, r, w, b):
    """(name, is_rms, residual, weight, bias, cast) over what a decode call can be."""
    for is_rms, cast, res, weight, bias in itertools.product(
        (True, False), (False, True), (r, None), (w, None), (b, None)
    ):
        if is_rms and bias is not None:
            continue
        yield is_rms, res, weight, bias, cast


def _call(x, res, weight, bias, is_rms, cast, backend, eps=1e-6, zc=False):
    kw = dict(cast_before_weight=cast, zero_centered_weight=zc, backend=backend)
    if is_rms:
        return addnorm.add_rms_norm(x, res, weight, eps, **kw)
    return addnorm.add_layer_norm(x, res, weight, bias, eps, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [0, 1, 3, 8])
@pytest.mark.parametrize("n", [1, 7, 4096])
def test_cpu_decode_launch_is_bitwise_the_general_launch(monkeypatch, launches, dtype, m, n):
    x, r, w, b = _inputs((m, n), dtype)
    taken = 0
    for is_rms, res, weight, bias, cast in _cases(x, r, w, b):
        with torch.inference_mode():
            got = _call(x, res, weight, bias, is_rms, cast, "cpu")
            want = _general(monkeypatch, _call, x, res, weight, bias, is_rms, cast, "cpu")
        _same(got[0], want[0])
        _same(got[1], want[1])
        if res is None:
            assert got[1] is x  # nothing added, nothing rounded: residual_out is x, as on the general path
        taken += 1
    assert launches["cpu"] == (taken if m else 0)  # M = 0: the general path (nothing to launch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (3, 7), (1, 1), (2, 3, 33)], ids=str)
def test_cpu_decode_launch_in_place_is_bitwise_the_general_launch(monkeypatch, launches, dtype, shape):
    x, r, w, b = _inputs(shape, dtype)
    taken = 0
    for is_rms, _, weight, bias, cast in _cases(x, r, w, b):
        fn = addnorm.add_rms_norm_ if is_rms else addnorm.add_layer_norm_
        extra = () if is_rms else (bias,)
        got, want = (x.clone(), r.clone()), (x.clone(), r.clone())
        with torch.inference_mode():
            fn(*got, weight, *extra, 1e-5, cast_before_weight=cast, backend="cpu")
            _general(monkeypatch, fn, *want, weight, *extra, 1e-5, cast_before_weight=cast, backend="cpu")
            out = _call(x, r, weight, bias, is_rms, cast, "cpu", eps=1e-5)  # the out-of-place call's bits too
        _same(got[0], want[0])
        _same(got[1], want[1])
        _same(got[0], out[0])
        _same(got[1], out[1])
        taken += 2
    assert launches["cpu"] == taken


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n", [7, 4095])
def test_cpu_decode_launch_serves_zero_centered_weights_with_the_general_bits(monkeypatch, launches, dtype, m, n):
    """Gemma's x * (1 + w): the decode launch computes 1 + w in fp32 itself; out of place and in place, RMSNorm
    and LayerNorm, with and without the residual, bias and cast, its bits are the general launch's."""
    x, r, w, b = _inputs((m, n), dtype)
    w = w - 1  # a zero-centered weight is stored as w - 1: values around 0, where 1 + w rounds in fp32
    taken = 0
    for is_rms, res, weight, bias, cast in _cases(x, r, w, b):
        with torch.inference_mode():
            got = _call(x, res, weight, bias, is_rms, cast, "cpu", zc=True)
            want = _general(monkeypatch, _call, x, res, weight, bias, is_rms, cast, "cpu", zc=True)
            plain = _call(x, res, weight, bias, is_rms, cast, "cpu")
        _same(got[0], want[0])
        _same(got[1], want[1])
        if weight is not None:  # (the flag reached the kernel: 1 + w is not w)
            assert not torch.equal(got[0], plain[0])
        if res is not None:  # in place: the out-of-place call's bits
            fn = addnorm.add_rms_norm_ if is_rms else addnorm.add_layer_norm_
            xi, ri = x.clone(), r.clone()
            with torch.inference_mode():
                fn(xi, ri, weight, *(() if is_rms else (bias,)), 1e-6, cast_before_weight=cast,
                   zero_centered_weight=True, backend="cpu")  # fmt: skip
            _same(xi, want[0])
            _same(ri, want[1])
            taken += 1
        taken += 2  # (the zero-centered call and the plain one)
    assert launches["cpu"] == taken


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (3, 7), (0, 5)], ids=str)
def test_torch_backend_decode_path_is_bitwise_the_general_path(launches, dtype, shape):
    x, r, w, _ = _inputs(shape, dtype)
    for cast, res, weight in itertools.product((False, True), (r, None), (w, None)):
        with torch.inference_mode():
            got = addnorm.add_rms_norm(x, res, weight, 1e-6, cast_before_weight=cast, backend="torch")
            # the torch backend written out in the statistics dtype (run_add_norm drops the cast in fp32/fp64)
            cbw = cast and dtype not in (torch.float32, torch.float64)
            want = TB.add_norm_general(x, res, weight, None, AddNormSpec(1e-6, True, 0.0, dtype, False, cbw, dtype))
        _same(got[0], want[0])
        _same(got[1], want[1])
    assert launches["torch"] == (8 if shape[0] else 0)


def test_eps_none_is_the_machine_epsilon_of_the_dtype(monkeypatch, launches):
    for dtype in DTYPES:
        x, r, w, _ = _inputs((2, 64), dtype)
        with torch.inference_mode():
            got = addnorm.add_rms_norm(x, r, w, backend="cpu")
            want = _general(monkeypatch, addnorm.add_rms_norm, x, r, w, backend="cpu")
            explicit = addnorm.add_rms_norm(x, r, w, torch.finfo(dtype).eps, backend="cpu")
        _same(got[0], want[0])
        _same(got[0], explicit[0])
    assert launches["cpu"] == 2 * len(DTYPES)


def _declined(x, r, w, **kw):
    """Calls the fast path must leave to the general path: (description, call)."""
    wide = _inputs((80, 4096), x.dtype)  # above the parallel threshold: the threaded general launch
    strided_x = torch.cat([x, x], dim=1)[:, ::2]
    return [
        ("strided x", lambda: addnorm.add_rms_norm(strided_x, r, w, 1e-6, **kw)),
        ("row-strided residual", lambda: addnorm.add_rms_norm(x, torch.cat([r, r], 1)[:, :64], w, 1e-6, **kw)),
        ("fp32 residual stream", lambda: addnorm.add_rms_norm(x, r.float(), w, 1e-6, **kw)),
        ("fp32 weight", lambda: addnorm.add_rms_norm(x, r, w.float(), 1e-6, **kw)),
        ("residual_dtype", lambda: addnorm.add_rms_norm(x, r, w, 1e-6, residual_dtype=torch.float32, **kw)),
        ("out_dtype", lambda: addnorm.add_rms_norm(x, r, w, 1e-6, out_dtype=torch.float32, **kw)),
        ("dropout", lambda: addnorm.add_rms_norm(x, r, w, 1e-6, dropout_p=0.1, **kw)),
        ("parallel size", lambda: addnorm.add_rms_norm(*wide[:3], 1e-6, **kw)),
        ("fp64", lambda: addnorm.add_rms_norm(x.double(), r.double(), w.double(), 1e-6, **kw)),
        ("a parameter as x", lambda: addnorm.add_rms_norm(nn.Parameter(x, requires_grad=False), r, w, 1e-6, **kw)),
    ]


@pytest.mark.parametrize("zc", [False, True], ids=["plain", "zero-centered"])
def test_cpu_decode_launch_declines_what_it_does_not_serve(monkeypatch, launches, zc):
    x, r, w, _ = _inputs((4, 64), torch.bfloat16)
    for name, call in _declined(x, r, w, backend="cpu", zero_centered_weight=zc):
        with torch.inference_mode():
            got = call()
            want = _general(monkeypatch, call)
        assert launches["cpu"] == 0, name
        if name != "dropout":  # (a fresh seed each call)
            _same(got[0], want[0])
            _same(got[1], want[1])
    # something to differentiate: the autograd route, which keeps the statistics
    out, _ = addnorm.add_rms_norm(x, r, w.clone().requires_grad_(), 1e-6, zero_centered_weight=zc, backend="cpu")
    assert out.requires_grad and launches["cpu"] == 0
    with torch.no_grad():  # nothing recorded: the decode launch
        addnorm.add_rms_norm(x, r, w.clone().requires_grad_(), 1e-6, zero_centered_weight=zc, backend="cpu")
    assert launches["cpu"] == 1


def test_in_place_decode_launch_declines_non_contiguous_tensors(monkeypatch, launches):
    x, r, w, _ = _inputs((4, 64), torch.bfloat16)
    xs, rs = torch.cat([x, x], 1)[:, ::2], r.clone()
    want = _general(monkeypatch, lambda: addnorm.add_rms_norm(xs, rs, w, 1e-6, backend="cpu"))
    with torch.inference_mode():
        addnorm.add_rms_norm_(xs, rs, w, 1e-6, backend="cpu")
    assert launches["cpu"] == 0
    _same(xs, want[0])
    _same(rs, want[1])


def _bad_calls():
    """(description, call) of bad arguments: each must raise what the general path raises."""
    x, r, w, b = _inputs((2, 16), torch.bfloat16)
    return [
        ("residual shape", lambda: addnorm.add_rms_norm(x, r[:1], w, backend="cpu")),
        ("residual int", lambda: addnorm.add_rms_norm(x, r.int(), w, backend="cpu")),
        ("residual not a tensor", lambda: addnorm.add_rms_norm(x, 1.0, w, backend="cpu")),
        ("weight shape", lambda: addnorm.add_rms_norm(x, r, w[:15], backend="cpu")),
        ("weight 2-D", lambda: addnorm.add_rms_norm(x, r, w.view(1, 16), backend="cpu")),
        ("weight meta", lambda: addnorm.add_rms_norm(x, r, w.to("meta"), backend="cpu")),
        ("weight int", lambda: addnorm.add_rms_norm(x, r, w.int(), backend="cpu")),
        ("bias shape", lambda: addnorm.add_layer_norm(x, r, w, b[:3], backend="cpu")),
        ("eps nan", lambda: addnorm.add_rms_norm(x, r, w, float("nan"), backend="cpu")),
        ("eps inf", lambda: addnorm.add_layer_norm(x, r, w, b, float("inf"), backend="cpu")),
        ("eps negative", lambda: addnorm.add_rms_norm(x, r, w, -1e-6, backend="cpu")),
        ("eps str", lambda: addnorm.add_rms_norm(x, r, w, "1e-6", backend="cpu")),
        ("eps None for LayerNorm", lambda: addnorm.add_layer_norm(x, r, w, b, None, backend="cpu")),
        ("dropout_p None", lambda: addnorm.add_rms_norm(x, r, w, dropout_p=None, backend="cpu")),
        ("dropout_p 1", lambda: addnorm.add_rms_norm(x, r, w, dropout_p=1, backend="cpu")),
        ("backend", lambda: addnorm.add_rms_norm(x, r, w, backend="gpu")),
        ("backend not a string", lambda: addnorm.add_rms_norm(x, r, w, backend=None)),
        ("backend unhashable", lambda: addnorm.add_rms_norm(x, r, w, backend=["cpu"])),
        ("in place: backend unhashable", lambda: addnorm.add_rms_norm_(x.clone(), r.clone(), w, backend=["cpu"])),
        ("x int", lambda: addnorm.add_rms_norm(x.int(), r.int(), None, backend="cpu")),
        ("x 0-dim", lambda: addnorm.add_rms_norm(x[0, 0], r[0, 0], None, backend="cpu")),
        ("x empty last dim", lambda: addnorm.add_rms_norm(x[:, :0], r[:, :0], None, backend="cpu")),
        ("out_dtype int", lambda: addnorm.add_rms_norm(x, r, w, out_dtype=torch.int32, backend="cpu")),
        ("residual_dtype int", lambda: addnorm.add_rms_norm(x, r, w, residual_dtype=torch.int32, backend="cpu")),
        ("in place: no residual", lambda: addnorm.add_rms_norm_(x.clone(), None, w, backend="cpu")),
        ("in place: aliased", lambda: (lambda t: addnorm.add_rms_norm_(t, t, w, backend="cpu"))(x.clone())),
        # (disjoint slices of one buffer are accepted since issue 26 item 4: these two overlap in bytes)
        (
            "in place: overlapping",
            lambda: (lambda t: addnorm.add_rms_norm_(t[:, :8], t[:, 4:12], w[:8], backend="cpu"))(x.clone()),
        ),
        ("in place: expanded", lambda: addnorm.add_rms_norm_(x.clone(), r[:1].expand(2, 16), w, backend="cpu")),
        ("in place: weight shape", lambda: addnorm.add_layer_norm_(x.clone(), r.clone(), w[:4], b, backend="cpu")),
        ("in place: eps nan", lambda: addnorm.add_rms_norm_(x.clone(), r.clone(), w, float("nan"), backend="cpu")),
    ]


def _error(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the exception itself is what is compared
        return type(e), str(e)
    return None


@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_bad_input_meets_the_general_paths_error(monkeypatch, launches, mode):
    ctx = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    for name, call in _bad_calls():
        with ctx():
            got = _error(call)
            want = _general(monkeypatch, _error, call)
        assert want is not None, name  # (the case is a bad call)
        assert got == want, name
    assert launches["cpu"] == 0


def test_in_place_refusals_are_the_general_paths():
    x, r, w, _ = _inputs((2, 16), torch.bfloat16)
    xg = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="^x requires grad"):
        addnorm.add_rms_norm_(xg, r.clone(), w, backend="cpu")
    with pytest.raises(RuntimeError, match="^weight requires grad and grad mode is on"):
        addnorm.add_rms_norm_(x.clone(), r.clone(), w.clone().requires_grad_(), backend="cpu")
    xi, ri = x.clone(), r.clone()
    with torch.no_grad():  # grad mode off: a weight that requires grad is only read
        addnorm.add_rms_norm_(xi, ri, w.clone().requires_grad_(), backend="cpu")
    _same(xi, addnorm.add_rms_norm(x, r, w, backend="cpu")[0])


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_module_weight_changed_after_the_first_call(monkeypatch, launches, cls, backend):
    """Nothing about the weight is remembered between calls: a weight converted, resized, moved or replaced after
    the first call is checked again (an error naming it), and one changed in value or dtype is used as it is now."""
    n = 64
    norm = cls(n, eps=1e-5, dtype=torch.bfloat16, backend=backend).requires_grad_(False)
    x, r, _, _ = _inputs((3, n), torch.bfloat16)
    fn = addnorm.add_layer_norm if cls is LayerNorm else addnorm.add_rms_norm

    def expect():
        params = (norm.weight, norm.bias) if cls is LayerNorm else (norm.weight,)
        return _general(monkeypatch, lambda: fn(x, r, *params, norm.eps, backend=backend))

    with torch.inference_mode():
        first = norm(x, r)
        _same(first[0], expect()[0])
        norm.weight.mul_(1.5)  # changed in place: read afresh
        second = norm(x, r)
        _same(second[0], expect()[0])
        assert not torch.equal(first[0], second[0])
        norm.weight = nn.Parameter(torch.linspace(0.5, 2, n, dtype=torch.bfloat16), requires_grad=False)
        _same(norm(x, r)[0], expect()[0])
        norm.weight.data = norm.weight.data.float()  # another dtype: the general path, its value
        _same(norm(x, r)[0], expect()[0])
        norm.weight.data = torch.ones(n, dtype=torch.int32)
        with pytest.raises(TypeError, match="^weight must be float16"):
            norm(x, r)
        norm.weight.data = torch.ones(n - 1, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=rf"^weight must have shape \({n},\)"):
            norm(x, r)
        norm.weight = nn.Parameter(torch.ones(n, dtype=torch.bfloat16, device="meta"))
        with pytest.raises(ValueError, match="^weight must be on x's device cpu"):
            norm(x, r)
        norm.weight = nn.Parameter(torch.ones(n, dtype=torch.bfloat16), requires_grad=False)
        norm.eps = float("nan")
        with pytest.raises(ValueError, match="^eps must be a finite number"):
            norm(x, r)
    expected = {"cpu": 3, "torch": 3 if cls is RMSNorm else 0}[backend]
    assert launches[backend] == expected


def test_the_backend_is_resolved_again_when_the_override_changes(monkeypatch, launches):
    x, r, w, _ = _inputs((2, 64), torch.bfloat16)
    with torch.inference_mode():
        addnorm.add_rms_norm(x, r, w, backend="auto")
        monkeypatch.setenv("ADDNORM_BACKEND", "cpu")
        addnorm.add_rms_norm(x, r, w, backend="auto")
        assert launches["cpu"] >= 1
        monkeypatch.setenv("ADDNORM_BACKEND", "nope")
        with pytest.raises(ValueError, match="ADDNORM_BACKEND must be one of"):
            addnorm.add_rms_norm(x, r, w, backend="auto")


def test_sparse_input_is_left_to_the_general_path(monkeypatch, launches):
    x, r, w, _ = _inputs((2, 16), torch.float32)
    for backend in ("cpu", "torch"):
        with torch.inference_mode():
            got = _error(lambda backend=backend: addnorm.add_rms_norm(x.to_sparse(), r, w, backend=backend))
            want = _general(
                monkeypatch, _error, lambda backend=backend: addnorm.add_rms_norm(x.to_sparse(), r, w, backend=backend)
            )
        assert got == want
    assert launches == {"cpu": 0, "torch": 0}
