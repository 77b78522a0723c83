"""The add + norm benchmark on CPU: a CLI smoke run (numbers not checked, the files are), the napkin math, and the
wiring of every third-party provider against fake modules with that project's API; and tools/tune_triton.py, the
block-size sweep built on the benchmark's timing code."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_add_norm.py"
sys.path.insert(0, str(SCRIPT.parent))
sys.path.insert(0, str(ROOT / "tools"))  # tune_triton.py
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
    # backward: read dout, dresidual_out, residual_out, write dx once (it is also dresidual): 4 MN x 2 bytes,
    # plus the weight read and dweight written, and the fp32 rstd read (issue 28: it used to charge two writes)
    assert bench_add_norm.count_bytes("addnorm", "bwd", m, n, torch.bfloat16, "rms") == 8 * m * n + 4 * n + 4 * m


def test_unknown_provider_is_rejected():
    with pytest.raises(SystemExit):
        bench_add_norm.parse_args(["--device", "cpu", "--providers", "nope"])


# ---------------------------------------------------------------------------------------------------------------
# Third-party providers against fake modules
# ---------------------------------------------------------------------------------------------------------------
# None of Liger, Apex, flash-attention or QuACK runs on a CPU, so each is replaced by a minimal module with the
# public signature and return convention read from the project's source (see the comments in make_provider),
# computed with plain torch. A provider wired wrongly (argument order, missing prenorm, its own ones-weight, no bias,
# a wrong eps) then fails here instead of on the GPU. Each fake records its calls so the keyword arguments that do
# not show in the numbers (eps, in_place) can be checked too.


def _norm(h, w, b, eps, rms):
    n = (h.shape[-1],)
    return torch.nn.functional.rms_norm(h, n, w, eps) if rms else torch.nn.functional.layer_norm(h, n, w, b, eps)


def _install(monkeypatch, dotted, **attrs):
    """Put a fake module (and fake parents) at ``dotted`` in sys.modules for this test only."""
    parts = dotted.split(".")
    parent = None
    for i in range(1, len(parts) + 1):
        mod = types.ModuleType(".".join(parts[:i]))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        if parent is not None:
            setattr(parent, parts[i - 1], mod)
        parent = mod
    for name, value in attrs.items():
        setattr(parent, name, value)


def _fake_liger(monkeypatch, calls, detach_weight=False):
    # liger_kernel.transformers.functional, Liger-Kernel 0.8.5
    def liger_fused_add_rms_norm(X, R, W, eps, offset: float = 0.0, casting_mode: str = "llama", in_place=True):
        calls.append({"eps": eps, "in_place": in_place})
        S = X + R
        return _norm(S, (W.detach() if detach_weight else W) + offset, None, eps, rms=True), S

    def liger_layer_norm(X, W, B, eps):
        calls.append({"eps": eps})
        return _norm(X, W, B, eps, rms=False)

    _install(
        monkeypatch,
        "liger_kernel.transformers.functional",
        liger_fused_add_rms_norm=liger_fused_add_rms_norm,
        liger_layer_norm=liger_layer_norm,
    )


def _fake_apex(monkeypatch, calls):
    # apex.normalization.fused_layer_norm; the kernels sit in the compiled extension fused_layer_norm_cuda
    def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
        calls.append({"eps": eps, "normalized_shape": normalized_shape})
        return _norm(input, weight, None, eps, rms=True)

    def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6, memory_efficient=False):
        calls.append({"eps": eps, "normalized_shape": normalized_shape})
        return _norm(input, weight, bias, eps, rms=False)

    _install(
        monkeypatch,
        "apex.normalization.fused_layer_norm",
        fused_rms_norm_affine=fused_rms_norm_affine,
        fused_layer_norm_affine=fused_layer_norm_affine,
    )
    _install(monkeypatch, "fused_layer_norm_cuda")


def _fake_flash_attn(monkeypatch, calls, ignore_prenorm=False):
    # flash_attn.ops.triton.layer_norm, flash-attention 2.8.3: (out, residual_out) only with prenorm=True
    def layer_norm_fn(
        x,
        weight,
        bias,
        residual=None,
        x1=None,
        weight1=None,
        bias1=None,
        eps=1e-6,
        dropout_p=0.0,
        rowscale=None,
        prenorm=False,
        residual_in_fp32=False,
        is_rms_norm=False,
        return_dropout_mask=False,
        out=None,
        residual_out=None,
    ):
        calls.append({"eps": eps, "is_rms_norm": is_rms_norm})
        h = x if residual is None else x + residual
        y = _norm(h, weight, bias, eps, rms=is_rms_norm)
        return (y, h) if prenorm and not ignore_prenorm else y

    def rms_norm_fn(
        x,
        weight,
        bias,
        residual=None,
        x1=None,
        weight1=None,
        bias1=None,
        eps=1e-6,
        dropout_p=0.0,
        rowscale=None,
        prenorm=False,
        residual_in_fp32=False,
        return_dropout_mask=False,
        out=None,
        residual_out=None,
    ):
        return layer_norm_fn(x, weight, bias, residual, eps=eps, prenorm=prenorm, is_rms_norm=True)

    _install(monkeypatch, "flash_attn.ops.triton.layer_norm", layer_norm_fn=layer_norm_fn, rms_norm_fn=rms_norm_fn)


def _fake_quack(monkeypatch, calls):
    # quack.rmsnorm, QuACK 0.6.5: with a residual, out alone unless prenorm=True
    def rmsnorm(
        x,
        weight=None,
        bias=None,
        residual=None,
        out_dtype=None,
        residual_dtype=None,
        eps=1e-6,
        prenorm=False,
        weight_offset=0.0,
    ):
        calls.append({"eps": eps})
        h = x if residual is None else x + residual
        y = _norm(h, weight, None, eps, rms=True)
        return (y, h) if prenorm and residual is not None else y

    _install(monkeypatch, "quack.rmsnorm", rmsnorm=rmsnorm)


FAKES = {"liger": _fake_liger, "apex": _fake_apex, "flash_attn": _fake_flash_attn, "quack": _fake_quack}
MODULES = {"liger": "liger_kernel", "apex": "apex", "flash_attn": "flash_attn", "quack": "quack"}


def _bench(provider, mode, norm="rms", m=8, n=64):
    cfg = bench_add_norm.BenchConfig(device="cpu", dtype="fp32", norm=norm, warmup=1, reps=2)
    return bench_add_norm.bench_one(provider, mode, m, n, cfg, copy_gbps=1.0)


@pytest.mark.parametrize("mode", bench_add_norm.MODES)
@pytest.mark.parametrize(
    "provider,norm",
    [
        ("liger", "rms"),
        ("liger", "layer"),
        ("apex", "rms"),
        ("apex", "layer"),
        ("flash_attn", "rms"),
        ("flash_attn", "layer"),
        ("quack", "rms"),
    ],
)
def test_third_party_provider_is_wired_to_its_api(monkeypatch, provider, norm, mode):
    calls = []
    FAKES[provider](monkeypatch, calls)
    row = _bench(provider, mode, norm)
    assert row.note == "" and row.ms > 0 and row.gbps > 0
    # w and b are randn: a provider normalising with a ones-weight or without the bias would be off by O(1)
    assert row.max_err < 1e-4
    assert calls and all(c["eps"] == (1e-6 if norm == "rms" else 1e-5) for c in calls)


def test_liger_fused_add_does_not_write_dx_into_dout(monkeypatch):
    calls = []
    _fake_liger(monkeypatch, calls)
    _bench("liger", "fwd+bwd")
    assert calls and all(c["in_place"] is False for c in calls)


def test_apex_gets_normalized_shape_as_a_list(monkeypatch):
    calls = []
    _fake_apex(monkeypatch, calls)
    _bench("apex", "fwd", n=48)
    assert calls and all(c["normalized_shape"] == [48] for c in calls)


@pytest.mark.parametrize("provider", sorted(MODULES))
def test_missing_package_gives_a_not_available_row(monkeypatch, provider):
    monkeypatch.setitem(sys.modules, MODULES[provider], None)  # makes any import of it raise ImportError
    row = _bench(provider, "fwd")
    assert row.note.startswith("not available:") and row.ms is None


def test_apex_without_its_cuda_extension_is_not_available(monkeypatch):
    _fake_apex(monkeypatch, [])
    monkeypatch.setitem(sys.modules, "fused_layer_norm_cuda", None)
    row = _bench("apex", "fwd")
    assert row.note.startswith("not available:") and "fused_layer_norm_cuda" in row.note


def test_quack_without_residual_support_is_not_available(monkeypatch):
    def rmsnorm(x, weight, eps=1e-6):  # the first QuACK releases
        return _norm(x, weight, None, eps, rms=True)

    _install(monkeypatch, "quack.rmsnorm", rmsnorm=rmsnorm)
    row = _bench("quack", "fwd")
    assert row.note.startswith("not available:") and "prenorm" in row.note


def test_quack_is_rms_only():
    row = _bench("quack", "fwd", norm="layer")
    assert row.note == "not available: QuACK benchmarked for RMSNorm only"


def test_provider_returning_out_alone_fails_its_row(monkeypatch):
    # with M == 2, unpacking out alone as (out, residual_out) would silently succeed row by row
    _fake_flash_attn(monkeypatch, [], ignore_prenorm=True)
    row = _bench("flash_attn", "fwd", m=2)
    assert row.note.startswith("failed: TypeError") and "(out, residual_out)" in row.note and row.ms is None


def test_provider_whose_backward_skips_the_weight_fails_its_row(monkeypatch):
    _fake_liger(monkeypatch, [], detach_weight=True)
    row = _bench("liger", "fwd+bwd")
    assert row.note == "failed: RuntimeError: backward left no gradient on weight" and row.ms is None


def test_setup_error_other_than_import_fails_the_row_not_the_run(monkeypatch):
    def broken(*args):
        raise OSError("undefined symbol in the extension")

    monkeypatch.setattr(bench_add_norm, "make_provider", broken)
    row = _bench("apex", "fwd")
    assert row.note == "setup failed: OSError: undefined symbol in the extension"


def test_liger_without_the_fused_add_is_not_available(monkeypatch):
    _install(monkeypatch, "liger_kernel.transformers.functional", liger_layer_norm=lambda X, W, B, eps: X)
    row = _bench("liger", "fwd")
    assert row.note.startswith("not available:") and "liger_fused_add_rms_norm" in row.note


# ---------------------------------------------------------------------------------------------------------------
# The Triton tuning sweep (interpreted on CPU: the wiring, not the numbers)
# ---------------------------------------------------------------------------------------------------------------


def test_tune_triton_sweeps_each_knob_once_and_restores_the_defaults():
    pytest.importorskip("triton")
    from addnorm.ops.triton import launch as T
    from addnorm.ops.triton import plan as P

    if T.unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(T.unavailable_reason(torch.device("cpu")))
    import tune_triton

    cfg = bench_add_norm.BenchConfig(
        device="cpu",
        dtype="fp32",
        norm="rms",
        sizes=(300,),
        modes=("fwd", "bwd"),
        providers=("addnorm",),
        elements=600,
        warmup=0,
        reps=1,
    )
    knobs = {"elems_per_thread": (4, 8), "max_fwd_block_n": (128, 16384)}
    rows = tune_triton.sweep(cfg, knobs, progress=lambda line: None)
    timed = {(r["knob"], r["value"], r["mode"]) for r in rows}
    # 16384 is the default (nothing new); max_fwd_block_n only changes the forward's kernels, so bwd is not retimed
    assert timed == {
        ("default", 0, "fwd"),
        ("default", 0, "bwd"),
        ("elems_per_thread", 4, "fwd"),
        ("elems_per_thread", 4, "bwd"),
        ("max_fwd_block_n", 128, "fwd"),
    }
    assert all(r["gbps"] > 0 and not r["note"] for r in rows), rows
    assert P.tuning() == P.Tuning()
    best = tune_triton.best_per_size(rows)
    assert {(b["n"], b["mode"]) for b in best} == {(300, "fwd"), (300, "bwd")}
    assert all(b["gain"] >= 1 and b["best_gbps"] >= b["default_gbps"] for b in best)


def test_gpu_timing_queues_a_busy_wait_before_the_start_event(monkeypatch):
    """On a GPU the start event must fire after the host has enqueued the call (else host overhead is timed as
    device time): each timed call is preceded by torch.cuda._sleep, then start, the call, end."""
    log = []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            log.append("event")

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.5

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("sleep", cycles)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ms = bench_add_norm.time_ms(lambda: log.append("call"), "cuda", warmup=1, reps=2)
    assert ms == 1.5
    timed = log[1:]  # after the warm-up call
    sleep = ("sleep", bench_add_norm.GPU_SLEEP_CYCLES)
    assert timed == [sleep, "event", "call", "event"] * 2


def test_tune_triton_knobs_option_names_an_unknown_knob(capsys):
    import tune_triton

    with pytest.raises(SystemExit) as e:
        tune_triton.main(["--device", "cpu", "--knobs", "programs_per_sm,warps"])
    assert e.value.code == 2
    assert "--knobs: unknown warps" in capsys.readouterr().err


def test_tune_triton_plans_tell_the_two_backward_grids_apart():
    """programs_per_sm sizes the rows backward's grid, looped_programs_per_sm the looped one's: a setting that
    changes only the other path's grid launches the same kernels and is not timed again."""
    pytest.importorskip("triton")
    import dataclasses

    import tune_triton

    from addnorm.ops.triton import plan as P

    base = P.Tuning()

    def plan(n, **knob):
        return tune_triton._launch_plan(dataclasses.replace(base, **knob), n, "bwd")

    rows_n, looped_n = 1024, 4 * base.max_bwd_block_n
    assert plan(rows_n, programs_per_sm=4) != plan(rows_n)
    assert plan(looped_n, programs_per_sm=4) == plan(looped_n)
    assert plan(looped_n, looped_programs_per_sm=8) != plan(looped_n)
    assert plan(rows_n, looped_programs_per_sm=8) == plan(rows_n)
