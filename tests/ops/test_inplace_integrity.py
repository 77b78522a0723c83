"""The in-place ops keep PyTorch's integrity rules on every backend: a written tensor's autograd version counter is
bumped once (a tensor saved for another op's backward and overwritten gets PyTorch's "modified by an inplace
operation" error, not a silently wrong gradient), an inference tensor is not written outside inference mode, a
weight or bias in written memory is refused, and every refusal comes before anything is written. Also the scalar
checks: a bool is no eps or dropout_p, and the per-norm flags are bools."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops import backends

BACKENDS = ["torch", "reference", "cpu", "triton"]  # triton: on CPU tensors in Triton's interpreter without a GPU
N = 32


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# every in-place op as (name, call(x, r, w, b, backend), which of (x, r) it writes)
OPS = {
    "add_rms_norm_": (lambda x, r, w, b, bk: addnorm.add_rms_norm_(x, r, w, backend=bk), (True, True)),
    "add_layer_norm_": (lambda x, r, w, b, bk: addnorm.add_layer_norm_(x, r, w, b, backend=bk), (True, True)),
    "norm_add_": (lambda x, r, w, b, bk: addnorm.norm_add_(x, r, w, b, norm="layer", backend=bk), (False, True)),
    "norm_add_norm_": (lambda x, r, w, b, bk: addnorm.norm_add_norm_(x, r, w, w, backend=bk), (True, True)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_each_written_tensor_gets_one_version_bump(backend, op, dtype):
    _skip_unavailable(backend)
    if dtype is torch.float16 and backend in ("cpu",):
        pytest.skip("fp16 numba kernels compile for minutes on first use: fp32 covers the cpu backend's launch")
    call, writes = OPS[op]
    x, r, w, b = _t(4, N, dtype=dtype), _t(4, N, dtype=dtype), _t(N, dtype=dtype), _t(N, dtype=dtype)
    before = x._version, r._version
    call(x, r, w, b, backend)
    assert (x._version - before[0], r._version - before[1]) == tuple(int(v) for v in writes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("saved", ["x", "residual"])
def test_a_tensor_saved_for_backward_then_overwritten_raises_pytorchs_error(backend, op, saved):
    _skip_unavailable(backend)
    call, writes = OPS[op]
    if saved == "x" and not writes[0]:
        pytest.skip("the op only reads its first argument")
    x, r, w, b = _t(4, N), _t(4, N), _t(N), _t(N)
    a = torch.randn(4, N, requires_grad=True)
    loss = (a * (x if saved == "x" else r)).sum()  # mul saves the other operand for a's gradient
    with torch.no_grad():
        call(x, r, w, b, backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("which", ["x", "residual"])
def test_an_inference_tensor_outside_inference_mode_is_refused_before_anything_is_written(backend, op, which):
    _skip_unavailable(backend)
    call, writes = OPS[op]
    if which == "x" and not writes[0]:
        pytest.skip("the op only reads its first argument: an inference tensor may be read")
    with torch.inference_mode():
        inf = _t(4, N)
    x, r = (inf, _t(4, N)) if which == "x" else (_t(4, N), inf)
    w, b = _t(N), _t(N)
    before = x.clone(), r.clone()
    name = which if not op.startswith("norm_add") or which == "residual" else "y"
    with pytest.raises(RuntimeError, match=f"^{name} is an inference tensor .*{name}.clone"):
        call(x, r, w, b, backend)
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])
    # inside inference mode the same call runs
    with torch.inference_mode():
        call(x, r, w, b, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("param", ["weight", "bias"])
@pytest.mark.parametrize("where", ["x", "residual"])
def test_a_weight_or_bias_in_written_memory_is_refused(backend, op, param, where):
    _skip_unavailable(backend)
    call, writes = OPS[op]
    if param == "bias" and op in ("add_rms_norm_", "norm_add_norm_"):
        pytest.skip("RMSNorm takes no bias")
    if where == "x" and not writes[0]:
        pytest.skip("the op only reads its first argument")
    buf = _t(5, N)
    written, other = buf[:4], _t(4, N)
    x, r = (written, other) if where == "x" else (other, written)
    p = buf[3]
    w, b = (p, _t(N)) if param == "weight" else (_t(N), p)
    before = buf.clone(), other.clone()
    with pytest.raises(ValueError, match=f"{param}1? and .* must not overlap in memory"):
        call(x, r, w, b, backend)
    assert torch.equal(buf, before[0]) and torch.equal(other, before[1])
    # disjoint views of one buffer stay accepted
    buf2 = _t(9, N)
    x2, r2 = (buf2[:4], _t(4, N)) if where == "x" else (_t(4, N), buf2[:4])
    w2, b2 = (buf2[8], _t(N)) if param == "weight" else (_t(N), buf2[8])
    call(x2, r2, w2, b2, backend)


def _weight_in_written_memory(layout):
    """(the written (rows, N) tensor, a weight of N elements whose bytes reach into it, the buffer holding both)."""
    if layout == "last-row":  # contiguous rows: the fast paths' case
        buf = _t(4, N)
        return buf, buf[-1], buf
    if layout == "across-rows":  # a contiguous weight straddling two rows
        buf = _t(4, N)
        return buf, buf.view(-1)[5 : 5 + N], buf
    if layout == "strided-inside":
        buf = _t(4, N)
        return buf, buf.view(-1)[7::3][:N], buf
    if layout == "strided-before":  # starts before the written rows, its later elements inside them
        buf = _t(N + 1, N)
        return buf[1:5], buf[:N, 0], buf
    buf = _t(N, N)  # "transposed": a column of a transposed (N, N) residual (contiguous in memory)
    return buf.t(), buf.t()[:, 0], buf


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu"])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("where", ["x", "residual"])
@pytest.mark.parametrize("layout", ["last-row", "across-rows", "strided-inside", "strided-before", "transposed"])
def test_a_weight_anywhere_in_written_memory_is_refused_on_every_route(backend, op, where, layout):
    """Not only a weight over the written tensor's first row: one in its last row, across two rows, strided inside
    it, strided from before it (the torch backend's in-place fast route accepted that one: it compared one row's
    bytes from the weight's address), a column of a transposed layout. Contiguous rows take the fast paths, the
    transposed one the general path; each refuses before writing anything."""
    _skip_unavailable(backend)
    call, writes = OPS[op]
    if where == "x" and not writes[0]:
        pytest.skip("the op only reads its first argument")
    written, w, buf = _weight_in_written_memory(layout)
    other = _t(*written.shape)
    x, r = (written, other) if where == "x" else (other, written)
    before = buf.clone(), other.clone()
    with pytest.raises(ValueError, match="weight1? and .* must not overlap in memory"):
        call(x, r, w, _t(N), backend)
    assert torch.equal(buf, before[0]) and torch.equal(other, before[1])


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu"])
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_quant_inplace_refusals_and_version_bump(backend, is_rms):
    _skip_unavailable(backend)
    fn = addnorm.add_rms_norm_quant_ if is_rms else addnorm.add_layer_norm_quant_
    kw = dict(quant_dtype=torch.int8, backend=backend)

    def call(x, r, w, **extra):
        return fn(x, r, w, **kw, **extra) if is_rms else fn(x, r, w, None, **kw, **extra)

    x, r, w = _t(4, N), _t(4, N), _t(N)
    v = r._version
    call(x, r, w)
    assert r._version == v + 1
    out = torch.empty(4, N, dtype=torch.int8)
    vo = out._version
    call(x, r, w, out=out)
    assert out._version > vo
    # an expanded residual
    row = _t(1, N).expand(4, N)
    with pytest.raises(ValueError, match="^residual has elements that share memory"):
        call(x, row, w)
    # a weight inside the residual
    buf = _t(5, N)
    before = buf.clone()
    with pytest.raises(ValueError, match="weight and residual must not overlap in memory"):
        call(x, buf[:4], buf[3])
    assert torch.equal(buf, before)
    # an inference residual outside inference mode
    with torch.inference_mode():
        ri = _t(4, N)
    before = ri.clone()
    with pytest.raises(RuntimeError, match="^residual is an inference tensor"):
        call(x, ri, w)
    assert torch.equal(ri, before)


def test_the_custom_op_bumps_once_and_compiled_calls_bump_too():
    _skip_unavailable("cpu")
    x, r, w = _t(4, N), _t(4, N), _t(N)
    v = x._version, r._version
    torch.ops.addnorm.add_norm_(x, r, w, None, 1e-6, True, False, False, "cpu")  # its ADInplaceOrView bumps
    assert (x._version - v[0], r._version - v[1]) == (1, 1)
    f = torch.compile(lambda x, r, w: addnorm.add_rms_norm_(x, r, w, 1e-6, backend="cpu"), backend="aot_eager")
    v = x._version, r._version
    f(x, r, w)
    assert x._version > v[0] and r._version > v[1]


@pytest.mark.parametrize("value", [True, False])
def test_a_bool_is_no_eps_or_dropout_p(value):
    x, r = _t(2, N), _t(2, N)
    with pytest.raises(ValueError, match="^eps must be"):
        addnorm.add_rms_norm(x, r, None, value, backend="torch")
    with pytest.raises(ValueError, match="^eps must be"):
        addnorm.add_rms_norm_(x, r, None, value, backend="torch")
    with pytest.raises(ValueError, match="^dropout_p must be"):
        addnorm.add_rms_norm(x, r, None, 1e-6, dropout_p=value, backend="torch")


def test_norm_add_flags_must_be_bools_and_bias2_is_named():
    y, r, w = _t(2, N), _t(2, N), _t(N)
    with pytest.raises(TypeError, match="^zero_centered_weight must be a bool"):
        addnorm.norm_add_norm(y, r, w, w, zero_centered_weight=(True, 1))
    with pytest.raises(TypeError, match="^cast_before_weight must be a bool"):
        addnorm.norm_add_norm_(y, r, w, w, cast_before_weight=0.5)
    with pytest.raises(TypeError, match="^zero_centered_weight must be a bool"):
        addnorm.norm_add_(y, r, w, zero_centered_weight=1)
    with pytest.raises(ValueError, match="^eps1 must be"):
        addnorm.norm_add_norm(y, r, w, w, eps1=True)
    b = _t(N)
    # one tensor as both biases, the first norm a LayerNorm: bias2 is the wrong one, under norm2='rms'
    with pytest.raises(ValueError, match=r"^bias2 must be None with norm2='rms'"):
        addnorm.norm_add_norm(y, r, w, w, b, b, norm="layer", norm2="rms")
