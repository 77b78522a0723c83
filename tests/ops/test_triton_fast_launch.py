"""The bound launcher (addnorm.ops.triton.fast_launch) without a GPU: Triton's own JITFunction.run on a stub driver
and a stub compiler, against the bound launch, through the real launchers of addnorm.ops.triton.launch.

The kernels are compiled copies of addnorm.ops.triton.kernels (the module imported again with TRITON_INTERPRET=0, so
its kernels are JITFunctions). ``triton.compiler.compile`` is replaced by a stub that records what Triton asked it to
compile (signature, constants, 16-divisibility attributes, options) and returns a kernel whose launcher records each
call and checks every argument against that specialization with Triton's own rule: a bound launch that reused a
kernel compiled for another specialization (an aligned pointer's kernel for a misaligned one, N % 16 == 0 for 17,
M as a constant 1 for M = 3) fails there. The launcher also writes a checksum of its arguments into the output
tensors, so the first-use check (bitwise, normal launch against bound launch) has something to compare.
What needs a GPU (the real launcher, CUDA graphs, bitwise parity of real kernels) is in benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import sys
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: E402

from addnorm.ops.triton import fast_launch as FL  # noqa: E402

try:  # imported now, as the kernels were: Triton's binder imports it lazily and it checks the interpreter setting
    import triton.experimental.gluon  # noqa: E402, F401
except ImportError:  # pragma: no cover - older Triton
    pass
from addnorm.ops.triton import elementwise as E  # noqa: E402
from addnorm.ops.triton import guard_bwd as G  # noqa: E402
from addnorm.ops.triton import kernels as K  # noqa: E402
from addnorm.ops.triton import launch as T  # noqa: E402
from addnorm.ops.triton import plan as P  # noqa: E402
from addnorm.ops.triton import row_stats as R  # noqa: E402

KERNELS = (
    "fwd_rows_kernel",
    "fwd_looped_kernel",
    "bwd_rows_kernel",
    "bwd_row_sums_kernel",
    "bwd_tiles_kernel",
    "bwd_fixup_kernel",  # the backward's guard (guard_bwd): launched after every backward
)
OUTPUTS = {"Out", "ResOut", "Mean", "Rstd", "DX", "DRes", "DWPart", "DBPart", "C1", "C2"}
TINY = P.Tuning(max_fwd_block_n=64, max_bwd_block_n=64, max_bwd_block_n_rms_16bit=64, loop_block_n=32)


def _native(v):
    return native_specialize_impl(CUDABackend, v, False, True, True)


class StubLauncher:
    """CompiledKernel.run of the stub: records the call, checks the specialization, writes a checksum."""

    def __init__(self, driver_, compiled):
        self.driver, self.compiled = driver_, compiled

    def __call__(self, gx, gy, gz, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
        c = self.compiled
        names = c.src.fn.arg_names
        assert len(args) == len(names), (len(args), names)
        for i, (name, v) in enumerate(zip(names, args)):
            kind = c.src.signature[name]
            if kind == "constexpr":
                assert (i,) in c.src.constants and c.src.constants[(i,)] == v, (name, v, c.src.constants.get((i,)))
                continue
            ty, key = _native(v)
            divisible = bool(c.src.attrs.get((i,)))
            if ty != kind or divisible != (key == "D"):
                raise AssertionError(f"{name}={v!r} launched on a kernel compiled for {kind}, divisible={divisible}")
        self.driver.calls.append(
            (c.src.fn.__name__, (gx, gy, gz), stream, function, packed, launch_metadata, enter_hook, exit_hook, args)
        )
        checksum = gx + 3 * gy + 5 * gz
        for v in args:
            if isinstance(v, torch.Tensor):
                checksum += v.data_ptr() % 4093 + hash(v.dtype) % 97
            elif isinstance(v, (int, float)) and v is not None:
                checksum += float(v)
        with torch.inference_mode():  # as a kernel writes: regardless of the tensors' autograd state
            for name, v in zip(names, args):
                if name in OUTPUTS and isinstance(v, torch.Tensor) and v.numel() and v.is_contiguous():
                    v.view(-1)[0] = checksum % 61


class StubCompiled:
    """What triton.compile returns, as far as JITFunction.run and the bound launch use it."""

    def __init__(self, driver_, src, options):
        self.src, self.options = src, options
        self.function = object()  # a module's function handle
        self.packed_metadata = ("packed", options["num_warps"])
        self.run = StubLauncher(driver_, self)
        self.metadata_calls = 0

    def launch_metadata(self, grid, stream, *args):  # only the normal launch asks for it
        self.metadata_calls += 1
        return None


class StubDriver:
    def __init__(self):
        self.calls: list = []
        self.compiled: list[StubCompiled] = []

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0x5EED

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def compile(self, src, target=None, options=None, **_):
        c = StubCompiled(self, src, options)
        self.compiled.append(c)
        return c

    @property
    def normal_launches(self) -> int:
        return sum(c.metadata_calls for c in self.compiled)


@pytest.fixture
def stub(monkeypatch):
    """The launchers' kernels as JITFunctions, Triton's driver and compiler stubbed, bound launches on."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # the modules of the kernels' helpers first, compiled too: kernels.py imports its helpers from them
    compiled_modules = []
    for helpers in (E, R, K, G):
        spec = importlib.util.spec_from_file_location(helpers.__name__, helpers.__file__)
        compiled_kernels = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, helpers.__name__, compiled_kernels)
        spec.loader.exec_module(compiled_kernels)
        compiled_modules.append(compiled_kernels)
    for name in KERNELS:
        (kernel,) = [getattr(c, name) for c in compiled_modules if hasattr(c, name)]
        assert isinstance(kernel, JITFunction), type(kernel)
        monkeypatch.setattr(T, name, kernel)
    drv = StubDriver()
    monkeypatch.setattr(driver, "_active", drv)
    monkeypatch.setattr(triton.compiler, "compile", drv.compile)
    monkeypatch.setenv(FL.ENV, "1")
    assert FL.refresh() is None
    yield drv
    monkeypatch.undo()
    FL.refresh()


