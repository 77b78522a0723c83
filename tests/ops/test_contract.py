"""One contract on every backend: the eps default, the dropout keep-function and scale (bitwise across backends and
either side of 32K elements, where auto once switched backends), dresidual sharing dx's tensor, and the torch backend's cast_before_weight
backward. Triton runs in its interpreter here (tiny sizes)."""

from __future__ import annotations

import pytest
import torch

import addnorm
from addnorm.ops import backends
from addnorm.ops import contract as C
from addnorm.testing import assert_close, oracle

ALL = ["torch", "reference", "cpu", "triton"]


def _skip_unavailable(backend):
    reason = backends.unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)


def _call(is_rms, x, r, w, b, eps, **kw):
    if is_rms:
        return addnorm.add_rms_norm(x, r, w, eps, **kw)
    return addnorm.add_layer_norm(x, r, w, b, eps, **kw)


# ---- 1. eps=None follows the dtype normalized (residual_out's) ------------------------------------------------


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_eps_default_is_the_residual_streams_not_xs(backend, dtype):
    """bf16/fp16 x with an fp32 residual stream of size ~1e-2: eps must be finfo(fp32).eps. x's eps (2^-7 for
    bf16) is larger than the mean square (1e-4) and would shrink the output by up to ~70%."""
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(1)
    x = (1e-2 * torch.randn(6, 40, generator=g)).to(dtype)
    r = 1e-2 * torch.randn(6, 40, generator=g)
    w = 1 + 0.1 * torch.randn(40, generator=g)
    out, res = addnorm.add_rms_norm(x, r, w, backend=backend)
    assert res.dtype == torch.float32 and out.dtype == dtype
    expected = oracle(x, r, w, None, eps=torch.finfo(torch.float32).eps, is_rms=True)
    assert_close(res, expected["residual_out"], "residual_out")
    assert_close(out, expected["out"], "out")
    # and bit for bit what an explicit eps gives
    out_explicit, _ = addnorm.add_rms_norm(x, r, w, torch.finfo(torch.float32).eps, backend=backend)
    assert torch.equal(out, out_explicit)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_eps_default_follows_residual_dtype_argument(backend):
    """residual_dtype=fp32 without a residual: the value normalized is fp32, so is eps; a bf16 stream keeps bf16's."""
    x = (1e-2 * torch.randn(4, 32)).to(torch.bfloat16)
    out, _ = addnorm.add_rms_norm(x, None, None, residual_dtype=torch.float32, backend=backend)
    assert torch.equal(
        out,
        addnorm.add_rms_norm(x, None, None, 1.1920928955078125e-07, residual_dtype=torch.float32, backend=backend)[0],
    )
    out_bf16 = addnorm.rms_norm(x, None, backend=backend)
    assert torch.equal(out_bf16, addnorm.rms_norm(x, None, torch.finfo(torch.bfloat16).eps, backend=backend))
    assert not torch.equal(out.float(), out_bf16.float())  # the two eps differ enough to show


def test_eps_none_with_a_bad_residual_dtype_names_residual_dtype():
    with pytest.raises(TypeError, match="residual_dtype"):
        addnorm.add_rms_norm(torch.randn(2, 4), None, None, residual_dtype=torch.int32)


# ---- 2. one dropout: keep-function of (seed, i * N + j), one scale ----------------------------------------------


