"""The eager route's shortcuts (issue 15 item 8, host overhead) change nothing a caller can see.

Eager calls of a kernel backend skip the custom-op dispatcher (a plain autograd.Function, or no autograd node at all
when nothing needs a gradient), the Triton launchers cache their launch configuration per shape and flags, and
``resolve_backend`` remembers its resolutions. Each is checked here against the route it short-cuts: the
registered ``addnorm::add_norm_fwd`` op with its registered autograd, the configuration computed afresh, and the
resolution done again."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops import backends

KERNELS = ["reference", "cpu", "triton"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _inputs(m, n, *, residual, bias, requires_grad=True):
    g = torch.Generator().manual_seed(m * 100 + n)
    make = lambda *shape: torch.randn(*shape, generator=g).requires_grad_(requires_grad)  # noqa: E731
    return make(m, n), make(m, n) if residual else None, make(n), make(n) if bias else None


def _grads(out, res, inputs, seed=7):
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g)).sum() + (res * torch.randn(res.shape, generator=g)).sum()
    wrt = [t for t in inputs if t is not None]
    return torch.autograd.grad(loss, wrt)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("case", ["residual", "dropout", "no-residual", "fp32-stream"])
def test_eager_route_equals_the_custom_op_bit_for_bit(backend, is_rms, case):
    """The public call (eager: no dispatcher) against addnorm::add_norm_fwd called through torch.ops, with the
    registered autograd: the same outputs and every gradient, bitwise, dropout included (same generator state)."""
    _skip_unavailable(backend)
    x, r, w, b = _inputs(5, 48, residual=case != "no-residual", bias=not is_rms)
    p = 0.3 if case == "dropout" else 0.0
    rd = torch.float64 if case == "fp32-stream" else torch.float32
    x_in, r_in = (x.double(), r) if case == "fp32-stream" else (x, r)  # fp64 x, fp32 residual: two dtypes
    torch.manual_seed(11)
    if is_rms:
        out, res = addnorm.add_rms_norm(x_in, r_in, w, 1e-5, dropout_p=p, residual_dtype=rd, backend=backend)
    else:
        out, res = addnorm.add_layer_norm(x_in, r_in, w, b, 1e-5, dropout_p=p, residual_dtype=rd, backend=backend)
    # what the public call decides: with nothing to add or round, residual_out is x itself (not stored)
    store = r_in is not None or p > 0 or rd != x_in.dtype
    torch.manual_seed(11)
    op_out, op_res = torch.ops.addnorm.add_norm_fwd(
        x_in, r_in, w, b, 1e-5, is_rms, p, rd, False, store, backend, False, x_in.dtype
    )[:2]
    op_res = op_res if store else x_in
    assert torch.equal(out, op_out) and torch.equal(res, op_res)
    inputs = (x, r, w, b)
    for got, want in zip(_grads(out, res, inputs), _grads(op_out, op_res, inputs)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", KERNELS)
def test_inference_route_builds_no_graph_and_equals_the_training_route(backend):
    """Nothing requires grad (or grad mode is off): the kernel is called with no autograd node, same numbers."""
    _skip_unavailable(backend)
    x, r, w, _ = _inputs(3, 40, residual=True, bias=False)
    out, res = addnorm.add_rms_norm(x, r, w, 1e-6, backend=backend)
    with torch.no_grad():
        out_ng, res_ng = addnorm.add_rms_norm(x, r, w, 1e-6, backend=backend)
    with torch.inference_mode():
        out_im, res_im = addnorm.add_rms_norm(x, r, w, 1e-6, backend=backend)
    assert out.grad_fn is not None
    assert out_ng.grad_fn is None and res_ng.grad_fn is None and out_im.grad_fn is None
    assert torch.equal(out, out_ng) and torch.equal(res, res_ng) and torch.equal(out, out_im)


def test_compiled_graph_still_calls_the_custom_op():
    """Under torch.compile the kernel route is the registered op, as before: dynamo's graph names it."""
    graphs = []

    def capture(gm, _example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x, r, w, _ = _inputs(4, 24, residual=True, bias=False)
    f = torch.compile(
        lambda x, r, w: addnorm.add_rms_norm(x, r, w, 1e-6, backend="reference"), fullgraph=True, backend=capture
    )
    out, res = f(x, r, w)
    want = addnorm.add_rms_norm(x, r, w, 1e-6, backend="reference")
    assert torch.equal(out, want[0]) and torch.equal(res, want[1])
    assert any("addnorm.add_norm_fwd" in g for g in graphs), graphs


# ---- the Triton launchers' configuration cache -------------------------------------------------------------------


def _triton_plan():
    _skip_unavailable("triton")
    from addnorm.ops.triton import plan

    return plan


def test_launch_configuration_is_computed_once_per_shape_and_flags(monkeypatch):
    P = _triton_plan()
    made = []
    real_fwd, real_bwd = P.fwd_config, P.bwd_config
    monkeypatch.setattr(P, "fwd_config", lambda *key: made.append(("fwd", key)) or real_fwd(*key))
    monkeypatch.setattr(P, "bwd_config", lambda *key: made.append(("bwd", key)) or real_bwd(*key))
    monkeypatch.setattr(P, "_configs", {})
    x, r, w, _ = _inputs(3, 40, residual=True, bias=False)
    for _ in range(3):
        out, res = addnorm.add_rms_norm(x, r, w, 1e-6, backend="triton")
        out.sum().backward()
    assert [kind for kind, _ in made] == ["fwd", "bwd"]
    addnorm.add_rms_norm(x[:2], r[:2], w, 1e-6, backend="triton")  # another shape: a new entry
    addnorm.add_rms_norm(x, None, w, 1e-6, backend="triton")  # another flag (no residual): a new entry
    assert [kind for kind, _ in made] == ["fwd", "bwd", "fwd", "fwd"]


def test_replacing_tuning_replaces_the_cached_configuration(monkeypatch):
    """A new Tuning object (how tests and tune_triton.py change it; Tuning is frozen) is not served stale plans:
    the same shape moves from the rows kernel to the looped one, with the same numbers."""
    P = _triton_plan()
    x, r, w, _ = _inputs(3, 64, residual=True, bias=False)
    key = ("fwd", 3, 64, True, True, False, True, False, False, True, False, True)
    want = addnorm.add_rms_norm(x, r, w, 1e-6, backend="triton")
    assert P.cached_config(P.fwd_config, key)[0] is True  # rows kernel
    tuning = P.Tuning(max_fwd_block_n=32, max_bwd_block_n=32, loop_block_n=16)
    monkeypatch.setattr(P, "tuning", lambda: tuning)
    assert P.cached_config(P.fwd_config, key)[0] is False  # looped kernel
    got = addnorm.add_rms_norm(x, r, w, 1e-6, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # another reduction order: close, not bitwise
    with pytest.raises(AttributeError):
        P.tuning().max_fwd_block_n = 8  # frozen: an in-place edit would bypass the cache's check


def test_configuration_cache_is_bounded(monkeypatch):
    P = _triton_plan()
    monkeypatch.setattr(P, "_configs", {})
    monkeypatch.setattr(P, "_CONFIGS_MAX", 3)
    for m in range(1, 8):
        P.cached_config(P.fwd_config, ("fwd", m, 16, False, False, False, True, False, False, False, False, True))
        assert len(P._configs) <= 3


# ---- resolve_backend's CUDA cache --------------------------------------------------------------------------------


def test_resolution_is_remembered_but_not_across_env_or_a_fresh_start(monkeypatch, fresh_registry):
    calls = []
    monkeypatch.setattr(backends, "_resolve", lambda b, d: calls.append((b, d.type)) or "triton")
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for _ in range(3):
        assert backends.resolve_backend("triton", cuda) == "triton"
        assert backends.resolve_backend("auto", cuda) == "triton"
        backends.resolve_backend("auto", cpu)
    assert calls == [("triton", "cuda"), ("auto", "cuda"), ("auto", "cpu")]  # one entry per device, no size
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    backends.resolve_backend("auto", cuda)
    backends.resolve_backend("auto", cuda)
    assert calls[3:] == [("auto", "cuda")] * 2  # the override is read on every call
    monkeypatch.delenv(backends.ENV_VAR)
    backends.forget()  # as a fresh process: resolved again
    backends.resolve_backend("triton", cuda)
    assert calls[-1] == ("triton", "cuda") and len(calls) == 6
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.resolve_backend(["triton"], cuda)  # an unhashable value still gets the argument's error


def test_a_failed_resolution_is_not_remembered(monkeypatch, fresh_registry):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    meta = torch.device("meta")
    for _ in range(2):
        with pytest.raises(backends.BackendUnavailableError, match="cpu"):
            backends.resolve_backend("cpu", meta)
    assert backends._resolve_remembered.cache_info().currsize == 0
