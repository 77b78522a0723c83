"""Wide rows on a GPU only (skipped without CUDA; benchmarks/gpu_check.sh runs them): tensors past 2^31 elements
(every offset must be 64-bit) and the in-place ops on rows wider than the rows path, through the looped kernels and
through the team kernels (issue 28).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from addnorm import add_layer_norm, add_rms_norm, add_rms_norm_  # noqa: E402
from addnorm.ops.triton import launch as T  # noqa: E402
from addnorm.ops.triton import team_launch as W  # noqa: E402
from addnorm.testing import assert_close, oracle  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sizes past the interpreter)")

PATHS = {"default": W.WideTuning(enabled=False), "team": W.WideTuning(enabled=True)}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("n", [4096, 65536])
def test_more_than_2_31_elements(monkeypatch, path, n):
    """M * N > 2^31 elements of bf16 (4 GiB a tensor): the last rows, whose offsets overflow int32, are right."""
    if torch.cuda.get_device_properties(0).total_memory < 24 << 30:
        pytest.skip("needs about 18 GiB of GPU memory")
    monkeypatch.setattr(W, "wide_tuning", lambda: PATHS[path])
    m = (1 << 31) // n + 3
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        out, res = add_rms_norm(x, r, w, 1e-6, backend="triton")
    rows = torch.tensor([0, m // 2, m - 2, m - 1], device="cuda")
    ref = oracle(x[rows], r[rows], w, None, eps=1e-6, is_rms=True)
    assert_close(out[rows], ref["out"], "out")
    assert_close(res[rows], ref["residual_out"], "residual_out")


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("n", [16384 + 8, 65536, 262144])
def test_in_place_on_wide_rows(monkeypatch, path, n):
    """add_rms_norm_ writes x and residual while reading them: past the rows path (the looped kernel re-reads
    residual_out in its second pass; the team kernels hold the chunk) it must equal the out-of-place op bit for
    bit."""
    monkeypatch.setattr(W, "wide_tuning", lambda: PATHS[path])
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(33, n, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(33, n, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        out, res = add_rms_norm(x, r, w, 1e-6, backend="triton")
        xi, ri = add_rms_norm_(x.clone(), r.clone(), w, 1e-6, backend="triton")
    assert torch.equal(ri, res) and torch.equal(xi, out)


@pytest.mark.parametrize("path", ["sized_grids", "team"])
def test_wide_backward_against_the_oracle(monkeypatch, path):
    """The looped backward with its row groups sized from the compiled kernel (WideTuning.sized_grids), and the
    team backward, at N = 65536: every gradient against the float64 oracle."""
    tuning = W.WideTuning(**{"sized_grids" if path != "team" else "enabled": True})
    monkeypatch.setattr(W, "wide_tuning", lambda: tuning)
    seen = []
    kernel = T.bwd_tiles_kernel

    class Spy:
        warmup = kernel.warmup  # what resident_programs compiles the kernel with

        def __getitem__(self, grid):
            seen.append(grid)
            return kernel[grid]

    monkeypatch.setattr(T, "bwd_tiles_kernel", Spy())
    m, n = 300, 65536
    g = torch.Generator(device="cuda").manual_seed(2)
    x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in "xr")
    w = (1 + 0.5 * torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)).requires_grad_()
    b = (0.5 * torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)).requires_grad_()
    out, res = add_layer_norm(x, r, w, b, 1e-5, backend="triton")
    dout, dres = torch.randn_like(out), torch.randn_like(res)
    torch.autograd.backward((out, res), (dout, dres))
    ref = oracle(x, r, w, b, eps=1e-5, is_rms=False, dout=dout, dresidual_out=dres)
    assert_close(out, ref["out"], "out")
    for name, t in (("dx", x), ("dresidual", r)):
        assert_close(t.grad, ref[name], name, grad=True)
    assert_close(w.grad, ref["dweight"], "dweight", grad=True, reduced_rows=m)
    assert_close(b.grad, ref["dbias"], "dbias", grad=True, reduced_rows=m)
    if path == "sized_grids":  # 16 tiles of 4096; the groups fill whole waves of what the GPU holds
        ((tiles, groups),) = seen
        assert tiles == 16 and groups * tiles <= 4 * torch.cuda.get_device_properties(0).multi_processor_count
    else:
        assert seen == []  # the team backward: no tiles kernel