def test_keep_function_tensor_form_matches_the_scalar_definition():
    """The int64 tensor hash (negative multiplier, masking) equals the plain-integer definition element by element,
    including elements past 2^32 (the hi word) and a seed given as a tensor."""
    seed, rows, cols, p = 123456789, 3, 11, 0.4
    mask = C.dropout_keep_mask(seed, rows, cols, p)
    assert torch.equal(mask, C.dropout_keep_mask(torch.tensor(seed), rows, cols, p))
    thr = C.dropout_threshold(p)
    key = C.mix32((seed + C.DROPOUT_SEED_OFFSET) & 0xFFFFFFFF)
    for i in range(rows):
        for j in range(cols):
            idx = i * cols + j
            z = C.mix32((idx & 0xFFFFFFFF) ^ C.mix32((idx >> 32) ^ key))
            assert bool(mask[i, j]) == ((z >> 8) >= thr)
    # the hi word: rows so long that i * N + j passes 2^32 (checked on two rows only)
    big = 1 << 31
    idx = torch.tensor([[big * 2 - 1, big * 2, big * 2 + 5]], dtype=torch.int64)
    z = C._mix32_t((idx & 0xFFFFFFFF) ^ C._mix32_t((idx >> 32) ^ key))
    for k, v in enumerate(idx[0].tolist()):
        assert int(z[0, k]) == C.mix32((v & 0xFFFFFFFF) ^ C.mix32((v >> 32) ^ key))
    # a value computed once from the definition: changing a constant changes every mask, which must be deliberate
    assert C.mix32(0x12345678) == 0xF5E71C96


def test_dropout_keep_mask_deterministic_and_unbiased():
    a = C.dropout_keep_mask(7, 64, 129, 0.25)
    assert torch.equal(a, C.dropout_keep_mask(7, 64, 129, 0.25))
    assert not torch.equal(a, C.dropout_keep_mask(8, 64, 129, 0.25))
    n = a.numel()
    frac = a.double().mean().item()
    sigma = (0.25 * 0.75 / n) ** 0.5
    assert abs(frac - 0.75) < 5 * sigma
    # neighbouring rows are not copies of each other (the index, not just the column, enters the hash)
    assert not torch.equal(a[0], a[1])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_independence(p):
    mask = C.dropout_keep_mask(3, 256, 256, p).float()
    assert abs(mask.mean().item() - (1 - p)) < 0.01
    # neighbouring rows and columns are uncorrelated, and another seed gives another mask
    for a, b in ((mask[1:], mask[:-1]), (mask[:, 1:], mask[:, :-1])):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(corr) < 0.02
    other = C.dropout_keep_mask(4, 256, 256, p).float()
    assert abs(torch.corrcoef(torch.stack([mask.flatten(), other.flatten()]))[0, 1].item()) < 0.02


def test_scale_is_one_over_one_minus_p_rounded_to_the_stats_dtype():
    p = 0.1
    assert C.dropout_scale(p, torch.float64) == 1 / (1 - p)
    s32 = C.dropout_scale(p, torch.float32)
    assert s32 == float(torch.tensor(1 / (1 - p), dtype=torch.float32)) and s32 != 1 / (1 - p)


# sizes either side of 32K elements, where auto switched CPU tensors between the torch and cpu backends until issue 26
SIZES = [(3, 40), (9, 100), (64, 1024)]


@pytest.mark.parametrize("mn", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize(
    "x_dtype, rd",
    [(torch.float32, None), (torch.bfloat16, torch.float32), (torch.float64, None)],
    ids=["fp32", "bf16-fp32stream", "fp64"],
)
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_same_seed_same_residual_out_bit_for_bit_on_every_backend(mn, x_dtype, rd, is_rms):
    m, n = mn
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, n, generator=g).to(x_dtype)
    r = torch.randn(m, n, generator=g).to(rd or x_dtype)
    w = torch.randn(n, generator=g).to(x_dtype)
    results = {}
    for backend in ["auto", *ALL]:
        if backend != "auto" and backends.unavailable_reason(backend, torch.device("cpu")) is not None:
            continue
        torch.manual_seed(7)
        results[backend] = _call(is_rms, x, r, w, None, 1e-5, dropout_p=0.3, residual_dtype=rd, backend=backend)
    assert {"torch", "reference", "cpu"} <= results.keys()
    # the contract written out: the seed the op draws, the mask of addnorm.reference, the scale
    torch.manual_seed(7)
    seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
    keep = C.dropout_keep_mask(seed, m, n, 0.3)
    cd = torch.float64 if torch.float64 in (x_dtype, rd) else torch.float32
    expected = (torch.where(keep, x.to(cd) * C.dropout_scale(0.3, cd), 0.0) + r.to(cd)).to(rd or x_dtype)
    for backend, (_, res) in results.items():
        assert torch.equal(res, expected), f"{backend}: residual_out differs from the contract"
    assert 0.6 < keep.float().mean().item() < 0.8


