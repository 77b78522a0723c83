"""benchmarks/bench_generate.py as users run it, at tiny sizes: every variant, the paired ratios, the same greedy
tokens, the profile line, the markdown file and --json; bad arguments refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_generate  # noqa: E402

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "128", "--prompt", "6", "--new", "3"]


def test_tiny_run_rows_tokens_profile_and_files(tmp_path, capsys):
    out = tmp_path / "generate.md"
    argv = [*TINY, "--batch", "1,2", "--dtype", "fp32", "--repeats", "2", "--json", "--out", str(out)]
    assert bench_generate.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["rows"]
    seen = {(r["family"], r["batch"], r["variant"]) for r in rows}
    assert seen == {(f, b, v) for f in ("llama", "gpt2") for b in (1, 2) for v in bench_generate.VARIANTS}
    for r in rows:
        assert r["same_tokens"] is True
        assert r["prefill_tok_s"] > 0 and r["decode_ms_per_token"] > 0
        lo, hi = r["decode_speedup_range"]
        assert lo <= r["decode_speedup"] <= hi
        if r["variant"] == "unpatched":
            assert r["decode_speedup"] == 1.0 and r["prefill_speedup"] == 1.0  # its own baseline
    assert len(result["profiles"]) == 4
    assert all(0 <= p["norm_share"] and 0 < p["add_share"] for p in result["profiles"])
    assert all(p["norm_modules"] == 2 * 2 + 1 for p in result["profiles"])  # two a layer and the final one
    text = out.read_text()
    assert "| llama | 1 | fp32 | fused |" in text and "| gpt2 | 2 | fp32 | norms |" in text
    assert "residual adds" in text and "round-robin" in text


def test_different_tokens_are_an_error(monkeypatch, capsys):
    real = bench_generate.generate_once

    def shifted(model, ids, new, sync, static):
        out, pre, dec = real(model, ids, new, sync, static)
        if model.__class__.__name__.startswith("Llama") and bench_generate.hf_is_applied(model):
            out = out.clone()
            out[:, -1] += 1  # a fused model that generated another token
        return out, pre, dec

    monkeypatch.setattr(bench_generate, "generate_once", shifted)
    argv = [*TINY, "--family", "llama", "--batch", "1", "--dtype", "fp32", "--repeats", "1", "--out", ""]
    assert bench_generate.main(argv) == 1
    assert "greedy tokens differ from the unpatched model's: llama b1 fp32 fused" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--new", "1"],
        ["--batch", "0"],
        ["--family", "opt"],
        ["--dtype", "fp16"],
        ["--hidden", "65"],
        ["--repeats", "0"],
    ],
)
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit) as e:
        bench_generate.main(argv)
    assert e.value.code == 2
