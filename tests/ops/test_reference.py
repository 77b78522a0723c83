"""The oracles themselves: checked against PyTorch in float64 and against autograd, and the statistics variants
against the failure modes they exist to show."""

import pytest
import torch
import torch.nn.functional as F

from addnorm import reference as ref


def _rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def test_layer_norm_ref_matches_torch_fp64():
    x, w, b = _rand(5, 37), _rand(37), _rand(37)
    y, mean, rstd = ref.layer_norm_ref(x, w, b, 1e-5)
    torch.testing.assert_close(y, F.layer_norm(x, (37,), w, b, 1e-5), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x.var(-1, unbiased=False) + 1e-5))


def test_rms_norm_ref_matches_torch_and_default_eps():
    x, w = _rand(4, 19), _rand(19)
    y, _ = ref.rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(y, F.rms_norm(x, (19,), w, 1e-6), atol=1e-12, rtol=1e-12)
    xf = torch.randn(3, 8)
    torch.testing.assert_close(ref.rms_norm_ref(xf)[0], F.rms_norm(xf, (8,)))  # eps=None -> finfo eps both sides


def test_half_inputs_keep_dtype_and_fp32_stats():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    y, mean, rstd = ref.layer_norm_ref(x)
    assert y.dtype == torch.bfloat16 and mean.dtype == torch.float32 and rstd.dtype == torch.float32


@pytest.mark.parametrize("zero_centered", [False, True])
def test_backward_refs_match_autograd(zero_centered):
    x = _rand(6, 23).requires_grad_()
    w = _rand(23).requires_grad_()
    b = _rand(23).requires_grad_()
    dy = _rand(6, 23)
    weff = w + 1 if zero_centered else w
    F.layer_norm(x, (23,), weff, b, 1e-5).backward(dy)
    _, mean, rstd = ref.layer_norm_ref(x.detach(), w.detach(), b.detach(), 1e-5, zero_centered)
    dx, dw, db = ref.layer_norm_bwd_ref(dy, x.detach(), w.detach(), mean, rstd, zero_centered)
    for got, want in ((dx, x.grad), (dw, w.grad), (db, b.grad)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)

    x.grad = w.grad = None
    F.rms_norm(x, (23,), weff, 1e-6).backward(dy)
    _, rstd = ref.rms_norm_ref(x.detach(), w.detach(), 1e-6, zero_centered)
    dx, dw = ref.rms_norm_bwd_ref(dy, x.detach(), w.detach(), rstd, zero_centered)
    torch.testing.assert_close(dx, x.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(dw, w.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("is_rms", [False, True])
def test_add_norm_bwd_ref_matches_autograd_with_dropout(is_rms):
    m, n, p, seed = 5, 17, 0.3, 1234
    x, r, w, b = (
        _rand(m, n).requires_grad_(),
        _rand(m, n).requires_grad_(),
        _rand(n).requires_grad_(),
        _rand(n).requires_grad_(),
    )
    out, res_out, mean, rstd = ref.add_norm_ref(
        x, r, w, None if is_rms else b, eps=1e-5, is_rms=is_rms, dropout_p=p, seed=seed
    )
    dout, dres = _rand(m, n), _rand(m, n)
    ((out * dout).sum() + (res_out * dres).sum()).backward()
    dx, dr, dw, db = ref.add_norm_bwd_ref(
        dout,
        dres,
        res_out.detach(),
        w.detach(),
        None if is_rms else mean.detach(),
        rstd.detach(),
        bias_dtype=None if is_rms else torch.float64,
        dropout_p=p,
        seed=seed,
        x_dtype=torch.float64,
        residual_dtype=torch.float64,
    )
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dr, r.grad)
    torch.testing.assert_close(dw, w.grad)
    if not is_rms:
        torch.testing.assert_close(db, b.grad)
    else:
        assert db is None


# ---- statistics variants ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [ref.stats_naive, ref.stats_two_pass, ref.stats_welford, ref.stats_welford_chan])
def test_stats_variants_agree_on_benign_fp64_data(fn):
    x = _rand(3, 50)
    mean, var = fn(x, torch.float64)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(var, x.var(-1, unbiased=False))


def test_fp16_sum_of_squares_overflows_without_fp32_accumulation():
    x = torch.full((2, 512), 300.0, dtype=torch.float16) + torch.randn(2, 512).half()
    _, var16 = ref.stats_naive(x, torch.float16)  # sum(x^2) ~ 4.6e7 > 65504
    _, var32 = ref.stats_two_pass(x, torch.float32)
    assert not torch.isfinite(var16).all()
    assert torch.isfinite(var32).all()


def test_naive_variance_cancels_with_large_offset_but_welford_and_two_pass_do_not():
    torch.manual_seed(1)
    x = 1e4 + torch.randn(4, 1024, dtype=torch.float64)
    true_var = x.var(-1, unbiased=False)
    err = {}
    for name, fn in (
        ("naive", ref.stats_naive),
        ("two_pass", ref.stats_two_pass),
        ("welford", ref.stats_welford),
        ("chan", ref.stats_welford_chan),
    ):
        _, v = fn(x, torch.float32)
        err[name] = ((v.double() - true_var).abs() / true_var).max().item()
    assert err["naive"] > 0.1  # E[x^2] - E[x]^2 in fp32 loses the variance entirely at offset 1e4
    for name in ("two_pass", "welford", "chan"):
        assert err[name] < 1e-2, err


def test_chan_merge_equals_single_welford():
    x = _rand(3, 40)
    whole = ref.stats_welford(x, torch.float64)
    merged = ref.stats_welford_chan(x, torch.float64, chunks=5)
    torch.testing.assert_close(merged[0], whole[0])
    torch.testing.assert_close(merged[1], whole[1])


def test_stats_bad_chunks():
    with pytest.raises(ValueError, match="chunks"):
        ref.stats_welford_chan(_rand(2, 4), chunks=0)