@pytest.mark.parametrize("backend", ALL)
def test_dropout_backward_regenerates_the_forwards_mask(backend):
    _skip_unavailable(backend)
    x = torch.randn(5, 48, requires_grad=True)
    r = torch.randn(5, 48, requires_grad=True)
    torch.manual_seed(11)
    _, res = addnorm.add_layer_norm(x, r, None, None, dropout_p=0.5, backend=backend)
    (res * torch.randn_like(res)).sum().backward()
    kept = res.detach() != r.detach()  # where x was dropped, residual_out is the residual itself
    assert torch.equal(x.grad != 0, kept)
    assert torch.allclose(x.grad[kept], (r.grad * C.dropout_scale(0.5, torch.float32))[kept])


# ---- 3. dresidual is dx's tensor when nothing separates them ----------------------------------------------------


def _grads_seen(backend, x_dtype, rd=None, dropout_p=0.0):
    """(grad reaching x, grad reaching residual) as the op returns them, seen by hooks on non-leaf inputs."""
    x0 = torch.randn(6, 40, dtype=x_dtype, requires_grad=True)
    r0 = torch.randn(6, 40, dtype=rd or x_dtype, requires_grad=True)
    w = torch.randn(40, dtype=x_dtype, requires_grad=True)
    x, r = x0 * 1, r0 * 1
    seen = {}
    x.register_hook(lambda g: seen.__setitem__("x", g))
    r.register_hook(lambda g: seen.__setitem__("r", g))
    out, res = addnorm.add_rms_norm(x, r, w, 1e-5, dropout_p=dropout_p, backend=backend)
    (out.float().square().sum() + (res.float() * torch.linspace(0, 1, 40)).sum()).backward()
    return seen["x"], seen["r"], (x0.grad, r0.grad, w.grad)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dresidual_is_dxs_tensor_without_dropout_and_same_dtype(backend, x_dtype):
    _skip_unavailable(backend)
    gx, gr, grads = _grads_seen(backend, x_dtype)
    assert gx.data_ptr() == gr.data_ptr()
    # the same gradients as the torch backend, where autograd computes both separately
    torch.manual_seed(0)
    _, _, expected = _grads_seen("torch", x_dtype)
    for a, e, what in zip(grads, expected, ("dx", "dresidual", "dweight")):
        assert_close(a, e.double(), what, grad=True, reduced_rows=6 if what == "dweight" else 1)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_dresidual_is_its_own_tensor_with_dropout_or_another_dtype(backend):
    _skip_unavailable(backend)
    gx, gr, _ = _grads_seen(backend, torch.bfloat16, rd=torch.float32)
    assert gx.data_ptr() != gr.data_ptr() and gr.dtype == torch.float32
    gx, gr, _ = _grads_seen(backend, torch.float32, dropout_p=0.5)
    assert gx.data_ptr() != gr.data_ptr()
    assert bool(((gx == 0) & (gr != 0)).any())  # dropped elements: no gradient to x, all of it to the residual


def test_dresidual_sharing_under_compile_gives_the_eager_gradients():
    x = torch.randn(6, 40, requires_grad=True)
    r = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)

    def f(x, r, w):
        out, res = addnorm.add_rms_norm(x, r, w, 1e-5, backend="cpu")
        return out.square().sum() + res.sum()

    eager = torch.autograd.grad(f(x, r, w), (x, r, w))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, r, w), (x, r, w))
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


# ---- 5. the torch backend's cast_before_weight backward follows the contract ------------------------------------


