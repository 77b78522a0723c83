"""``addnorm.compat.vllm``'s quantization wrappers and ops called as a hostile vLLM user would: vLLM's positional
and keyword forms, 1-D / 2-D / 3-D scales, scales and zero points of other dtypes, float64 inputs, strided buffers.
Each refusal is the one vLLM makes, with its exception type and text, read from (vllm-project/vllm):

- ``vllm/_custom_ops.py`` at 0002bde5 (``scaled_fp8_quant``, ``scaled_int8_quant``, the fused norm + quant wrappers);
- ``csrc/quantization/w8a8/fp8/common.cu`` at cda1b348 (``static_scaled_fp8_quant`` with ``group_shape``, the
  dynamic FP8 ops), ``csrc/quantization/w8a8/int8/scaled_quant.cu`` at 180df48e,
  ``csrc/quantization/fused_kernels/fused_layernorm_dynamic_per_token_quant.cu`` at 02a7fabd,
  ``csrc/layernorm_quant_kernels.cu`` and ``csrc/layernorm_kernels.cu`` at 0112cf23.

A ``TORCH_CHECK(cond)`` without a message raises ``RuntimeError: Expected cond to be true, but got false.``; a
``data_ptr<float>()`` on another dtype ``RuntimeError: expected scalar type Float but found BFloat16``; an input dtype
outside ``VLLM_DISPATCH_FLOATING_TYPES`` (float32, float16, bfloat16) torch's dispatch error, a
``NotImplementedError`` (a ``RuntimeError``) naming the dispatch.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from addnorm.compat import vllm

FP8 = torch.float8_e4m3fn
EPS = 1e-6
_ops = torch.ops.addnorm_vllm


def _x(m=4, n=256, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, n, generator=g).to(dtype)


def _fp8(v):
    return torch.fmax(torch.fmin(v, torch.tensor(448.0)), torch.tensor(-448.0)).to(FP8)


def _same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- static FP8: the scale's layout (common.cu at cda1b348) ----------------------------------------------------


def test_static_fp8_1d_scale_needs_group_shape():
    """A 1-D scale is ambiguous (per channel or per token when M == N): vLLM refuses it without ``group_shape``.
    The old code took any 1-D scale of N elements as per-channel."""
    x = _x()
    with pytest.raises(RuntimeError, match="1D scale requires explicit group_shape to disambiguate"):
        vllm.scaled_fp8_quant(x, torch.rand(256) + 0.1)


@pytest.mark.parametrize("m", [4, 8], ids=["M!=N", "M==N"])
def test_static_fp8_per_token_1d_scale(m):
    """``group_shape=(1, -1)``: one static scale per token (the old code refused it, or with M == N applied it per
    channel)."""
    x = _x(m, 8)
    s = torch.rand(m) + 0.1
    q, scale = vllm.scaled_fp8_quant(x, s, group_shape=(1, -1))
    assert scale is s
    assert _same(q, _fp8(x.float() * (1.0 / s[:, None])))
    q2 = torch.empty(m, 8, dtype=FP8)
    vllm.static_scaled_fp8_quant(q2, x, s, (1, -1))  # the _C form's group_shape, positional
    assert _same(q2, q)


def test_static_fp8_layouts_vllm_accepts():
    """What vLLM accepts keeps working (passes on the old code too): per tensor (0-D, (1,), (1, 1)), per channel
    with ``group_shape=(-1, 1)``, 2-D groups with and without a matching explicit ``group_shape``."""
    x = _x(4, 256)
    xf = x.float()
    s = torch.tensor(0.05)
    for scale in (s, s.reshape(1), s.reshape(1, 1)):
        assert _same(vllm.scaled_fp8_quant(x, scale)[0], _fp8(xf * (1.0 / s)))
    ch = torch.rand(256) + 0.1
    assert _same(vllm.scaled_fp8_quant(x, ch, group_shape=(-1, 1))[0], _fp8(xf * (1.0 / ch)))
    g = torch.rand(2, 2) + 0.1  # (M / 2, N / 128)
    want = _fp8(xf * (1.0 / g.repeat_interleave(2, 0).repeat_interleave(128, 1)))
    assert _same(vllm.scaled_fp8_quant(x, g)[0], want)
    assert _same(vllm.scaled_fp8_quant(x, g, group_shape=(2, 128))[0], want)


@pytest.mark.parametrize(
    "scale, group_shape, message",
    [
        (torch.rand(3, 2) + 0.1, None, r"num_tokens \(4\) must be divisible by scale.size\(0\) \(3\)"),
        (torch.rand(8, 2) + 0.1, None, r"num_tokens \(4\) must be divisible by scale.size\(0\) \(8\)"),
        (torch.rand(4, 3) + 0.1, None, r"hidden_size \(256\) must be divisible by scale.size\(1\) \(3\)"),
        (
            torch.rand(4, 2) + 0.1,
            (1, 64),
            r"Explicit group_shape \(1, 64\) does not match inferred group shape \(1, 128\) from 2D scale tensor "
            r"shape \(4, 2\)",
        ),
        (torch.rand(1, 1, 256) + 0.1, None, "scale must be 0D, 1D, or 2D tensor, but got 3D"),
        (
            torch.rand(128) + 0.1,
            (-1, 1),
            r"1D scale length \(128\) does not match expected size \(256\) for group_shape \(-1, 1\) with input "
            r"shape \(4, 256\)",
        ),
        (torch.rand(4 * 2) + 0.1, (1, 128), "1D scale can only be used when one of the scale dimensions is 1"),
    ],
    ids=["rows-3", "rows-8", "cols-3", "explicit-mismatch", "3d", "1d-length", "1d-2d-groups"],
)
def test_static_fp8_scale_layouts_vllm_refuses(scale, group_shape, message):
    with pytest.raises(RuntimeError, match=message):
        vllm.scaled_fp8_quant(_x(), scale, group_shape=group_shape)


# --- scales, bounds and zero points are read through data_ptr<float>() / data_ptr<int32_t>() -------------------


def _scale_dtype_cases():
    x, w = _x(), torch.ones(256, dtype=torch.bfloat16)
    bf = torch.tensor([0.05], dtype=torch.bfloat16)
    ub = torch.tensor(1.0, dtype=torch.bfloat16)
    f8 = torch.empty(4, 256, dtype=FP8)
    return {
        "scaled_fp8_quant-static-bf16": lambda: vllm.scaled_fp8_quant(x, bf),
        "scaled_fp8_quant-static-f64": lambda: vllm.scaled_fp8_quant(x, torch.tensor([0.05], dtype=torch.float64)),
        "scaled_fp8_quant-scale_ub-bf16": lambda: vllm.scaled_fp8_quant(x, scale_ub=ub, use_per_token_if_dynamic=True),
        "scaled_int8_quant-static-bf16": lambda: vllm.scaled_int8_quant(x, bf),
        "rms_norm_dynamic_per_token_quant-scale_ub-bf16": lambda: vllm.rms_norm_dynamic_per_token_quant(
            x, w, EPS, FP8, ub
        ),
        "rms_norm_per_block_quant-scale_ub-bf16": lambda: vllm.rms_norm_per_block_quant(x, w, EPS, FP8, [1, 128], ub),
        "rms_norm_static_fp8_quant-bf16": lambda: vllm.rms_norm_static_fp8_quant(f8, x, w, bf, EPS),
        "fused_add_rms_norm_static_fp8_quant-bf16": lambda: vllm.fused_add_rms_norm_static_fp8_quant(
            f8, x, x.clone(), w, bf, EPS
        ),
        "_C.dynamic_scaled_fp8_quant-f16": lambda: _ops.dynamic_scaled_fp8_quant(f8, x, torch.empty(1).half()),
        "_C.dynamic_per_token_scaled_fp8_quant-bf16": lambda: _ops.dynamic_per_token_scaled_fp8_quant(
            f8, x, torch.empty(4, 1, dtype=torch.bfloat16), None
        ),
        "_C.dynamic_scaled_int8_quant-f16": lambda: _ops.dynamic_scaled_int8_quant(
            torch.empty(4, 256, dtype=torch.int8), x, torch.empty(4, 1).half(), None
        ),
    }


@pytest.mark.parametrize("case", list(_scale_dtype_cases()))
def test_scales_of_another_dtype_are_refused(case):
    """vLLM reads every scale and ``scale_ub`` as float32 (``data_ptr<float>()``): another dtype is refused, not
    converted (the old code converted it)."""
    with pytest.raises(RuntimeError, match="expected scalar type Float but found (BFloat16|Half|Double)"):
        _scale_dtype_cases()[case]()


def _scale_ub_cases(ub, residual):
    x, w = _x(), torch.ones(256, dtype=torch.bfloat16)
    f8, s = torch.empty(4, 256, dtype=FP8), torch.empty(4, 1)
    return {
        "scaled_fp8_quant": lambda: vllm.scaled_fp8_quant(x, scale_ub=ub, use_per_token_if_dynamic=True),
        "rms_norm_dynamic_per_token_quant": lambda: vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, FP8, ub, residual),
        "rms_norm_per_block_quant": lambda: vllm.rms_norm_per_block_quant(x, w, EPS, FP8, [1, 128], ub, residual),
        "_C.dynamic_per_token_scaled_fp8_quant": lambda: _ops.dynamic_per_token_scaled_fp8_quant(f8, x, s, ub),
        "_C.rms_norm_dynamic_per_token_quant": lambda: _ops.rms_norm_dynamic_per_token_quant(
            f8, x, w, s, EPS, ub, residual
        ),
        "_C.rms_norm_per_block_quant": lambda: _ops.rms_norm_per_block_quant(
            f8, x, w, torch.empty(4, 2), EPS, ub, residual, 128, False
        ),
    }


@pytest.mark.parametrize("shape", [(2,), (0,), (1, 2)], ids=["2", "empty", "1x2"])
@pytest.mark.parametrize("case", list(_scale_ub_cases(None, None)))
def test_scale_ub_of_several_elements_is_refused_naming_it(case, shape):
    """``scale_ub`` is one float32 value: a tensor of several (or none) is a ValueError naming the argument and the
    shape (before: torch's "shape '[]' is invalid for input of size 2" from a reshape), and nothing is written."""
    residual = None if case.endswith("scaled_fp8_quant") else _x()
    before = None if residual is None else residual.clone()
    ub = torch.ones(shape)
    message = f"scale_ub must hold one value (a float32 tensor of one element), got shape {tuple(shape)}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _scale_ub_cases(ub, residual)[case]()
    if residual is not None:
        assert torch.equal(residual, before)
    for one in (torch.tensor(2.0), torch.tensor([[2.0]])):  # one element, of any shape: vLLM's reading
        _scale_ub_cases(one, None if residual is None else residual.clone())[case]()


@pytest.mark.parametrize("azp_dtype", [torch.int64, torch.float32], ids=["int64", "float32"])
def test_int8_zero_point_must_be_int32(azp_dtype):
    x = _x()
    azp = torch.tensor([3], dtype=azp_dtype)
    name = {torch.int64: "Long", torch.float32: "Float"}[azp_dtype]
    with pytest.raises(RuntimeError, match=f"expected scalar type Int but found {name}"):
        vllm.scaled_int8_quant(x, torch.tensor([0.1]), azp, symmetric=False)
    with pytest.raises(RuntimeError, match=f"expected scalar type Int but found {name}"):
        _ops.dynamic_scaled_int8_quant(
            torch.empty(4, 256, dtype=torch.int8), x, torch.empty(4, 1), torch.empty(4, 1, dtype=azp_dtype)
        )
    q, s, z = vllm.scaled_int8_quant(x, torch.tensor([0.1]), torch.tensor([3], dtype=torch.int32), symmetric=False)
    assert q.dtype == torch.int8 and z.dtype == torch.int32


# --- input dtypes: VLLM_DISPATCH_FLOATING_TYPES ------------------------------------------------------------------


def _dispatch_cases():
    x = _x(dtype=torch.float64)
    w = torch.ones(256, dtype=torch.float64)
    s = torch.tensor([0.05])
    return {
        "scaled_fp8_quant_kernel_scalar_type": [
            lambda: vllm.scaled_fp8_quant(x),
            lambda: vllm.scaled_fp8_quant(x, s),
        ],
        "dynamic_per_token_scaled_fp8_quant_kernel_scalar_type": [
            lambda: vllm.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
        ],
        "static_scaled_int8_quant_kernel": [lambda: vllm.scaled_int8_quant(x, s)],
        "dynamic_scaled_int8_quant_kernel": [lambda: vllm.scaled_int8_quant(x)],
        "rms_norm_dynamic_per_token_quant_dispatch": [lambda: vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, FP8)],
        "rms_norm_per_block_quant_fp_dispatch": [lambda: vllm.rms_norm_per_block_quant(x, w, EPS, FP8, [1, 128])],
        "rms_norm_kernel_scalar_type": [
            lambda: vllm.rms_norm_static_fp8_quant(torch.empty(4, 256, dtype=FP8), x, w, s, EPS)
        ],
        "fused_add_rms_norm_kernel_scalar_type": [
            lambda: vllm.fused_add_rms_norm_static_fp8_quant(torch.empty(4, 256, dtype=FP8), x, x.clone(), w, s, EPS)
        ],
        "rms_norm_kernel": [lambda: vllm.rms_norm(torch.empty_like(x), x, w, EPS)],
        "fused_add_rms_norm_kernel": [lambda: vllm.fused_add_rms_norm(x.clone(), x.clone(), w, EPS)],
    }


