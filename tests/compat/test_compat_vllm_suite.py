"""tools/compat_suites.py's vLLM suite: its rewrite rules (on text of the upstream files' shape: no network) and the
test-only shim of vLLM's imports in tools/vllm_shim/ (run in a child process: its `vllm` and `tests` packages must
not meet this repository's `tests` package)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

VLLM_LIKE = textwrap.dedent(
    """
    CUDA_DEVICES = [
        f"cuda:{i}" for i in range(1 if torch.accelerator.device_count() == 1 else 2)
    ]


    def test_x(device):
        torch.accelerator.set_device_index(device)
        s = torch.tensor(1.0, device="cuda")
        torch.ops._C.rms_norm(out, x, w, 1e-6)
    """
)


def _cs():
    sys.path.insert(0, str(ROOT / "tools"))
    import compat_suites

    return compat_suites


def test_vllm_rules_rewrite_ops_and_device_only():
    cs = _cs()
    path = "tests/kernels/core/test_fused_quant_layernorm.py"
    text, done = cs.rewrite(VLLM_LIKE, cs.rules_for("vllm", path, "cpu", None, True))
    assert "CUDA_DEVICES = ['cpu']" in text and "cuda:" not in text
    assert "torch.ops.addnorm_vllm.rms_norm(out, x, w, 1e-6)" in text and "_C" not in text
    assert 'device="cpu"' in text and "set_device_index" not in text
    assert len(done) == 4
    # on a GPU the devices stay; only the ops are served by addnorm
    text, done = cs.rewrite(VLLM_LIKE, cs.rules_for("vllm", path, "cuda", None, True))
    assert 'f"cuda:{i}"' in text and "set_device_index(device)" in text and "torch.ops.addnorm_vllm." in text
    suite = cs.SUITES["vllm"]
    assert suite.shim == "tools/vllm_shim" and (ROOT / suite.shim / "vllm" / "_custom_ops.py").is_file()


SHIM_CHECK = textwrap.dedent(
    """
    import torch
    import vllm._custom_ops as ops
    import addnorm.compat.vllm
    from tests.kernels.utils import opcheck
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
    from vllm.model_executor.layers.quantization.utils.int8_utils import per_token_group_quant_int8

    assert ops.rms_norm_dynamic_per_token_quant is addnorm.compat.vllm.rms_norm_dynamic_per_token_quant
    torch.manual_seed(0)
    x, r = torch.randn(4, 128).bfloat16(), torch.randn(4, 128).bfloat16()
    layer = RMSNorm(128).to(torch.bfloat16)
    layer.weight.data.normal_(1.0, 0.1)
    h = x.float() + r.float()  # forward_native normalizes the float32 sum
    want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * layer.weight
    y, res = layer.forward_native(x, r)
    assert torch.equal(y, want) and torch.equal(res, h.bfloat16())
    xi, ri = x.clone(), r.clone()
    out, res = layer(xi, ri)  # the CUDA path: addnorm.compat.vllm, in place
    assert out is xi and res is ri and torch.equal(ri, x + r)

    g = torch.tensor([[0.5, -1.0, 0.26, 0.0]])
    q, s = per_token_group_quant_int8(g, 2)
    assert torch.equal(s, torch.tensor([[1.0 / 127, 0.26 / 127]]))
    assert q.tolist() == [[63, -127, 127, 0]]  # 63.5 -> 63: Triton's float-to-int conversion rounds toward zero
    q, s = per_token_group_quant_fp8(g, 4)
    assert torch.equal(s, torch.tensor([[1.0 / 448]])) and q.float()[0, 1] == -448

    f8 = torch.empty(4, 128, dtype=torch.float8_e4m3fn)
    result = opcheck(torch.ops.addnorm_vllm.rms_norm_static_fp8_quant, (f8, x, layer.weight.data, torch.tensor(0.1), 1e-6))
    assert set(result.values()) == {"SUCCESS"} and "test_schema" in result, result
    print("shim ok")
    """
)


def test_vllm_shim(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tools" / "vllm_shim"), str(ROOT / "src")]))
    r = subprocess.run(
        [sys.executable, "-c", SHIM_CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and "shim ok" in r.stdout, r.stderr[-3000:]