def _set_fast(monkeypatch, on: bool):
    monkeypatch.setenv(FL.ENV, "1" if on else "0")
    FL.refresh()


# --------------------------------------------------------------------------------------------------------------
# Scenarios: the launchers as the contract calls them, on tensors that stay put between runs
# --------------------------------------------------------------------------------------------------------------


def _rows(m, n, dtype, *, pad=0, misalign=0):
    """(m, n) rows: strided by n + pad, starting ``misalign`` elements into their buffer (16-byte misaligned). The
    scenarios' tensors are made on the default device (a ``with torch.device(...)`` block picks the GPU)."""
    big = torch.randn(m * (n + pad) + misalign, dtype=torch.float32).to(dtype)
    return big[misalign:].view(m, n + pad)[:, :n]


def _fwd(
    m,
    n,
    dtype=torch.bfloat16,
    *,
    rms=True,
    residual=True,
    weight=True,
    bias=False,
    res_dtype=None,
    stats=True,
    p=0.0,
    zc=False,
    cast=False,
    inplace=False,
    pad=0,
    misalign=0,
    row_stride=None,
):
    """A forward_into call on fixed tensors (in place: out is x and res_out the residual, as add_norm_ does)."""
    res_dtype = res_dtype or dtype
    x = _rows(m, n, dtype, pad=pad, misalign=misalign)
    if row_stride is not None:  # e.g. 1 for a single row: an integer Triton compiles as a constant
        x = x.as_strided((m, n), (row_stride, 1))
    r = _rows(m, n, res_dtype, pad=pad) if residual else None
    w = torch.randn(n).to(dtype) if weight else None
    b = torch.randn(n).to(dtype) if bias else None
    if inplace:
        x, r = x.contiguous(), r.contiguous()
        out, res_out = x, r
    else:
        out, res_out = torch.empty(m, n, dtype=dtype), torch.empty(m, n, dtype=res_dtype) if residual else None
    sd = torch.float64 if torch.float64 in (dtype, res_dtype) else torch.float32
    rstd = torch.empty(m, dtype=sd) if stats else None
    mean = torch.empty(m, dtype=sd) if stats and not rms else None
    seed = torch.tensor(1234, dtype=torch.int64) if p else None

    def call():
        T.forward_into(
            out,
            res_out,
            mean,
            rstd,
            x,
            r,
            w,
            b,
            eps=1e-5,
            is_rms=rms,
            dropout_p=p,
            seed=seed,
            zero_centered_weight=zc,
            cast_before_weight=cast,
        )
        return tuple(t for t in (out, res_out, mean, rstd) if t is not None)

    return call


