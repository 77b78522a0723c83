"""The Triton backend under torch.compile: the two routes of addnorm.ops.triton.compiled.

- CUDA tensors (compiled kernels): compiled graphs call addnorm::triton_add_norm_fwd/bwd, triton ops whose kernel
  launches Inductor sees; checked here only on a GPU (and by tools/gpu_graph_check.py).
- CPU tensors in Triton's interpreter: triton ops cannot be traced there (see the module docstring), so compiled
  graphs keep the opaque addnorm::add_norm_fwd; checked everywhere.
Both routes must give eager's results: forward and backward, with and without dropout.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from addnorm import add_layer_norm, add_rms_norm  # noqa: E402
from addnorm.ops import backends  # noqa: E402
from addnorm.ops.triton import compiled as compiled_ops  # noqa: E402
from addnorm.ops.triton import launch as T  # noqa: E402

LN, RMS = False, True
FWD_ARGS = (1e-5, True, 0.0, torch.float32, False, True)  # eps, is_rms, dropout_p, residual_dtype, zc, store


@pytest.fixture(autouse=True)
def _triton_here(device):
    reason = T.unavailable_reason(device)
    if reason is not None:
        pytest.skip(reason)


def _leaves(m, n, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(m, n, generator=g, dtype=dtype).to(device).requires_grad_() for _ in range(2))
    w = (1 + 0.5 * torch.randn(n, generator=g, dtype=dtype)).to(device).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g, dtype=dtype)).to(device).requires_grad_()
    return x, r, w, b


def _block(is_rms, p):
    def block(x, r, w, b):
        if is_rms:
            out, res = add_rms_norm(x, r, w, 1e-6, dropout_p=p, backend="triton")
        else:
            out, res = add_layer_norm(x, r, w, b, 1e-5, dropout_p=p, backend="triton")
        ramp = torch.linspace(-1, 1, out.shape[-1], device=out.device)
        return (out.float() * ramp).sum() + res.float().square().sum()

    return block


def _run(fn, leaves, seed=123):
    """fn's value and the gradients of every leaf, the dropout seed drawn from a fixed generator state."""
    torch.manual_seed(seed)
    if leaves[0].is_cuda:
        torch.cuda.manual_seed(seed)
    val = fn(*leaves)
    return val.detach(), torch.autograd.grad(val, leaves, allow_unused=True)


def _same(a, b, bitwise):
    (va, ga), (vb, gb) = a, b
    check = torch.equal if bitwise else lambda u, v: torch.allclose(u, v, rtol=1e-5, atol=1e-5)
    assert check(va, vb), (va, vb)
    for i, (u, v) in enumerate(zip(ga, gb)):
        assert (u is None) == (v is None), i
        if u is not None:
            assert check(u, v), (i, (u - v).abs().max())


