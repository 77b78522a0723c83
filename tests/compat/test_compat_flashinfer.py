"""addnorm.compat.flashinfer: flashinfer.norm's names, argument orders, defaults and in-place conventions, each
function against the addnorm op it stands for, on every backend; and tools/compat_suites.py's rewrite rules for
FlashInfer's own tests/utils/test_norm.py (on a synthetic file of its shape: no network)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch

import addnorm
import addnorm.compat.flashinfer as fi
from tests.ops.quant_oracle import ALL, skip_unavailable

ROOT = Path(__file__).resolve().parents[2]

# flashinfer.norm's signatures (parameter names in order, and defaults), as flashinfer/norm/__init__.py at
# flashinfer-ai/flashinfer@09928cf3 has them: rmsnorm and fused_add_rmsnorm default weight to None, and
# layernorm_quant takes no enable_pdl
SIGNATURES = {
    "rmsnorm": ("input", "weight=None", "eps=1e-06", "out=None", "enable_pdl=None"),
    "gemma_rmsnorm": ("input", "weight", "eps=1e-06", "out=None", "enable_pdl=None"),
    "fused_add_rmsnorm": ("input", "residual", "weight=None", "eps=1e-06", "enable_pdl=None"),
    "gemma_fused_add_rmsnorm": ("input", "residual", "weight", "eps=1e-06", "enable_pdl=None"),
    "layernorm": ("input", "gemma", "beta", "eps=1e-06"),
    "rmsnorm_quant": ("out", "input", "weight", "scale", "eps=1e-06", "enable_pdl=None"),
    "fused_add_rmsnorm_quant": ("out", "input", "residual", "weight", "scale", "eps=1e-06", "enable_pdl=None"),
    "layernorm_quant": ("out", "input", "gemma", "beta", "scale", "eps=1e-06"),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_signatures_are_flashinfers(name):
    params = inspect.signature(getattr(fi, name)).parameters.values()
    got = tuple(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in params)
    assert got == SIGNATURES[name]
    assert getattr(fi.norm, name) is getattr(fi, name)  # flashinfer.norm.X and flashinfer.X


def _inputs(shape=(5, 200), dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, r, w


@pytest.fixture(params=ALL)
def backend(request, monkeypatch):
    skip_unavailable(request.param)
    monkeypatch.setenv("ADDNORM_BACKEND", request.param)  # the compat functions take no backend argument
    return request.param


def test_rmsnorm_family(backend):
    x, r, w = _inputs()
    assert torch.equal(fi.rmsnorm(x, w), addnorm.rms_norm(x, w, 1e-6, backend=backend))
    out = torch.empty_like(x)
    assert fi.rmsnorm(x, w, out=out, enable_pdl=True) is out and torch.equal(out, fi.rmsnorm(x, w))
    x3 = torch.randn(3, 8, 64).to(torch.bfloat16)[:, :4]  # (batch, heads, head_dim) with strided heads: qk-norm
    assert torch.equal(fi.rmsnorm(x3, w[:64]), addnorm.rms_norm(x3, w[:64], 1e-6, backend=backend))
    gem = addnorm.add_rms_norm(x, None, w, 1e-6, zero_centered_weight=True, backend=backend)[0]
    assert torch.equal(fi.gemma_rmsnorm(x, w), gem)


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_in_place(backend, gemma):
    """FlashInfer's kernels normalize the float32 sum before it is rounded into residual (as its reference does)."""
    x, r, w = _inputs()
    h = x.float() + r.float()
    out = addnorm.add_rms_norm(h, None, w, 1e-6, zero_centered_weight=gemma, out_dtype=x.dtype, backend=backend)[0]
    res = x + r
    xi, ri = x.clone(), r.clone()
    fn = fi.gemma_fused_add_rmsnorm if gemma else fi.fused_add_rmsnorm
    assert fn(xi, ri, w, 1e-6) is None
    assert torch.equal(xi, out) and torch.equal(ri, res)


def test_layernorm_with_fp32_gamma_beta(backend):
    x, _, _ = _inputs()
    g, b = torch.randn(200), torch.randn(200)
    assert torch.equal(fi.layernorm(x, g, b), addnorm.layer_norm(x, g, b, 1e-6, backend=backend))