def _bwd(
    m,
    n,
    dtype=torch.bfloat16,
    *,
    rms=True,
    dres_out=True,
    weight=True,
    bias=False,
    res_dtype=None,
    p=0.0,
    zc=False,
    cast=False,
    pad=0,
    misalign=0,
    broadcast_dout=False,
):
    res_dtype = res_dtype or dtype
    h = _rows(m, n, res_dtype, pad=pad)
    dout = _rows(m, n, dtype, pad=pad, misalign=misalign)
    if broadcast_dout:  # one row seen m times (row stride 0): read-only, the first-use check must not write it
        dout = _rows(1, n, dtype).expand(m, n)
    dres = _rows(m, n, res_dtype) if dres_out else None
    w = torch.randn(n).to(dtype) if weight else None
    rstd, mean = torch.rand(m) + 0.5, None if rms else torch.randn(m)
    seed = torch.tensor(99, dtype=torch.int64) if p else None

    def call():
        return T.backward(
            dout,
            dres,
            h,
            w,
            mean,
            rstd,
            is_rms=rms,
            dropout_p=p,
            seed=seed,
            zero_centered_weight=zc,
            x_dtype=dtype,
            residual_dtype=res_dtype,
            bias_dtype=dtype if bias else None,
            cast_before_weight=cast,
        )

    return call


SCENARIOS = {
    "rms bf16": lambda: _fwd(8, 4096),
    "ln fp32 bias, M=1, N=300": lambda: _fwd(1, 300, torch.float32, rms=False, bias=True),
    "bf16 on an fp32 residual stream": lambda: _fwd(5, 96, res_dtype=torch.float32),
    "strided rows": lambda: _fwd(4, 80, pad=24),
    "misaligned x, odd row stride": lambda: _fwd(3, 64, pad=3, misalign=1),
    "N=17": lambda: _fwd(6, 17, torch.float16, rms=False),
    "dropout, zero-centered, cast": lambda: _fwd(4, 128, p=0.1, zc=True, cast=True),
    "no stats (inference)": lambda: _fwd(8, 4096, stats=False),
    "in place": lambda: _fwd(8, 512, stats=False, inplace=True),
    "in place, LayerNorm, M=1": lambda: _fwd(1, 512, rms=False, bias=True, stats=False, inplace=True),
    "no residual, no weight": lambda: _fwd(3, 48, residual=False, weight=False),
    "fp64": lambda: _fwd(2, 40, torch.float64, rms=False, bias=True),
    "bwd rms": lambda: _bwd(8, 256),
    "bwd ln bias, M=1": lambda: _bwd(1, 300, torch.float32, rms=False, bias=True),
    "bwd dropout, zc, cast, fp32 stream": lambda: _bwd(5, 96, p=0.1, zc=True, cast=True, res_dtype=torch.float32),
    "bwd strided, misaligned dout": lambda: _bwd(4, 80, pad=3, misalign=1, dres_out=False),
    "bwd broadcast dout": lambda: _bwd(6, 64, broadcast_dout=True),
}
LOOPED = {  # under TINY limits: the looped forward, the row-sums + tiles backward
    "looped fwd rms": lambda: _fwd(3, 200),
    "looped fwd ln, dropout, M=1": lambda: _fwd(1, 130, rms=False, bias=True, p=0.2),
    "looped bwd ln": lambda: _bwd(4, 200, rms=False, bias=True),
    "looped bwd rms, misaligned": lambda: _bwd(3, 150, misalign=1, pad=5, p=0.1),
}