def test_routing_by_device():
    assert not compiled_ops.usable("cpu")
    assert not compiled_ops.usable("meta")
    # kernels built for the interpreter (this process, without a GPU) cannot be traced even for CUDA tensors
    assert compiled_ops.usable("cuda") == (torch.cuda.is_available() and not T.interpreted())
    # the registry's view of it (KernelBackend.compiled_module): only the Triton backend has ops of its own
    for device_type in ("cpu", "cuda"):
        assert backends.compiled_ops_usable("triton", device_type) == compiled_ops.usable(device_type)
        assert not backends.compiled_ops_usable("cpu", device_type)
        assert not backends.compiled_ops_usable("reference", device_type)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_ops_equal_add_norm_ops(device, is_rms, p):
    """Called directly (eager), the triton ops give add_norm_fwd/bwd's results bit for bit, autograd included."""
    x, r, w, b = _leaves(5, 48, device)
    b = None if is_rms else b
    args = (1e-5, is_rms, p, torch.float32, False, True)
    torch.manual_seed(7)
    new = torch.ops.addnorm.triton_add_norm_fwd(x, r, w, b, *args, False, None)
    torch.manual_seed(7)
    old = torch.ops.addnorm.add_norm_fwd(x, r, w, b, *args, "triton", False, None)
    for i, (u, v) in enumerate(zip(new, old)):
        assert torch.equal(u, v), i
    dout, dres = torch.randn_like(new[0]), torch.randn_like(new[1])
    g_new = torch.autograd.grad((new[0], new[1]), [t for t in (x, r, w, b) if t is not None], (dout, dres))
    g_old = torch.autograd.grad((old[0], old[1]), [t for t in (x, r, w, b) if t is not None], (dout, dres))
    for u, v in zip(g_new, g_old):
        assert torch.equal(u, v)
    h, mean, rstd, seed = new[1].detach(), new[2], new[3], new[4]
    bwd_args = (is_rms, p, False, torch.float32, torch.float32, None if is_rms else torch.float32)
    got = torch.ops.addnorm.triton_add_norm_bwd(dout, dres, h, w.detach(), mean, rstd, seed, *bwd_args, False)
    want = torch.ops.addnorm.add_norm_bwd(dout, dres, h, w.detach(), mean, rstd, seed, *bwd_args, "triton", False)
    assert all(torch.equal(u, v) for u, v in zip(got, want))


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_inplace_op_equals_add_norm_inplace_op(device, is_rms, contiguous):
    """Called directly, addnorm::triton_add_norm_ writes what addnorm::add_norm_ writes, bit for bit; inputs that
    are not contiguous go out of place and are copied back."""
    g = torch.Generator().manual_seed(4)
    base = [torch.randn(5, 2 * 48 if not contiguous else 48, generator=g, dtype=torch.bfloat16) for _ in range(2)]
    w, b = torch.randn(48, generator=g).to(device), torch.randn(48, generator=g).to(device)
    b = None if is_rms else b
    results = []
    for op in (torch.ops.addnorm.triton_add_norm_, torch.ops.addnorm.add_norm_):
        x, r = (t.to(device).clone() if contiguous else t.to(device).clone()[:, ::2] for t in base)
        assert x.is_contiguous() == contiguous
        extra = () if op is torch.ops.addnorm.triton_add_norm_ else ("triton",)
        op(x, r, w, b, 1e-5, is_rms, False, True, *extra)
        results.append((x.clone(), r.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][1], base[1].to(device) if contiguous else base[1].to(device)[:, ::2])


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_compile_fullgraph_equals_eager(device, is_rms, p):
    """torch.compile(fullgraph=True), forward and backward, equals eager; on CUDA through the triton ops (Inductor,
    its random ops drawn like eager's so the dropout seed is the same), elsewhere through add_norm_fwd."""
    block = _block(is_rms, p)
    leaves = _leaves(6, 40, device)
    seen = []

    def recording(gm, example_inputs):  # dynamo's graph: which op the call was traced to
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        if device.type == "cuda":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)  # inductor needs a C++ toolchain on CPU

    eager = _run(block, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=recording)
    if device.type == "cuda":
        import torch._inductor.config as inductor_config

        with inductor_config.patch(fallback_random=True):
            got = _run(compiled, leaves)
    else:
        got = _run(compiled, leaves)
    want_op = "addnorm.triton_add_norm_fwd" if compiled_ops.usable(device.type) else "addnorm.add_norm_fwd"
    assert any(want_op in s for s in seen), seen
    _same(got, eager, bitwise=device.type != "cuda")  # Inductor may fuse the sums around the op differently


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the triton ops are traced only for CUDA tensors")
def test_inductor_sees_the_kernels(device):
    """The compiled code launches addnorm's kernels itself (no opaque op call), forward and backward."""
    from torch._inductor.utils import run_and_get_code

    block = _block(RMS, 0.1)
    leaves = _leaves(8, 256, device, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)

    def step():
        val = compiled(*leaves)
        val.backward()
        return val

    _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    assert "fwd_rows_kernel" in code and "bwd_rows_kernel" in code, code[:2000]
    assert "torch.ops.addnorm" not in code  # no op call left (comments may still name the op a node came from)


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_compile_inplace_equals_eager(device, is_rms):
    """The in-place serving ops compiled (fullgraph): on CUDA through addnorm::triton_add_norm_, elsewhere through
    addnorm::add_norm_; x and residual end as the eager call leaves them."""
    from addnorm import add_layer_norm_, add_rms_norm_

    def step(x, r, w, b):
        if is_rms:
            add_rms_norm_(x, r, w, 1e-6, backend="triton")
        else:
            add_layer_norm_(x, r, w, b, 1e-5, backend="triton")
        return x * 2

    seen = []

    def recording(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        if device.type == "cuda":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)

    g = torch.Generator().manual_seed(2)
    shapes = ((6, 64), (6, 64), (64,), (64,))
    x, r, w, b = (torch.randn(*s, generator=g, dtype=torch.bfloat16).to(device) for s in shapes)
    xe, re_ = x.clone(), r.clone()
    with torch.no_grad():
        want = step(xe, re_, w, b)
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, backend=recording)(x, r, w, b)
    op = "addnorm.triton_add_norm_" if compiled_ops.usable(device.type) else "addnorm.add_norm_"
    assert any(op in t for t in seen), seen
    assert torch.equal(x, xe) and torch.equal(r, re_) and torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="opcheck traces the triton ops, which needs CUDA tensors")
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_opcheck_triton_ops(device, is_rms, p):
    x, r, w, b = _leaves(4, 64, device, torch.bfloat16)
    b = None if is_rms else b
    args = (x, r, w, b, 1e-5, is_rms, p, torch.float32, False, True, False, None)
    # the dropout seed is a random draw: opcheck's repeated runs would compare different masks
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    if p == 0:
        tests += ("test_aot_dispatch_dynamic",)
    torch.library.opcheck(torch.ops.addnorm.triton_add_norm_fwd.default, args, test_utils=tests)
    out = torch.ops.addnorm.triton_add_norm_fwd(*args)
    dout = torch.randn_like(out[0])
    bwd = (
        dout,
        None,
        out[1].detach(),
        w.detach(),
        out[2],
        out[3],
        out[4],
        is_rms,
        p,
        False,
        torch.bfloat16,
        torch.float32,
        None if is_rms else torch.bfloat16,
        False,
    )
    torch.library.opcheck(torch.ops.addnorm.triton_add_norm_bwd.default, bwd)
    if p == 0:  # the in-place serving op (no dropout of its own): the same inputs, written in place
        inplace = (
            x.detach().clone(),
            r.detach().clone(),
            w.detach(),
            None if b is None else b.detach(),
            1e-5,
            is_rms,
            False,
            False,
        )
        torch.library.opcheck(torch.ops.addnorm.triton_add_norm_.default, inplace)


