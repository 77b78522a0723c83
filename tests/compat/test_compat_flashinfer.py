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

# flashinfer.norm's signatures (parameter names in order, and defaults), as its documentation gives them
SIGNATURES = {
    "rmsnorm": ("input", "weight", "eps=1e-06", "out=None", "enable_pdl=None"),
    "gemma_rmsnorm": ("input", "weight", "eps=1e-06", "out=None", "enable_pdl=None"),
    "fused_add_rmsnorm": ("input", "residual", "weight", "eps=1e-06", "enable_pdl=None"),
    "gemma_fused_add_rmsnorm": ("input", "residual", "weight", "eps=1e-06", "enable_pdl=None"),
    "layernorm": ("input", "gemma", "beta", "eps=1e-06"),
    "rmsnorm_quant": ("out", "input", "weight", "scale", "eps=1e-06", "enable_pdl=None"),
    "fused_add_rmsnorm_quant": ("out", "input", "residual", "weight", "scale", "eps=1e-06", "enable_pdl=None"),
    "layernorm_quant": ("out", "input", "gemma", "beta", "scale", "eps=1e-06", "enable_pdl=None"),
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
    x, r, w = _inputs()
    out, res = addnorm.add_rms_norm(x, r, w, 1e-6, zero_centered_weight=gemma, backend=backend)
    xi, ri = x.clone(), r.clone()
    fn = fi.gemma_fused_add_rmsnorm if gemma else fi.fused_add_rmsnorm
    assert fn(xi, ri, w, 1e-6) is None
    assert torch.equal(xi, out) and torch.equal(ri, res)


def test_layernorm_with_fp32_gamma_beta(backend):
    x, _, _ = _inputs()
    g, b = torch.randn(200), torch.randn(200)
    assert torch.equal(fi.layernorm(x, g, b), addnorm.layer_norm(x, g, b, 1e-6, backend=backend))


@pytest.mark.parametrize("scale", [0.05, torch.tensor(0.05), torch.tensor([0.05], dtype=torch.float64)], ids=str)
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
    want, res, _ = addnorm.add_rms_norm_quant(x, r, w, 1e-6, scale=s32, quant_dtype=torch.float8_e5m2, backend=backend)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and torch.equal(ri, res) and torch.equal(xi, x)
    g, b = torch.randn(200), torch.randn(200)
    fi.layernorm_quant(q, x, g, b, scale)
    want = addnorm.add_layer_norm_quant(x, None, g, b, 1e-6, scale=s32, quant_dtype=torch.float8_e5m2, backend=backend)
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8))


def test_scale_of_more_than_one_element_is_refused():
    x, _, w = _inputs()
    with pytest.raises(ValueError, match="scale must be a scalar tensor or shape"):
        fi.rmsnorm_quant(torch.empty(x.shape, dtype=torch.float8_e4m3fn), x, w, torch.ones(2))


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
"""


def test_compat_suites_flashinfer_rules():
    sys.path.insert(0, str(ROOT / "tools"))
    import compat_suites as cs

    text, done = cs.rewrite(FI_LIKE, cs.rules_for("flashinfer", "tests/utils/test_norm.py", "cpu", None, True))
    assert "import addnorm.compat.flashinfer as flashinfer" in text
    assert "from addnorm.compat.flashinfer import device_support_pdl" in text
    assert "jit_env = gen_jit_spec = None" in text and "flashinfer.jit" not in text
    assert '.to("cpu")' in text and 'device="cpu"' in text and 'other = "cuda"' in text
    assert len(done) == 5
    suite = cs.SUITES["flashinfer"]
    assert {name for name, _ in cs._deselected(suite, "cpu")} == {
        "test_rmsnorm_int64_stride",
        "test_rmsnorm_quant_int64_stride",
        "test_fused_add_rmsnorm_int64_stride",
        "test_fused_add_rmsnorm_quant_int64_stride",
        "test_norm_compilation_without_fp8",
    }
    assert all(why for _, why, _ in suite.deselect)
    # on a GPU the 4 GB stride tests run; FlashInfer's nvcc build stays out
    assert [name for name, _ in cs._deselected(suite, "cuda")] == ["test_norm_compilation_without_fp8"]