@pytest.mark.parametrize("dispatch", list(_dispatch_cases()))
def test_float64_input_is_refused_as_vllm_dispatch_refuses(dispatch):
    """float64 (or any dtype but float32/float16/bfloat16) was computed by the old code; vLLM's kernels have no
    case for it."""
    for call in _dispatch_cases()[dispatch]:
        with pytest.raises(NotImplementedError, match=f"\"{dispatch}\" not implemented for 'Double'"):
            call()


# --- strides and contiguity ----------------------------------------------------------------------------------------


def test_fp8_last_stride_messages_are_vllms():
    x = _x()
    strided = torch.stack([x, x], -1)[..., 0]  # last-dimension stride 2
    with pytest.raises(RuntimeError, match="last dimension of input must be contiguous"):
        vllm.scaled_fp8_quant(strided)
    with pytest.raises(RuntimeError, match="last dimension of input must be contiguous"):
        vllm.scaled_fp8_quant(strided, torch.tensor([0.05]))
    out = torch.empty(4, 256, 2, dtype=FP8)[..., 0]
    with pytest.raises(RuntimeError, match="last dimension of output must be contiguous"):
        vllm.static_scaled_fp8_quant(out, x, torch.tensor([0.05]))
    with pytest.raises(RuntimeError, match="last dimension of output must be contiguous"):
        vllm.scaled_fp8_quant(x, output=out)


