"""tools/compat_suites.py (runs flash-attention's and Liger's own test files against addnorm.compat): its
rewrite rules on synthetic upstream-like files, and one end-to-end run on a tiny synthetic suite (no network).
Also torch.compile(fullgraph=True) of the composed paths behind the compat layers: the same values as eager."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import compat_suites as cs  # noqa: E402

from addnorm.compat import flash_attn as fa  # noqa: E402
from addnorm.ops.add_norm_multi import add_norm_multi  # noqa: E402

# the lines of flash-attention's test file the rules touch, with a line they must leave alone
FA_LIKE = """import torch
from einops import rearrange, repeat

from flash_attn.ops.triton.layer_norm import (
    layer_norm_fn,
)

is_sm8x = torch.cuda.get_device_capability("cuda")[0] >= 8


def test_x():
    device = "cuda"
    seqlen = 512
    other = "cuda"  # not a device line: stays
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        pass
"""


def test_flash_attn_rules_rewrite_imports_device_and_seqlen_only():
    text, done = cs.rewrite(FA_LIKE, cs.rules_for("flash-attn", "t.py", "cpu", 16, have_einops=False))
    assert "from addnorm.compat.flash_attn import (" in text and "flash_attn.ops" not in text
    assert "is_sm8x = True" in text  # a CPU runs bf16: the bf16 half of the grid runs
    assert '    device = "cpu"' in text and 'device_type="cpu"' in text
    assert "    seqlen = 16" in text
    assert 'other = "cuda"' in text  # only the listed rewrites happen
    assert "einops" not in text
    assert len(done) == 6 and all("(x1)" in line for line in done)


def test_flash_attn_rules_on_cuda_keep_the_device_and_einops_when_installed():
    text, done = cs.rewrite(FA_LIKE, cs.rules_for("flash-attn", "t.py", "cuda", None, have_einops=True))
    assert 'device = "cuda"' in text and "get_device_capability" in text and "seqlen = 512" in text
    assert "from einops import rearrange, repeat" in text
    assert "from addnorm.compat.flash_attn import (" in text


def test_a_rule_that_matches_nothing_stops_the_run():
    changed = FA_LIKE.replace("seqlen = 512", "seqlen = 1024")  # upstream changed: the seqlen rule does not fit
    with pytest.raises(ValueError, match="seqlen = 512 -> 16.*matched nothing"):
        cs.rewrite(changed, cs.rules_for("flash-attn", "t.py", "cpu", 16, have_einops=True))
    uses_einops = FA_LIKE + "    y = rearrange(x, 'b s d -> (b s) d')\n"
    with pytest.raises(ValueError, match="einops"):
        cs.rewrite(uses_einops, cs.rules_for("flash-attn", "t.py", "cpu", None, have_einops=False))


def test_liger_rules_rewrite_the_imports_and_the_device():
    test_file = (
        "from test.utils import supports_bfloat16\n"
        "from liger_kernel.ops import LigerFusedAddRMSNormFunction\n"
        "from liger_kernel.transformers.functional import liger_fused_add_rms_norm\n"
        "from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm\n"
        "from liger_kernel.utils import infer_device\n"
    )
    rel = "test/transformers/test_fused_add_rms_norm.py"
    text, _ = cs.rewrite(test_file, cs.rules_for("liger", rel, "cpu", None, have_einops=True))
    assert text.count("from addnorm.compat.liger import ") == 3 and "liger_kernel" not in text
    ns: dict = {}
    exec(text.split("from addnorm")[0] + text[text.index("def infer_device") :], ns)  # the two defs run
    assert ns["infer_device"]() == "cpu" and ns["supports_bfloat16"]() is True
    on_cuda, _ = cs.rewrite(test_file, cs.rules_for("liger", rel, "cuda", None, have_einops=True))
    assert "from test.utils import supports_bfloat16" in on_cuda and "return 'cuda'" in on_cuda
    conftest, _ = cs.rewrite(
        "from liger_kernel.utils import is_npu_available\n",
        cs.rules_for("liger", "test/conftest.py", "cpu", None, have_einops=True),
    )
    assert "def is_npu_available():" in conftest and "liger_kernel" not in conftest


def test_summary_splits_upstream_skips_from_missing_features():
    results = {
        "a": {"outcome": "passed"},
        "b": {"outcome": "skipped", "reason": "Skipped: Not supported"},
        "c": {"outcome": "skipped", "reason": "Skipped: addnorm lacks x1"},
        "d": {"outcome": "failed", "message": "NotImplementedError: rowscale"},
        "e": {"outcome": "failed", "message": "AssertionError"},
    }
    s = cs.summarize(results, 'pytest.skip("Not supported")')
    assert s["counts"] == {"passed": 1, "skipped": 2, "failed": 2}
    assert s["upstream_skips"] == {"Not supported": 1} and s["other_skips"] == {"addnorm lacks x1": 1}
    assert s["missing_feature"] == 2 and len(s["failures"]) == 2


# a synthetic flash-attention suite: the real calling convention at tiny sizes, an upstream skip, and a skip whose
# reason is not in the file (what a missing feature in addnorm looks like to the summary)
SYNTHETIC = """import pytest
import torch
from flash_attn.ops.triton.layer_norm import layer_norm_fn, layer_norm_ref