def _hooks(call) -> tuple:
    """The launch metadata and hooks of a recorded launch, as what they do: the normal launch passes Triton's empty
    hook chains (and metadata only a hook reads), a bound launch None for the three: either way no hook runs."""
    md, enter, exit_ = call[5:8]
    assert not getattr(enter, "calls", []) and not getattr(exit_, "calls", []), (enter, exit_)
    return ()


def _norm(call):
    """A recorded launch with tensors as (dtype, shape, strides, address mod 16): comparable across runs."""
    name, grid, stream, function, packed, md, enter, exit_, args = call
    args = tuple(
        (a.dtype, tuple(a.shape), a.stride(), a.data_ptr() % 16) if isinstance(a, torch.Tensor) else a for a in args
    )
    return name, grid, stream, function, packed, _hooks(call), args


def _exact(call):
    """A recorded launch with tensors by address and dtype: the same call on the same tensors."""
    name, grid, stream, function, packed, md, enter, exit_, args = call
    args = tuple((a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    return name, grid, stream, function, packed, _hooks(call), args


def _check_parity(stub, monkeypatch, make):
    _set_fast(monkeypatch, False)
    run = make()
    stub.calls.clear()
    base = stub.normal_launches
    run()
    normal = list(stub.calls)
    launches = len(normal)
    assert launches >= 1 and stub.normal_launches - base == launches and not FL._bound

    _set_fast(monkeypatch, True)
    stub.calls.clear()
    run()  # first use of each key: the normal launch, then the bound one on the same (restored) arguments
    first = list(stub.calls)
    assert len(first) == 2 * launches, first
    for normal_call, bound_call in zip(first[::2], first[1::2]):
        assert _exact(bound_call) == _exact(normal_call)
        assert bound_call[5:8] == (None, None, None)
    assert stub.normal_launches - base == 2 * launches
    assert 1 <= len(FL._bound) <= launches
    assert all(b.run is not None for b in FL._bound.values())

    stub.calls.clear()
    run()  # bound: no normal launch (which would ask for launch metadata), the same arguments
    assert stub.normal_launches - base == 2 * launches
    assert [_norm(c) for c in stub.calls] == [_norm(c) for c in normal] == [_norm(c) for c in first[::2]]
    return normal


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_bound_launch_passes_what_the_normal_launch_passes(stub, monkeypatch, name):
    _check_parity(stub, monkeypatch, SCENARIOS[name])


@pytest.mark.parametrize("name", list(LOOPED))
def test_bound_launch_on_the_looped_paths(stub, monkeypatch, name):
    monkeypatch.setattr(P, "tuning", lambda: TINY)
    calls = _check_parity(stub, monkeypatch, LOOPED[name])
    assert {c[0] for c in calls} & {"fwd_looped_kernel", "bwd_tiles_kernel"}


def test_every_flag_combination_of_the_forward(stub, monkeypatch):
    """Every flag of the forward at once and apart, on one set of tensors per combination: each gets its own key."""
    for rms, residual, weight, p, zc, cast, stats in itertools.product((True, False), repeat=7):
        if not weight and (zc or cast):
            continue
        flags = dict(rms=rms, residual=residual, weight=weight, bias=not rms, p=0.1 if p else 0.0, zc=zc, cast=cast)
        _check_parity(stub, monkeypatch, functools.partial(_fwd, 2, 48, stats=stats, **flags))
        FL._bound.clear()
        stub.calls.clear()


def test_aligned_and_misaligned_pointers_get_their_own_kernels(stub):
    """The same shape and flags, x aligned then 2 bytes off: two compiled kernels, two bound launches."""
    _fwd(4, 64)()
    _fwd(4, 64)()
    assert len(stub.compiled) == 1
    _fwd(4, 64, misalign=1)()
    _fwd(4, 64, misalign=1)()
    assert len(stub.compiled) == 2 and len(FL._bound) == 2
    _fwd(4, 64)()  # and back: the aligned one's bound launch, no compile
    assert len(stub.compiled) == 2


@pytest.mark.parametrize(
    "blind, make_a, make_b",
    [
        ("alignment", lambda: _fwd(4, 64), lambda: _fwd(4, 64, misalign=1)),
        ("ones", lambda: _fwd(1, 64, row_stride=3), lambda: _fwd(1, 64, row_stride=1)),  # 1: compiled as a constant
        ("divisibility", lambda: _fwd(16, 64, pad=16), lambda: _fwd(16, 64, pad=1)),  # the row stride % 16
    ],
)
def test_the_stub_catches_a_key_that_misses_a_specialization(stub, monkeypatch, blind, make_a, make_b):
    """The harness itself: a key blind to one specialization reuses the wrong kernel, and the stub says so."""
    real = FL._spec

    def blind_spec(a):
        if blind == "alignment" and isinstance(a, torch.Tensor):
            return a.dtype
        if blind == "ones" and a.__class__ is int and a == 1:
            return real(3)
        if blind == "divisibility" and a.__class__ is int:
            return "int"
        return real(a)

    monkeypatch.setattr(FL, "_specs", lambda args: tuple(map(blind_spec, args)))
    make_a()()
    b = make_b()
    with pytest.raises(AssertionError, match="launched on a kernel compiled for"):
        b()


def test_specialization_rule_matches_triton():
    """_spec (and _specs, which inlines its common cases) splits values exactly where Triton's native rule does
    (ints, floats, bools, None, tensors and parameters)."""
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, -(2**31), -(2**31) - 16]
    ints += [2**32, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16, -(2**63)]
    buf = torch.empty(64, dtype=torch.float32)
    tensors = [buf, buf[1:], buf[4:], buf.to(torch.bfloat16), buf.to(torch.bfloat16)[8:], buf.to(torch.bfloat16)[3:]]
    tensors += [torch.empty(3, dtype=torch.int64), torch.empty(0, dtype=torch.float16), torch.nn.Parameter(buf[4:])]
    values = [*ints, 0.0, 1.0, 1.5, -2.0, 1e300, True, False, None, *tensors]
    for a, b in itertools.combinations_with_replacement(values, 2):
        same = _native(a) == _native(b)
        assert (FL._spec(a) == FL._spec(b)) == same, (a, b, _native(a), _native(b))
        assert (FL._specs((a,)) == FL._specs((b,))) == same, (a, b, _native(a), _native(b))  # the inlined cases


def test_the_launch_pins_fp_fusion_and_passes_the_planned_options(stub):
    """Every kernel is compiled with enable_fp_fusion=True (Triton 3.9's default, which 3.10 turns off) and the
    plan's warps."""
    _fwd(8, 4096)()
    _bwd(8, 256)()
    assert len(stub.compiled) >= 2
    for c in stub.compiled:
        assert c.options["enable_fp_fusion"] is True, c.options
    fwd = P.fwd_config(8, 4096, True, True, False, True, False, False, True, False, True)[2]
    assert fwd["enable_fp_fusion"] is True and stub.compiled[0].options["num_warps"] == fwd["num_warps"]


def test_fp_fusion_stays_on_when_tritons_default_turns_it_off(tmp_path):
    """Compiled for sm_90 (no GPU needed) with TRITON_DEFAULT_FP_FUSION=0, Triton 3.10's default: the LayerNorm
    forward still has its fused multiply-adds (unpinned, it compiled to none: different code, different bits)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia.compiler")
    tools = Path(__file__).resolve().parents[2] / "tools"
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import sm90_static as S; "
        "(l,) = [l for l in S.record_launches([S.Shape(dtype=torch.bfloat16, is_rms=False, m=2, n=64)]) "
        "if l.name == 'fwd_rows_kernel']; print(S.compile_sm90(l).asm['ptx'].count('fma.rn'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="0", TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code, str(tools)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 0, done.stdout


def test_no_kernel_reads_a_constexpr_global(stub):
    """Triton re-checks on every launch each global a kernel reads: none is left to check."""
    for name in KERNELS:
        kernel = getattr(T, name)
        kernel.cache_key  # computes used_global_vals  # noqa: B018
        assert kernel.used_global_vals == {}, (name, list(kernel.used_global_vals))


def test_first_use_check_keeps_the_normal_launch_when_they_differ(stub, monkeypatch):
    """A bound launch that passes something else is caught on first use: a warning, the normal launch's results
    kept, the key held on the normal launch."""
    call = _fwd(4, 64, stats=False)
    _set_fast(monkeypatch, False)
    call()
    expected = [t.clone() for t in _outputs_of(stub.calls[-1])]
    _set_fast(monkeypatch, True)
    real_call = FL._call

    def wrong(bound, grid, device, args):
        real_call(bound, (grid[0] + 1,), device, args)  # one program too many

    monkeypatch.setattr(FL, "_call", wrong)
    with pytest.warns(RuntimeWarning, match="differed from Triton's normal launch"):
        call()
    outputs = _outputs_of(stub.calls[-1])  # bitwise: torch.empty's garbage may hold NaNs
    assert [torch.equal(FL._bits(a), FL._bits(b)) for a, b in zip(outputs, expected)] == [True] * len(expected)
    (bound,) = FL._bound.values()
    assert bound.run is None
    launches = stub.normal_launches
    call()
    assert stub.normal_launches == launches + 1  # the normal launch again


def _outputs_of(call):
    names = [n for n in T.fwd_rows_kernel.arg_names]
    return [a for n, a in zip(names, call[-1]) if n in {"Out", "ResOut"} and a is not None]


def test_nothing_is_bound_when_switched_off_or_on_another_version(stub, monkeypatch):
    call = _fwd(4, 64)
    _set_fast(monkeypatch, False)
    assert FL.ENV in FL.unavailable_reason()
    call()
    call()
    assert not FL._bound and stub.normal_launches == 2
    monkeypatch.setenv(FL.ENV, "1")
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    assert "3.10.0" in FL.refresh()
    call()
    assert not FL._bound and stub.normal_launches == 3


def test_first_use_check_leaves_inputs_alone_and_takes_inference_tensors(stub):
    """The check writes back only what the launch wrote: the inputs' version counters (autograd's record of in-place
    changes, which a tensor saved by another op must keep) do not move. Serving tensors made under inference_mode
    may be launched on outside it: the check must not trip on them."""
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    versions = [t._version for t in (x, r, w)]
    out, res, _, _ = T.forward(
        x,
        r,
        w,
        None,
        eps=1e-5,
        is_rms=True,
        dropout_p=0.0,
        seed=None,
        residual_dtype=torch.float32,
        zero_centered_weight=False,
        store_residual_out=True,
    )
    assert [t._version for t in (x, r, w)] == versions and len(FL._bound) == 1
    with torch.inference_mode():
        call = _fwd(4, 64, stats=False, inplace=True)
    call()
    call()
    assert len(FL._bound) == 2 and all(b.run is not None for b in FL._bound.values())


def test_too_large_to_check_is_launched_normally_until_a_smaller_call(stub, monkeypatch):
    monkeypatch.setattr(FL, "VERIFY_MAX_BYTES", 0)
    call = _fwd(4, 64)
    call()
    call()
    assert not FL._bound and stub.normal_launches == 2
    monkeypatch.setattr(FL, "VERIFY_MAX_BYTES", 1 << 20)
    call()
    call()
    assert len(FL._bound) == 1 and stub.normal_launches == 3  # checked once (a normal launch), then bound


def test_a_new_plan_object_is_a_new_key(stub, monkeypatch):
    """The plan cache starts over when the Tuning changes: a bound launch is never reused with another plan's meta."""
    call = _fwd(4, 64)
    call()
    tuning = P.Tuning(elems_per_thread=4)
    monkeypatch.setattr(P, "tuning", lambda: tuning)
    call()
    assert len(FL._bound) == 2