@pytest.mark.parametrize("is_rms", [LN, RMS], ids=["ln", "rms"])
def test_opcheck_add_norm_ops_in_the_interpreter(device, is_rms):
    """The opaque ops on the triton backend pass opcheck wherever the kernels run (here: the interpreter on CPU)."""
    x, r, w, b = _leaves(3, 32, device)
    b = None if is_rms else b
    args = (x, r, w, b, 1e-5, is_rms, 0.0, torch.float32, False, True, "triton", False, None)
    torch.library.opcheck(torch.ops.addnorm.add_norm_fwd.default, args)
    out = torch.ops.addnorm.add_norm_fwd(*args)
    dout = torch.randn_like(out[0])
    bwd = (
        dout,
        None,
        out[1].detach(),
        w.detach(),
        out[2],
        out[3],
        out[4],
        is_rms,
        0.0,
        False,
        torch.float32,
        torch.float32,
        None if is_rms else torch.float32,
        "triton",
        False,
    )
    torch.library.opcheck(torch.ops.addnorm.add_norm_bwd.default, bwd)
    inplace = (
        x.detach().clone(),
        r.detach().clone(),
        w.detach(),
        None if b is None else b.detach(),
        1e-5,
        is_rms,
        False,
        False,
        "triton",
    )
    torch.library.opcheck(torch.ops.addnorm.add_norm_.default, inplace)


# What AOTAutograd makes of the triton ops, seen without a GPU: fake CUDA tensors (FakeTensorMode needs no device),
# traced by aot_function in a subprocess (this process built the kernels for the interpreter, whose kernels cannot
# be traced). The graphs must hold the kernels as triton_kernel_wrapper_functional nodes, no opaque addnorm op.
_TRACE_SCRIPT = r"""
import contextlib, json, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from functorch.compile import aot_function, make_boxed_func
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from addnorm.ops.triton import compiled, launch as T, plan as P  # noqa: F401 - registers the ops
P.persistent_programs = lambda device, per_sm: per_sm * 132  # no device properties to read on fake tensors
T._device_guard = lambda device: contextlib.nullcontext()
graphs = []

def keep(gm, inputs):
    graphs.append([(str(n.target), n.kwargs.get("kernel_idx")) for n in gm.graph.nodes if n.op == "call_function"])
    return make_boxed_func(gm)

def fwd(x, r, w):
    return torch.ops.addnorm.triton_add_norm_fwd(x, r, w, None, 1e-5, True, 0.1, torch.bfloat16, False, True)[:2]

def inplace(x, r, w):
    torch.ops.addnorm.triton_add_norm_(x, r, w, None, 1e-5, True, False, False)
    return x, r

def bwd(dout, h, w, rstd, seed):
    return torch.ops.addnorm.triton_add_norm_bwd(dout, None, h, w, rstd.new_empty(0), rstd, seed, True, 0.1, False,
                                                 torch.bfloat16, torch.bfloat16, None)

with FakeTensorMode():
    x, r = (torch.empty(8, 16384, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.empty(16384, device="cuda", dtype=torch.bfloat16)
    rstd, seed = torch.empty(8, device="cuda"), torch.empty((), device="cuda", dtype=torch.int64)
    for fn, args in ((fwd, (x, r, w)), (bwd, (x, r, w, rstd, seed)), (inplace, (x, r, w))):
        try:
            aot_function(fn, fw_compiler=keep)(*args)
        except RuntimeError:  # running the graph on fake CUDA tensors without CUDA: only the trace matters
            pass
names = {i: kernel_side_table.get_kernel(i).fn.__name__ for i in range(len(kernel_side_table.id_to_kernel))}
print(json.dumps([[(t, names.get(k)) for t, k in g] for g in graphs]))
"""


