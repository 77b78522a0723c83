"""benchmarks/bench_quant.py runs end to end on a tiny shape and writes its table; its eager quantize is the
contract's conversion (so the unfused and eager contenders compute what the fused op does)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_quant  # noqa: E402

from addnorm.ops.quant.contract import quantize  # noqa: E402


def test_runs_and_writes_rows(tmp_path):
    out = tmp_path / "quant"
    rc = bench_quant.main(["--shapes", "8x256", "--reps", "3", "--no-compile", "--out", str(out), "--note", "t"])
    assert rc == 0
    data = json.loads(out.with_suffix(".json").read_text())
    got = {(r["mode"], r["contender"]) for r in data["rows"]}
    modes, names = ("static", "token", "group"), ("stream", "fused", "unfused", "eager")
    assert got == {(m, c) for m in modes for c in names}
    assert all(r["gb_s"] > 0 and r["p25_ms"] <= r["median_ms"] <= r["p75_ms"] for r in data["rows"])
    assert "| 8x256 | token | fused |" in out.with_suffix(".md").read_text()


def test_eager_quantize_is_the_contracts():
    y = torch.randn(4, 256) * 3
    scale = torch.tensor([0.01])
    for mode, group in (("static", None), ("token", 256), ("group", 128)):
        q, s = bench_quant.quantize_torch(y, mode, scale)
        q2, s2 = quantize(y, torch.float8_e4m3fn, scale if mode == "static" else None, group or 256, None)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
