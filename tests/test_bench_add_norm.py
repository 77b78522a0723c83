"""Smoke test of the add + norm benchmark CLI on CPU (tiny sizes; numbers are not checked, the files are)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_add_norm.py"
sys.path.insert(0, str(SCRIPT.parent))
import bench_add_norm  # noqa: E402


def test_quick_cpu_run_writes_csv_and_json(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--providers", "eager", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(open(tmp_path / "add_rms_norm_fp32_cpu.csv")))
    assert {(r["mode"], r["n"]) for r in rows} == {(m, n) for m in ("fwd", "bwd", "fwd+bwd") for n in ("512", "2048")}
    assert all(float(r["ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)
    meta = json.load(open(tmp_path / "add_rms_norm_fp32_cpu.json"))
    assert meta["copy_gbps"] > 0 and meta["versions"]["torch"] == torch.__version__ and meta["date"]


def test_count_bytes_napkin_math():
    m, n = 1024, 4096
    # bf16 add + RMSNorm: forward moves 4 MN x 2 bytes plus the weight and fp32 rstd
    assert bench_add_norm.count_bytes("addnorm", "fwd", m, n, torch.bfloat16, "rms") == 8 * m * n + 2 * n + 4 * m
    fwd_bwd = bench_add_norm.count_bytes("eager", "fwd+bwd", m, n, torch.bfloat16, "layer")
    parts = sum(bench_add_norm.count_bytes("eager", mode, m, n, torch.bfloat16, "layer") for mode in ("fwd", "bwd"))
    assert fwd_bwd == parts


def test_unknown_provider_is_rejected():
    with pytest.raises(SystemExit):
        bench_add_norm.parse_args(["--device", "cpu", "--providers", "nope"])