@pytest.mark.parametrize("scale", [torch.tensor(0.05), torch.tensor([0.05], dtype=torch.float64)], ids=str)
def test_quant_ops(backend, scale):
    x, r, w = _inputs()
    s32 = torch.tensor([0.05])
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    assert fi.rmsnorm_quant(q, x, w, scale) is None
    want = addnorm.add_rms_norm_quant(x, None, w, 1e-6, scale=s32, backend=backend)[0]
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    # fused add: residual updated in place, input only read; out's dtype picks the format
    q = torch.empty(x.shape, dtype=torch.float8_e5m2)
    xi, ri = x.clone(), r.clone()
    fi.fused_add_rmsnorm_quant(q, xi, ri, w, scale)
    h = x.float() + r.float()  # the float32 sum is normalized, its rounding stored (FlashInfer's kernels)
    want = addnorm.add_rms_norm_quant(h, None, w, 1e-6, scale=s32, quant_dtype=torch.float8_e5m2, backend=backend)[0]
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and torch.equal(ri, x + r) and torch.equal(xi, x)
    # layernorm_quant: FlashInfer's kernel rounds LayerNorm's output to bf16, then divides by the scale
    g, b = torch.randn(200), torch.randn(200)
    fi.layernorm_quant(q, x, g, b, scale)
    y = addnorm.layer_norm(x, g, b, 1e-6, backend=backend).float()
    want = (y / s32).clamp(-57344, 57344).to(torch.float8_e5m2)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


def test_float_scale_gives_flashinfers_future_warning():
    x, _, w = _inputs()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    with pytest.warns(FutureWarning, match="float scale is deprecated"):
        fi.rmsnorm_quant(q, x, w, 0.05)
    want = torch.empty_like(q)
    fi.rmsnorm_quant(want, x, w, torch.tensor([0.05]))
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("scale", [torch.ones(2), torch.ones(1, 1)], ids=["two", "1x1"])
def test_scale_not_scalar_or_one_element_vector_is_refused(scale):
    x, _, w = _inputs()
    with pytest.raises(ValueError, match="scale must be a scalar tensor or shape"):
        fi.rmsnorm_quant(torch.empty(x.shape, dtype=torch.float8_e4m3fn), x, w, scale)


def test_refuses_what_flashinfer_refuses():
    """Each call here runs on addnorm's own functions (which accept it) but fails on FlashInfer."""
    x, r, w = _inputs()
    g, b = torch.randn(200), torch.randn(200)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.tensor([0.05])
    with pytest.raises(RuntimeError, match="input must be bfloat16"):
        fi.layernorm_quant(q, x.half(), g, b, s)
    with pytest.raises(RuntimeError, match="input must be bfloat16"):
        fi.layernorm(x.half(), g, b)
    with pytest.raises(RuntimeError, match="gamma must be float32"):
        fi.layernorm(x, g.bfloat16(), b)
    with pytest.raises(RuntimeError, match="input must be contiguous"):
        fi.layernorm_quant(q, torch.randn(5, 400).bfloat16()[:, :200], g, b, s)
    with pytest.raises(RuntimeError, match="out must be float8_e4m3fn or float8_e5m2"):
        fi.rmsnorm_quant(torch.empty(x.shape, dtype=torch.int8), x, w, s)
    with pytest.raises(RuntimeError, match="out must have input's dtype"):
        fi.rmsnorm(x, w, out=torch.empty(x.shape))  # silently cast to fp32 before
    with pytest.raises(RuntimeError, match="input must be float16 or bfloat16"):
        fi.rmsnorm(x.float(), w.float())
    with pytest.raises(RuntimeError, match="residual must have input's dtype"):
        fi.fused_add_rmsnorm(x, r.float(), w)
    with pytest.raises(RuntimeError, match="Unsupported input dimension: 3"):
        fi.rmsnorm_quant(q.view(5, 2, 100), x.view(5, 2, 100), w[:100], s)
    # the core API keeps accepting them
    assert addnorm.add_layer_norm_quant(x.half(), None, g, b, 1e-6, scale=s)[0].dtype == torch.float8_e4m3fn
    assert addnorm.rms_norm(x.float(), w.float(), 1e-6).dtype == torch.float32


def test_weightless_rmsnorm(backend):
    x, r, _ = _inputs()
    assert torch.equal(fi.rmsnorm(x, None), addnorm.rms_norm(x, None, 1e-6, backend=backend))
    xi, ri = x.clone(), r.clone()
    fi.fused_add_rmsnorm(xi, ri, None)
    out = addnorm.add_rms_norm(x.float() + r.float(), None, None, 1e-6, out_dtype=x.dtype, backend=backend)[0]
    assert torch.equal(xi, out) and torch.equal(ri, x + r)