def test_static_int8_needs_contiguous_input_dynamic_does_not():
    """``static_scaled_int8_quant`` ``TORCH_CHECK(input.is_contiguous())`` and vLLM's wrapper passes the input as
    given; the dynamic path passes ``input.contiguous()``, so a row-strided input works there."""
    wide = _x(4, 512)[:, :256]
    with pytest.raises(RuntimeError, match=r"Expected input.is_contiguous\(\) to be true, but got false."):
        vllm.scaled_int8_quant(wide, torch.tensor([0.1]))
    q, s, _ = vllm.scaled_int8_quant(wide)
    want_q, want_s, _ = vllm.scaled_int8_quant(wide.contiguous())
    assert torch.equal(q, want_q) and torch.equal(s, want_s)


def test_int8_ops_torch_checks():
    x = _x()
    i8 = torch.empty(4, 256, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"Expected scale.numel\(\) == 1 to be true, but got false."):
        vllm.scaled_int8_quant(x, torch.tensor([0.1, 0.2]))
    with pytest.raises(RuntimeError, match=r"Expected !azp \|\| azp->numel\(\) == 1 to be true"):
        vllm.scaled_int8_quant(x, torch.tensor([0.1]), torch.tensor([1, 2], dtype=torch.int32), symmetric=False)
    with pytest.raises(RuntimeError, match=r"Expected input.is_contiguous\(\) to be true"):
        _ops.dynamic_scaled_int8_quant(i8, _x(4, 512)[:, :256], torch.empty(4, 1), None)
    with pytest.raises(RuntimeError, match=r"Expected out.is_contiguous\(\) to be true"):
        _ops.static_scaled_int8_quant(torch.empty(4, 512, dtype=torch.int8)[:, :256], x, torch.tensor([0.1]), None)
    with pytest.raises(RuntimeError, match=r"Expected scales.is_contiguous\(\) to be true"):
        _ops.dynamic_scaled_int8_quant(i8, x, torch.empty(4, 2)[:, :1], None)
    # vLLM's wrapper allocates out with empty_like(input): a transposed input gives a transposed out, refused
    with pytest.raises(RuntimeError, match=r"Expected out.is_contiguous\(\) to be true"):
        vllm.scaled_int8_quant(_x(256, 4).t())