is_sm8x = torch.cuda.get_device_capability("cuda")[0] >= 8


@pytest.mark.parametrize("hidden_size", [8, 24])
@pytest.mark.parametrize("has_x1", [False, True])
def test_layer_norm(hidden_size, has_x1):
    if has_x1 and hidden_size == 8:
        pytest.skip("Not supported")
    device = "cuda"
    batch_size = 2
    seqlen = 512
    torch.random.manual_seed(0)
    x0 = torch.randn(batch_size, seqlen, hidden_size, device=device)
    x1 = torch.randn_like(x0) if has_x1 else None
    w, b = torch.randn(hidden_size, device=device), torch.randn(hidden_size, device=device)
    out, res = layer_norm_fn(x0, w, b, x1=x1, prenorm=True)
    assert res.shape == (batch_size, seqlen, hidden_size)
    torch.testing.assert_close(out, layer_norm_ref(x0, w, b, x1=x1))


def test_feature():
    pytest.skip("a missing " + "feature")


def test_other():
    assert False, "deselected by -k in the run below"
"""


def _synthetic_source(tmp_path):
    """A folder holding the synthetic suite where flash-attention keeps its test file, as --source takes it."""
    src = tmp_path / "fa"
    (src / "tests/ops/triton").mkdir(parents=True)
    (src / "tests/ops/triton/test_layer_norm.py").write_text(SYNTHETIC)
    (src / "SOURCE.json").write_text(json.dumps({"origin": "synthetic", "version": "abc123"}))
    return src


def test_end_to_end_on_a_synthetic_suite_from_a_local_folder(tmp_path, capsys):
    src = _synthetic_source(tmp_path)
    out = tmp_path / "summary.json"
    rc = cs.main(
        [
            "flash-attn",
            "--source",
            f"flash-attn={src}",
            "--seqlen",
            "4",
            "--hidden",
            "8",
            "--backend",
            "torch",
            "--cache",
            str(tmp_path / "cache"),
            "--json",
            str(out),
            "--",
            "-k",
            "not other",
        ]
    )
    assert rc == 1  # the non-upstream skip is a missing feature
    [s] = json.loads(out.read_text())
    assert s["version"] == "abc123" and s["backend"] == "torch"
    # --hidden 8 drops the two 24-wide cases, keeps the test without a hidden size
    assert s["counts"] == {"passed": 1, "skipped": 2} and s["deselected"] == 2
    assert s["upstream_skips"] == {"Not supported": 1} and s["other_skips"] == {"a missing feature": 1}
    assert s["missing_feature"] == 1
    assert any("seqlen = 512 -> 4" in r for r in s["rewrites"])
    assert s["files"]["tests/ops/triton/test_layer_norm.py"] == cs.sha256(src / "tests/ops/triton/test_layer_norm.py")
    assert "abc123" in capsys.readouterr().out
    assert s["not_run"] == 0  # what pytest's own -k deselects is neither run nor "not run"
    assert not (tmp_path / "cache").exists()  # a local folder is used as is, nothing fetched


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        cs.main(["flash-attn", "--source", "nope=/tmp"])
    assert "--source must be SUITE=DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cs.main(["liger", "--device", "cuda", "--backend", "cpu"])
    assert "--backend cpu runs on CPU tensors" in capsys.readouterr().err
    assert cs.main(["flash-attn", "--source", "flash-attn=/tmp"]) == 2  # no test file there: a clear error
    assert "missing tests/ops/triton/test_layer_norm.py" in capsys.readouterr().err


# ---- torch.compile(fullgraph=True) of the composed paths ------------------------------------------------------


def _compiled_equals_eager(fn, *inputs):
    """fn under torch.compile(fullgraph=True) gives eager's outputs and gradients (aot_eager: the traced graph
    itself, no Inductor code generation, so any difference is the tracing's)."""
    torch._dynamo.reset()
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eager = fn(*inputs)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*leaves)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)
    g_eager = torch.autograd.grad(sum(o.float().sum() for o in eager), [t for t in inputs if t.requires_grad])
    g_comp = torch.autograd.grad(sum(o.float().sum() for o in compiled), [t for t in leaves if t.requires_grad])
    for e, c in zip(g_eager, g_comp):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6)