@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("backend", ALL)
def test_cast_before_weight_gradient_is_not_rounded_before_the_norms_backward(backend, is_rms):
    """fp32 x normalized into bf16 with Llama's cast order: the rounding's gradient is the identity, so dx keeps
    fp32 accuracy. Autograd through .to(bf16) would round dout * w to bf16 first: ~2^-9 relative error in dx."""
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=g, requires_grad=True)
    w = (1 + 0.3 * torch.randn(64, generator=g)).requires_grad_(True)
    b = (0.1 * torch.randn(64, generator=g)).requires_grad_(True)
    out, _ = _call(is_rms, x, None, w, b, 1e-5, cast_before_weight=True, out_dtype=torch.bfloat16, backend=backend)
    dout = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    out.backward(dout)
    expected = oracle(
        x,
        None,
        w,
        None if is_rms else b,
        eps=1e-5,
        is_rms=is_rms,
        cast_before_weight=True,
        out_dtype=torch.bfloat16,
        dout=dout,
    )
    assert_close(x.grad, expected["dx"], "dx", grad=True)


# ---- 7. the GPU path, checked structurally (no GPU here) --------------------------------------------------------


def test_op_outputs_stay_on_the_inputs_device_seed_included():
    """The seed is drawn on x's device and returned there: for CUDA inputs no CPU tensor enters or leaves the op
    (a CPU tensor in a graph makes Inductor skip CUDA graphs). Checked with meta tensors, whose fake implementation
    is what torch.compile traces."""
    x = torch.empty(4, 8, device="meta")
    outs = torch.ops.addnorm.add_norm_fwd(
        x, x.clone(), None, None, 1e-5, True, 0.5, torch.float32, False, True, "reference"
    )
    assert all(t.device.type == "meta" for t in outs)
    assert outs[4].shape == () and outs[4].dtype == torch.int64
    no_dropout = torch.ops.addnorm.add_norm_fwd(
        x, None, None, None, 1e-5, True, 0.0, torch.float32, False, True, "reference"
    )
    assert all(t.device.type == "meta" for t in no_dropout) and no_dropout[4].numel() == 0


def test_seed_is_drawn_from_the_devices_generator():
    from addnorm.ops.contract import draw_seed

    torch.manual_seed(3)
    a = draw_seed(torch.device("cpu"))
    torch.manual_seed(3)
    assert a.device.type == "cpu" and a.shape == () and int(a) == int(torch.randint(0, 2**31 - 1, ()))