def test_row_counts_with_one_plan_share_a_bound_launch(stub):
    """Prefills of many lengths: 40 and 56 rows of 4096 (one row per program, neither M divisible by 16) launch with
    the same constexprs and options, so the second is bound without a first-use check of its own; 48 rows (M % 16
    == 0) is another specialization."""
    _fwd(40, 4096, stats=False)()
    assert len(FL._bound) == 1 and stub.normal_launches == 1
    _fwd(56, 4096, stats=False)()
    assert len(FL._bound) == 1 and stub.normal_launches == 1
    assert [c[1] for c in stub.calls[-2:]] == [(40, 1, 1), (56, 1, 1)]  # the grid is the call's own
    _fwd(48, 4096, stats=False)()
    assert len(FL._bound) == 2 and stub.normal_launches == 2


def test_interpreted_kernels_are_never_bound(device):
    """Under TRITON_INTERPRET=1 the kernels are InterpretedFunctions (no compiled kernel): launched as they are."""
    if device.type != "cpu" or not T.interpreted():
        pytest.skip("the interpreter runs only in the CPU test run")
    FL._bound.clear()
    x, r = torch.randn(3, 40), torch.randn(3, 40)
    out, res, _, rstd = T.forward(
        x,
        r,
        torch.ones(40),
        None,
        eps=1e-5,
        is_rms=True,
        dropout_p=0.0,
        seed=None,
        residual_dtype=torch.float32,
        zero_centered_weight=False,
        store_residual_out=True,
    )
    assert torch.allclose(res, x + r) and torch.allclose(out, res * rstd[:, None], atol=1e-6)
    assert not FL._bound