def _inputs(n=32, rows=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    t = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return t(rows, n), t(rows, n), t(rows, n), t(n), t(n), t(n), t(n), torch.rand(rows, generator=g) + 0.5


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_compile_add_norm_multi_with_x1_rowscale_and_weight1(backend):
    x, r, x1, w, b, w1, b1, rowscale = _inputs()

    def f(x, r, x1, w, b, w1, b1):
        o = add_norm_multi(x, r, w, b, 1e-5, x1=x1, weight1=w1, bias1=b1, rowscale=rowscale, backend=backend)
        return o.out, o.residual_out, o.out1

    _compiled_equals_eager(f, x, r, x1, w, b, w1, b1)


def test_compile_flash_attn_compat_functions():
    x, r, x1, w, b, w1, b1, rowscale = _inputs()

    def f(x, r, x1, w, b, w1):
        y, y1, res = fa.layer_norm_fn(x, w, b, r, x1=x1, weight1=w1, prenorm=True, backend="cpu")
        z, res2 = fa.rms_norm_fn(x, w, b, r, rowscale=rowscale, prenorm=True, residual_in_fp32=True, backend="cpu")
        return y, y1, res, z, res2

    _compiled_equals_eager(f, x, r, x1, w, b, w1)


def test_compile_layer_norm_linear_fn():
    x, r, _, w, b, _, _, _ = _inputs()
    lw = torch.randn(48, 32, requires_grad=True)
    lb = torch.randn(48, requires_grad=True)

    def f(x, r, w, b, lw, lb):
        return fa.layer_norm_linear_fn(x, w, b, lw, lb, residual=r, prenorm=True, backend="cpu")

    _compiled_equals_eager(f, x, r, w, b, lw, lb)


def test_end_to_end_under_xdist_counts_the_same(tmp_path):
    # gpu_check.sh runs the upstream files with `-- -n 8`: the controller must record every case and the deselection
    pytest.importorskip("xdist")
    src = _synthetic_source(tmp_path)
    out = tmp_path / "summary.json"
    rc = cs.main(
        [
            "flash-attn",
            "--source",
            f"flash-attn={src}",
            "--seqlen",
            "4",
            "--hidden",
            "8",
            "--backend",
            "torch",
            "--cache",
            str(tmp_path / "cache"),
            "--json",
            str(out),
            "--",
            "-k",
            "not other",
            "-n",
            "2",
        ]
    )
    assert rc == 1
    [s] = json.loads(out.read_text())
    assert s["counts"] == {"passed": 1, "skipped": 2} and s["deselected"] == 2
    assert s["missing_feature"] == 1 and s["not_run"] == 0


def test_end_to_end_with_xdist_switched_off_counts_the_same(tmp_path):
    # `-- -p no:xdist` unregisters xdist: the harness's xdist hook must then be optional, not a collection error
    pytest.importorskip("xdist")
    src = _synthetic_source(tmp_path)
    out = tmp_path / "summary.json"
    args = ["flash-attn", "--source", f"flash-attn={src}", "--seqlen", "4", "--hidden", "8", "--backend", "torch"]
    args += ["--cache", str(tmp_path / "cache"), "--json", str(out), "--", "-k", "not other", "-p", "no:xdist"]
    assert cs.main(args) == 1
    [s] = json.loads(out.read_text())
    assert s["counts"] == {"passed": 1, "skipped": 2} and s["not_run"] == 0


def test_cases_not_run_say_why(capsys):
    base = {"counts": {"passed": 1}, "deselected": 0, "suite": "x", "origin": "o", "version": "v", "backend": "torch"}
    base |= {"device": "cpu", "missing_feature": 0, "wall_s": 1.0, "load_before": [0], "load_after": [0]}
    base |= {"upstream_skips": {}, "other_skips": {}, "failures": []}
    cs.print_summary(base | {"not_run": 3, "max_seconds": None, "pytest_exit": 4})
    assert "3 NOT RUN (pytest exit status 4)" in capsys.readouterr().out
    cs.print_summary(base | {"not_run": 3, "max_seconds": 60.0, "pytest_exit": 2})
    assert "3 NOT RUN (--max-seconds)" in capsys.readouterr().out