def test_device_support_pdl_is_false_off_hopper():
    assert fi.device_support_pdl(torch.device("cpu")) is False


# --------------------------------------------------------------------------------------------------------------
# tools/compat_suites.py's rules for FlashInfer's test file
# --------------------------------------------------------------------------------------------------------------

FI_LIKE = """import torch

import flashinfer
from flashinfer.jit import env as jit_env
from flashinfer.jit.core import gen_jit_spec
from flashinfer.utils import device_support_pdl


def test_norm():
    x = torch.randn(3, 4).to(0).to(torch.float16)
    y = torch.randn(3, 4, device="cuda")
    other = "cuda"  # not a device argument: stays
    flashinfer.norm.rmsnorm(x, y)
    from flashinfer.trace import default_check
"""


def test_compat_suites_flashinfer_rules():
    sys.path.insert(0, str(ROOT / "tools"))
    import compat_suites as cs

    text, done = cs.rewrite(FI_LIKE, cs.rules_for("flashinfer", "tests/utils/test_norm.py", "cpu", None, True))
    assert "import addnorm.compat.flashinfer as flashinfer" in text
    assert "from addnorm.compat.flashinfer import device_support_pdl" in text
    assert "jit_env = gen_jit_spec = None" in text and "flashinfer.jit" not in text
    assert "    from _addnorm_flashinfer_trace import default_check" in text and "flashinfer.trace" not in text
    assert '.to("cpu")' in text and 'device="cpu"' in text and 'other = "cuda"' in text
    assert len(done) == 6
    suite = cs.SUITES["flashinfer"]
    big = {f"test_{op}_contiguous_overflow" for op in ("rmsnorm", "gemma_rmsnorm", "rmsnorm_quant", "layernorm")}
    big |= {f"test_{op}_contiguous_overflow" for op in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm")}
    big |= {"test_fused_add_rmsnorm_quant_contiguous_overflow", "test_qk_rmsnorm_contiguous_overflow"}
    assert {name for name, _ in cs._deselected(suite, "cpu")} == {
        "test_rmsnorm_int64_stride",
        "test_rmsnorm_quant_int64_stride",
        "test_fused_add_rmsnorm_int64_stride",
        "test_fused_add_rmsnorm_quant_int64_stride",
        "test_norm_compilation_without_fp8",
        *big,
    }
    assert all(why for _, why, _ in suite.deselect)
    # on a GPU the 4 GB stride tests run; FlashInfer's nvcc build stays out
    assert [name for name, _ in cs._deselected(suite, "cuda")] == ["test_norm_compilation_without_fp8"]


def test_compat_suites_flashinfer_trace_shim(tmp_path, monkeypatch):
    """The shim of flashinfer.trace.default_check: FP8 tolerance 0.1, a budget of mismatching elements in per cent,
    an optional cosine-similarity floor, exact comparison of other dtypes."""
    sys.path.insert(0, str(ROOT / "tools"))
    import compat_suites as cs

    (tmp_path / "fi_trace_shim.py").write_text(cs.FLASHINFER_TRACE_SHIM)
    monkeypatch.syspath_prepend(str(tmp_path))
    from fi_trace_shim import default_check

    ref = torch.linspace(-4, 4, 1000).to(torch.float8_e4m3fn)
    off = ref.float().clone()
    off[:5] += 1.0  # 0.5 % of the elements far off
    off = off.to(torch.float8_e4m3fn)
    assert default_check([ref], [off], max_mismatch_pct=1.0, min_cos_sim=None)
    assert not default_check([ref], [off], max_mismatch_pct=0.1, min_cos_sim=None)
    assert not default_check([ref], [-ref.float()], max_mismatch_pct=100.0)  # cosine -1
    assert not default_check([ref], [ref[:10]])
    i = torch.arange(10)
    assert default_check(i, i) and not default_check(i, i + 1)


def test_rmsnorm_and_fused_add_default_to_no_weight():
    """``rmsnorm(x)`` and ``fused_add_rmsnorm(x, r)`` run without a weight (flashinfer/norm/__init__.py at
    09928cf3: ``weight: Optional[Tensor] = None``), the same as an explicit ``weight=None``."""
    x = torch.randn(4, 64).to(torch.bfloat16)
    torch.testing.assert_close(fi.rmsnorm(x), fi.rmsnorm(x, None, 1e-6), rtol=0, atol=0)
    a, ra, b, rb = x.clone(), x.clone() * 2, x.clone(), x.clone() * 2
    fi.fused_add_rmsnorm(a, ra)
    fi.fused_add_rmsnorm(b, rb, None, 1e-6)
    assert torch.equal(a, b) and torch.equal(ra, rb)
    assert torch.equal(ra, (x.float() * 3).to(torch.bfloat16))


def test_layernorm_quant_takes_no_enable_pdl():
    """FlashInfer's ``layernorm_quant`` (flashinfer/norm/__init__.py at 09928cf3) has no ``enable_pdl``: passing it
    there is a TypeError, so it is one here."""
    x = torch.randn(4, 64).to(torch.bfloat16)
    g, b, out = torch.ones(64), torch.zeros(64), torch.empty(4, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="enable_pdl"):
        fi.layernorm_quant(out, x, g, b, torch.tensor(1.0), 1e-6, enable_pdl=False)
    with pytest.raises(TypeError):
        fi.layernorm_quant(out, x, g, b, torch.tensor(1.0), 1e-6, False)


def _t(t):
    """t's values in a layout whose last dimension has stride 2."""
    return torch.stack([t, t], dim=-1)[..., 0]


def test_last_dim_strides_are_refused_as_flashinfer_refuses_them():
    """csrc/norm.cu at 09928cf3 checks every tensor with ``CHECK_LAST_DIM_CONTIGUOUS_INPUT`` (stride(-1) == 1; the
    message glues the argument's name to "must be contiguous at last dimension"); row strides stay accepted."""
    x, w = torch.randn(4, 64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    g, b = torch.ones(64), torch.zeros(64)
    q, s = torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.tensor(1.0)
    cases = [
        ("input", lambda: fi.rmsnorm(_t(x), w)),
        ("weight", lambda: fi.rmsnorm(x, _t(w))),
        ("out", lambda: fi.rmsnorm(x, w, out=_t(torch.empty_like(x)))),
        ("input", lambda: fi.gemma_rmsnorm(_t(x), w)),
        ("residual", lambda: fi.fused_add_rmsnorm(x.clone(), _t(x.clone()), w)),
        ("input", lambda: fi.gemma_fused_add_rmsnorm(_t(x.clone()), x.clone(), w)),
        ("input", lambda: fi.layernorm(_t(x), g, b)),
        ("gamma", lambda: fi.layernorm(x, _t(g), b)),
        ("output", lambda: fi.rmsnorm_quant(_t(q), x, w, s)),
        ("output", lambda: fi.fused_add_rmsnorm_quant(_t(q), x, x.clone(), w, s)),
        ("beta", lambda: fi.layernorm_quant(q, x, g, _t(b), s)),
    ]
    for name, call in cases:
        with pytest.raises(RuntimeError, match=f"^{name}must be contiguous at last dimension"):
            call()
    wide = torch.randn(4, 128).to(torch.bfloat16)[:, :64]  # a row stride: accepted there and here
    torch.testing.assert_close(fi.rmsnorm(wide, w), fi.rmsnorm(wide.contiguous(), w), rtol=0, atol=0)


def test_weight_of_another_dtype_or_missing_is_refused():
    """FlashInfer's RMSNorm kernels (csrc/norm.cu at 09928cf3) read the weight through a pointer of the input's
    type, unconverted: a float32 weight with bf16 input would be misread there, so it is refused here. The gemma
    and quant bindings take a weight tensor, not None."""
    x, w = torch.randn(4, 64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    q, s = torch.empty(4, 64, dtype=torch.float8_e4m3fn), torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="weight must have input's dtype"):
        fi.rmsnorm(x, w.float())
    with pytest.raises(RuntimeError, match="weight must have input's dtype"):
        fi.fused_add_rmsnorm(x.clone(), x.clone(), w.float())
    with pytest.raises(RuntimeError, match="weight must have input's dtype"):
        fi.rmsnorm_quant(q, x, w.half(), s)
    with pytest.raises(RuntimeError, match="weight must be a tensor"):
        fi.rmsnorm_quant(q, x, None, s)
    with pytest.raises(RuntimeError, match="weight must be a tensor"):
        fi.gemma_rmsnorm(x, None)