# The autograd of the triton op as AOTAutograd traces it: the joint forward + backward graph of a loss through
# addnorm::triton_add_norm_fwd (CPU tensors, kernels not interpreted: tracing needs no GPU; running the graph would,
# so only the trace is kept, by the partition function).
_JOINT_SCRIPT = r"""
import json, torch
from functorch.compile import aot_function, make_boxed_func, default_partition
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from addnorm.ops.triton import compiled  # noqa: F401 - registers the ops
joint = []

def record(joint_module, joint_inputs, **kw):
    nodes = [n for n in joint_module.graph.nodes if n.op == "call_function"]
    joint.extend((str(n.target), n.kwargs.get("kernel_idx")) for n in nodes)
    return default_partition(joint_module, joint_inputs, **kw)

def loss(x, r, w):
    out, res = torch.ops.addnorm.triton_add_norm_fwd(x, r, w, None, 1e-5, True, 0.1, torch.float32, False, True)[:2]
    return out.sum() + res.square().sum()

# CUDA tensors where a GPU is present (the traced graph then runs for real; CPU tensors there make the launch fail
# with a ValueError), else CPU tensors: the trace is recorded before the launch fails for want of a driver
dev = "cuda" if torch.cuda.is_available() else "cpu"
x, r = (torch.randn(8, 256, device=dev, requires_grad=True) for _ in range(2))
w = torch.randn(256, device=dev)
boxed = lambda g, _: make_boxed_func(g)  # noqa: E731
try:
    aot_function(loss, fw_compiler=boxed, bw_compiler=boxed, partition_fn=record)(x, r, w.requires_grad_())
except RuntimeError:  # no GPU driver to launch on: only the trace matters
    if dev == "cuda":
        raise
names = {i: kernel_side_table.get_kernel(i).fn.__name__ for i in range(len(kernel_side_table.id_to_kernel))}
print(json.dumps([(t, names.get(k)) for t, k in joint]))
"""


def _run_uninterpreted(script, tmp_path):
    """The script's last line of output, parsed: run without TRITON_INTERPRET (this process interprets)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(T.__file__).resolve().parents[3]), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_triton_op_autograd_traces_to_both_kernels(tmp_path):
    joint = _run_uninterpreted(_JOINT_SCRIPT, tmp_path)
    kernels = [k for t, k in joint if "triton_kernel_wrapper_functional" in t]
    assert kernels == ["fwd_rows_kernel", "bwd_rows_kernel", "bwd_fixup_kernel"], joint
    assert ["aten.randint.low"] == [t for t, _ in joint if "randint" in t]  # drawn once; the backward reuses it
    assert not any("addnorm" in t for t, _ in joint), joint


def test_triton_ops_decompose_into_their_kernels(tmp_path):
    fwd, bwd, inplace = _run_uninterpreted(_TRACE_SCRIPT, tmp_path)
    kernels = lambda g: [k for t, k in g if "triton_kernel_wrapper_functional" in t]  # noqa: E731
    assert kernels(fwd) == ["fwd_rows_kernel"], fwd
    assert ["aten.randint.low"] == [t for t, _ in fwd if "randint" in t]  # the dropout seed, drawn in the graph
    # bf16 RMSNorm at N = 16384: the one-pass backward (Tuning.max_bwd_block_n_rms_16bit)
    assert kernels(bwd) == ["bwd_rows_kernel", "bwd_fixup_kernel"], bwd  # the backward's guard after it
    assert kernels(inplace) == ["fwd_rows_kernel"], inplace  # the in-place serving op
    assert not any("addnorm" in t for t, _ in fwd + bwd + inplace), (fwd, bwd, inplace)
