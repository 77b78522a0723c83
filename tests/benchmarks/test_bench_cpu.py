"""The CPU benchmark scripts as users run them: bench_cpu.py (in-place rows, --out ''), bench_overhead.py, and
tools/gpu_graph_check.py's refusal without a GPU. Tiny shapes, one repetition."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_cpu  # noqa: E402
import bench_overhead  # noqa: E402
import compare_sources  # noqa: E402


def test_bench_cpu_has_in_place_rows_and_out_empty_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert bench_cpu.main(["--shapes", "4x64", "--dtypes", "fp32", "--reps", "1", "--no-compile", "--out", ""]) == 0
    assert list(tmp_path.iterdir()) == []  # '' means: write nothing (it used to write into the current folder)
    table = capsys.readouterr().out
    assert "| fp32 | 4x64 | fwd | addnorm in-place |" in table
    assert "load average before" in table


def test_bench_cpu_writes_csv_and_json_with_the_allocator_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    assert (
        bench_cpu.main(["--shapes", "4x64", "--dtypes", "fp32", "--reps", "1", "--no-compile", "--out", str(tmp_path)])
        == 0
    )
    data = json.loads((tmp_path / "cpu.json").read_text())
    assert data["env"]["allocator"] == {"MALLOC_MMAP_MAX_": "0"}
    modes = {(r["mode"], r["contender"]) for r in data["rows"]}
    assert ("fwd", "addnorm in-place") in modes and ("fwd+bwd", "addnorm cpu") in modes
    fb = next(r for r in data["rows"] if r["mode"] == "fwd+bwd" and r["contender"] == "eager")
    assert fb["gbps"] == pytest.approx(8 * 4 * 64 * 4 / (fb["ms"] / 1e3) / 1e9, rel=1e-6)  # 8 passes of M x N
    assert (tmp_path / "cpu.csv").read_text().startswith("dtype,m,n,norm,mode,contender")


def test_bench_cpu_times_only_the_named_contenders_and_the_stream(capsys):
    args = ["--shapes", "2x32", "--dtypes", "fp32", "--reps", "1", "--no-compile", "--out", "", "--json"]
    assert bench_cpu.main([*args, "--contenders", "addnorm kernel,eager"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["mode"], r["contender"]) for r in rows} == {
        ("fwd", "stream"),
        ("fwd", "addnorm kernel"),
        ("fwd", "eager"),
        ("fwd+bwd", "eager"),
    }


def test_compare_sources_runs_both_trees_and_tabulates_the_ratio(capsys):
    src = str(ROOT / "src")
    bench = ["--shapes", "2x32", "--dtypes", "fp32", "--reps", "1", "--no-compile", "--contenders", "addnorm kernel"]
    assert compare_sources.main(["--a", src, "--b", src, "--rounds", "1", "--", *bench]) == 0
    table = capsys.readouterr().out
    assert "| dtype | M x N | norm | mode | contender | A best ms | B best ms | B / A |" in table
    assert "| fp32 | 2x32 | rms | fwd | addnorm kernel |" in table
    assert "| fp32 | 2x32 | rms | fwd | stream |" in table and "eager" not in table


def test_bench_overhead_rows_and_files(tmp_path, capsys):
    assert bench_overhead.main(["--shapes", "2x32", "--reps", "1", "--inner", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "overhead.json").read_text())
    names = {(r["mode"], r["contender"]) for r in data["rows"]}
    for expected in [
        ("inference", "eager"),
        ("inference", "addnorm cpu"),
        ("inference", "in-place cpu"),
        ("inference", "kernel cpu"),
        ("train", "addnorm torch"),
        ("train", "addnorm cpu"),
    ]:
        assert expected in names
    assert all(r["x_eager"] > 0 for r in data["rows"] if r["mode"] != "decode")
    assert {r["mode"] for r in data["rows"]} == {"inference", "train", "decode"}  # decode rows by default on CPU
    assert next(r for r in data["rows"] if r["contender"] == "eager")["x_eager"] == 1.0
    text = (tmp_path / "overhead.md").read_text()
    assert "load average before" in text and "target: kernel route <= 3x eager" in text
    assert "addnorm triton" not in text  # the interpreter's cost is not addnorm's overhead: no triton rows on CPU


def test_bench_overhead_triton_python_only_rows_launch_nothing(capsys):
    """--triton-python-only: the Triton route's rows, its launches no-ops while timed and real again afterwards."""
    from addnorm.ops import backends

    if backends.unavailable_reason("triton", torch.device("cpu")) is not None:
        pytest.skip(backends.unavailable_reason("triton", torch.device("cpu")))
    from addnorm.ops.triton import launch as T

    real = T._kernel
    assert (
        bench_overhead.main(
            ["--shapes", "2x32", "--reps", "1", "--inner", "2", "--out", "", "--json", "--triton-python-only"]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)["rows"]
    names = {(r["mode"], r["contender"]) for r in rows}
    for expected in [
        ("inference", "addnorm triton (no-op kernels)"),
        ("inference", "kernel triton (no-op kernels)"),
        ("train", "addnorm triton (no-op kernels)"),
    ]:
        assert expected in names
    assert T._kernel is real
    with pytest.raises(SystemExit):
        bench_overhead.main(["--triton-python-only", "--device", "cuda", "--out", ""])


def test_bench_overhead_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bench_overhead.main(["--shapes", "8x0"])
    with pytest.raises(SystemExit):
        bench_overhead.main(["--reps", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_graph_check_says_it_needs_a_gpu():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_graph_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


def test_bench_overhead_decode_rows_pair_each_contender_with_its_baseline(capsys):
    argv = ["--decode-only", "--decode-shapes", "1x64", "--reps", "2", "--inner", "2", "--out", "", "--json"]
    assert bench_overhead.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    by = {r["contender"]: r for r in rows}
    for name in ("eager", "addnorm auto", "addnorm torch", "addnorm cpu", "in-place auto", "module"):
        assert by[name]["baseline"] == "eager" and by[name]["dtype"] == "bf16" and by[name]["mode"] == "decode"
    assert by["addnorm layer_norm auto"]["baseline"] == "eager layer_norm"
    for r in rows:
        lo, hi = r["x_baseline_range"]
        assert lo <= r["x_baseline"] <= hi
        if r["contender"] == r["baseline"]:
            assert r["x_baseline"] == 1.0


def test_bench_overhead_compare_runs_both_sides(capsys):
    src = str(ROOT / "src")
    argv = ["--decode-only", "--decode-shapes", "1x64", "--reps", "1", "--inner", "2", "--out", ""]
    assert bench_overhead.main([*argv, "--compare-with", src, "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    assert f"Before (`PYTHONPATH={src}`)" in text and "| 1x64 | in-place auto |" in text
    with pytest.raises(SystemExit):
        bench_overhead.main([*argv, "--compare-with", str(ROOT / "docs")])