def test_triton_launches_under_a_guard_for_tensors_on_another_gpu(monkeypatch):
    pytest.importorskip("triton")
    from addnorm.ops.triton import launch as T

    class OnGpu:  # what the guard reads of a CUDA tensor (none can be made on this machine)
        is_cuda = True

        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    assert isinstance(T._device_guard(torch.zeros(1)), type(__import__("contextlib").nullcontext()))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = T._device_guard(OnGpu(1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(T._device_guard(OnGpu(0)), torch.cuda.device)


@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
def test_triton_looped_path_draws_the_same_mask(monkeypatch, is_rms):
    """Rows wider than the register limit take the looped kernels (forward) and the row-sums + tiles kernels
    (backward): the same keep-function there, so the same residual_out and the same dropped gradients."""
    _skip_unavailable("triton")
    from addnorm.ops.triton import plan

    tuning = plan.Tuning(max_fwd_block_n=32, max_bwd_block_n=32, loop_block_n=16)
    monkeypatch.setattr(plan, "tuning", lambda: tuning)
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(3, 70, generator=g), torch.randn(3, 70, generator=g)
    grads = {}
    for backend in ("reference", "triton"):
        xl = x.clone().requires_grad_(True)
        torch.manual_seed(21)
        _, res = _call(is_rms, xl, r, None, None, 1e-5, dropout_p=0.4, backend=backend)
        res.sum().backward()
        grads[backend] = (res.detach(), xl.grad)
    assert torch.equal(grads["triton"][0], grads["reference"][0])
    assert torch.equal(grads["triton"][1], grads["reference"][1])  # dx = keep * scale exactly (dresidual_out = 1)


# ---- statistics are not stored when nothing will read them ----------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("is_rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("looped", [False, True], ids=["rows", "looped"])
def test_forward_without_statistics_gives_the_same_outputs(backend, is_rms, looped, monkeypatch):
    """store_stats=False (inference calls): mean and rstd come back None, out and residual_out bit for bit those of
    a call that stores them, on the rows and the looped Triton kernels."""
    _skip_unavailable(backend)
    if looped and backend != "triton":
        pytest.skip("only the Triton backend has a looped path")
    mod = backends.kernel_module(backend)
    if looped:
        from addnorm.ops.triton import plan

        tuning = plan.Tuning(max_fwd_block_n=32, loop_block_n=16)
        monkeypatch.setattr(plan, "tuning", lambda: tuning)
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(5, 70, generator=g).to(torch.bfloat16), torch.randn(5, 70, generator=g)
    w, b = torch.randn(70, generator=g), torch.randn(70, generator=g)
    kw = dict(
        eps=1e-5,
        is_rms=is_rms,
        dropout_p=0.0,
        seed=None,
        residual_dtype=torch.float32,
        zero_centered_weight=False,
        store_residual_out=True,
    )
    with_stats = mod.forward(x, r, w, b, **kw)
    without = mod.forward(x, r, w, b, store_stats=False, **kw)
    assert without[2] is None and without[3] is None
    assert with_stats[3] is not None and (with_stats[2] is None) == is_rms
    assert torch.equal(without[0], with_stats[0]) and torch.equal(without[1], with_stats[1])


def test_triton_inference_call_writes_no_statistics(monkeypatch):
    """Under inference_mode the public call allocates no mean/rstd: the kernel gets the persistent scratch tensor
    for its accumulation type and must leave it untouched (STORE_STATS off)."""
    _skip_unavailable("triton")
    from addnorm.ops.triton import launch as T

    x, r, w, b = torch.randn(4, 48), torch.randn(4, 48), torch.randn(48), torch.randn(48)
    scratch = T._scratch(x.device, torch.float32)
    scratch.fill_(float("nan"))
    empties = []
    real_empty = torch.empty
    monkeypatch.setattr(T.torch, "empty", lambda *a, **k: empties.append(a) or real_empty(*a, **k))
    with torch.inference_mode():
        out, res = addnorm.add_layer_norm(x, r, w, b, backend="triton")
    assert [a[0] for a in empties] == [(4, 48), (4, 48)]  # out and residual_out, nothing of shape (M,)
    assert torch.isnan(scratch).all()
    expected = oracle(x, r, w, b, eps=1e-5, is_rms=False)
    assert_close(out, expected["out"], "out")
    assert_close(res, expected["residual_out"], "residual_out")


def test_the_spec_of_a_call_fills_the_defaults_and_is_frozen():
    import dataclasses

    x, r = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8)
    w = torch.ones(8, dtype=torch.bfloat16)
    spec = C.AddNormSpec.of_call(x, r, w, None, None, True, 0, None, False, True, None)
    assert spec == C.AddNormSpec(torch.finfo(torch.float32).eps, True, 0.0, torch.float32, False, True, torch.bfloat16)
    assert type(spec.eps) is float and type(spec.dropout_p) is float
    # the cast rounds nothing without an affine step, or when out_dtype is the statistics dtype
    assert not C.AddNormSpec.of_call(x, r, None, None, 1e-6, True, 0.0, None, False, True, None).cast_before_weight
    assert not C.AddNormSpec.of_call(
        x, r, w, None, 1e-6, True, 0.0, None, False, True, torch.float32
    ).cast_before_weight
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.eps = 1.0
    with pytest.raises(TypeError, match="^out_dtype must be a floating dtype"):
        C.AddNormSpec.of_call(x, r, w, None, 1e-6, True, 0.0, None, False, False, torch.int8)
    with pytest.raises(ValueError, match="^eps must be a finite number"):
        C.AddNormSpec.of_call(x, r, w, None, -1.0, True, 0.0, None, False, False, None)