def test_no_warning_from_triton_about_fp_fusion(stub):
    """Triton 3.9 warns when enable_fp_fusion is left to its default; the launches pass it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fwd(2, 32)()


# --------------------------------------------------------------------------------------------------------------
# On a GPU: the real compiled kernels (gpu_check.sh runs this file on CUDA)
# --------------------------------------------------------------------------------------------------------------


def _gpu_or_skip(device):
    if device.type != "cuda" or T.interpreted():
        pytest.skip("needs a GPU: bound launches exist only for compiled kernels")
    if FL.unavailable_reason() is not None:
        pytest.skip(f"bound launches are off here: {FL.unavailable_reason()}")


def _results(make, device, seed=0):
    """The scenario's outputs, on fresh inputs drawn from ``seed`` (in-place scenarios overwrite theirs)."""
    torch.manual_seed(seed)
    with torch.device(device):
        outputs = make()()
    return [FL._bits(t.clone()) for t in outputs if t is not None]


@pytest.mark.parametrize("name", [*SCENARIOS, *LOOPED])
def test_bound_launches_are_bitwise_the_normal_launch_on_the_gpu(device, monkeypatch, name):
    """Real kernels: Triton's normal launch, then the first use (checked inside fast_launch, which warns on a
    difference: an error here), then the bound launch; every output bitwise equal."""
    _gpu_or_skip(device)
    if name in LOOPED:
        monkeypatch.setattr(P, "tuning", lambda: TINY)
    make = {**SCENARIOS, **LOOPED}[name]
    _set_fast(monkeypatch, False)
    normal = _results(make, device)
    _set_fast(monkeypatch, True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="addnorm: the bound launch", category=RuntimeWarning)
        first = _results(make, device)
        assert FL._bound and all(b.run is not None for b in FL._bound.values()), FL._bound
        bound = _results(make, device)
    for a, b, c in zip(normal, first, bound):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_bound_launches_under_cuda_graphs(device, monkeypatch):
    """A launch bound before capture is captured and replays bitwise; a first use during capture is launched the
    normal way and not bound (the check would synchronize inside the capture)."""
    _gpu_or_skip(device)
    _set_fast(monkeypatch, False)
    expected = _results(SCENARIOS["no stats (inference)"], device)
    for bind_first in (True, False):
        _set_fast(monkeypatch, True)
        torch.manual_seed(0)
        with torch.device(device):
            call = SCENARIOS["no stats (inference)"]()
        if bind_first:
            call()
            assert len(FL._bound) == 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # captured on torch's own side stream
            outputs = call()
        assert len(FL._bound) == (1 if bind_first else 0)
        for t in outputs:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(FL._bits(t), e) for t, e in zip(outputs, expected))