# --- the fused norm + quant ops (fused_layernorm_dynamic_per_token_quant.cu at 02a7fabd) --------------------------


def test_fused_quant_ops_raise_vllms_torch_checks():
    x, r = _x(), _x()
    w = torch.ones(256, dtype=torch.bfloat16)
    s = torch.empty(4, 1)
    with pytest.raises(RuntimeError, match=r"Expected out.dtype\(\) == kFp8Type \|\| out.dtype\(\) == torch::kInt8"):
        vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, torch.float8_e5m2)
    with pytest.raises(RuntimeError, match=r"Expected out.is_contiguous\(\) to be true"):
        _ops.rms_norm_dynamic_per_token_quant(torch.empty(256, 4, dtype=FP8).t(), x, w, s, EPS, None, None)
    with pytest.raises(RuntimeError, match=r"Expected out.dtype\(\) == kFp8Type to be true"):
        vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, torch.int8, torch.tensor(1.0))
    with pytest.raises(RuntimeError, match=r"Expected weight.dtype\(\) == input.dtype\(\) to be true"):
        vllm.rms_norm_per_block_quant(x, w.half(), EPS, FP8, [1, 128])
    with pytest.raises(RuntimeError, match=r"Expected residual->scalar_type\(\) == input.scalar_type\(\) to be true"):
        vllm.rms_norm_dynamic_per_token_quant(x, w, EPS, FP8, None, r.half())


@pytest.mark.parametrize("op", ["per_token", "per_block"])
def test_fused_quant_scales_of_another_dtype_raise_runtime_error(op):
    """``TORCH_CHECK(scales.dtype() == torch::kFloat32)``: a RuntimeError (the old code raised ValueError)."""
    x, w = _x(), torch.ones(256, dtype=torch.bfloat16)
    q = torch.empty(4, 256, dtype=FP8)
    with pytest.raises(RuntimeError, match=r"Expected scales.dtype\(\) == torch::kFloat32 to be true"):
        if op == "per_token":
            _ops.rms_norm_dynamic_per_token_quant(q, x, w, torch.empty(4, 1, dtype=torch.bfloat16), EPS, None, None)
        else:
            _ops.rms_norm_per_block_quant(q, x, w, torch.empty(4, 2, dtype=torch.bfloat16), EPS, None, None, 128, False)


# --- the static FP8 norm ops and the plain norm ops (0112cf23) ----------------------------------------------------


def test_static_fp8_norm_ops_refusals():
    x, r = _x(), _x()
    w = torch.ones(256, dtype=torch.bfloat16)
    s = torch.tensor([0.05])
    f8 = torch.empty(4, 256, dtype=FP8)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Half"):
        vllm.rms_norm_static_fp8_quant(f8, x, w.half(), s, EPS)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Half"):
        vllm.fused_add_rms_norm_static_fp8_quant(f8, x, r.clone(), w.half(), s, EPS)
    vllm.rms_norm_static_fp8_quant(f8, x, w.float(), s, EPS)  # a float32 weight stays accepted (0a88d969's tests)
    with pytest.raises(RuntimeError, match=r"Expected out.is_contiguous\(\) to be true"):
        vllm.rms_norm_static_fp8_quant(torch.empty(256, 4, dtype=FP8).t(), x, w, s, EPS)
    with pytest.raises(RuntimeError, match=r"Expected residual.is_contiguous\(\) to be true"):
        vllm.fused_add_rms_norm_static_fp8_quant(f8, x, _x(4, 512)[:, :256], w, s, EPS)
    with pytest.raises(NotImplementedError, match="\"rms_norm_kernel_fp8_type\" not implemented for 'Float8_e5m2'"):
        vllm.rms_norm_static_fp8_quant(torch.empty(4, 256, dtype=torch.float8_e5m2), x, w, s, EPS)


def test_norm_ops_write_in_the_input_type():
    """``out.data_ptr<scalar_t>()`` / ``residual.data_ptr<scalar_t>()``: an ``out`` or residual of another dtype is
    refused (the old code cast into it)."""
    x = _x()
    w = torch.ones(256, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Float"):
        vllm.rms_norm(torch.empty(4, 256), x, w, EPS)
    with pytest.raises(RuntimeError, match="expected scalar type BFloat16 but found Half"):
        vllm.fused_add_rms_norm(x.clone(), _x().half(), w, EPS)


def test_static_scaled_fp8_quant_signature_has_group_shape():
    """The wrapper of ``torch.ops._C.static_scaled_fp8_quant`` takes its ``group_shape`` (the old one had none)."""
    params = inspect.signature(vllm.static_scaled_fp8_quant).parameters
    assert [(p.name, p.default) for p in params.values()][-1] == ("group_shape", None)
    assert list(params) == ["out", "input", "scale", "group_shape"]
