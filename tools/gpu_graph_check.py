"""GPU-only checks of the Triton path that the CPU test suite can check only structurally (run by gpu_check.sh):

    python tools/gpu_graph_check.py                 # prints one line per check and a summary; exit 1 if one fails

1. graph capture: a CUDA graph captured around a dropout call draws a fresh mask at every replay (the seed is
   drawn on the GPU and read inside the kernel), and the op's outputs hold no CPU tensor;
2. torch.compile(mode="reduce-overhead") of a function with the dropout op: Inductor's count of CUDA-graph skips
   stays at 0 (a CPU tensor among the op's inputs or outputs would make it skip), and dynamo breaks no graph;
   Inductor sees the kernels: the compiled forward and backward, and the in-place serving op, launch addnorm's
   Triton kernels themselves through the triton ops (addnorm.ops.triton.compiled), no opaque addnorm op call left;
3. device guard: tensors on cuda:1 while cuda:0 is current give the reference backend's result on cuda:1 (skipped
   with one GPU);
4. dresidual is dx's tensor (no dropout, residual_dtype == x's), and the in-place ops equal the out-of-place ones;
5. the composed features (add_norm_multi: x1, rowscale, weight1, returned masks; the flash-attention and Liger
   compat functions) on CUDA tensors through the Triton kernels: the same seed gives bitwise the masks and
   residual_out of the torch backend, and outputs and every gradient agree with it.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_graph_check.py: needs a CUDA GPU (these checks are about CUDA graphs and devices)", file=sys.stderr)
        return 2
    import addnorm
    import addnorm.ops.kernel_ops  # noqa: F401  (registers the addnorm:: custom ops; `import addnorm` is lazy)

    results: list[tuple[str, str, str]] = []

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            verdict, detail = fn()
        except Exception as e:  # a failed check is reported with the others, not a traceback that hides them
            verdict, detail = "FAIL", f"{type(e).__name__}: {e}"
        results.append((name, verdict, f"{detail} ({time.perf_counter() - t0:.1f} s)"))
        print(f"{verdict:5} {name}: {results[-1][2]}", flush=True)

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(64, 1024, device=dev, generator=g, dtype=torch.bfloat16)
    r = torch.randn(64, 1024, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(1024, device=dev, generator=g, dtype=torch.bfloat16)

    def graph_capture():
        out = torch.ops.addnorm.add_norm_fwd(x, r, w, None, 1e-5, True, 0.5, torch.bfloat16, False, True, "triton")
        on_cpu = [i for i, t in enumerate(out) if t.device.type != "cuda"]
        if on_cpu:
            return "FAIL", f"outputs {on_cpu} of addnorm::add_norm_fwd are not on the GPU"
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up on a side stream, as capture requires
            for _ in range(2):
                addnorm.add_rms_norm(x, r, w, dropout_p=0.5, backend="triton")
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, res = addnorm.add_rms_norm(x, r, w, dropout_p=0.5, backend="triton")
        masks = []
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            masks.append((res != r).clone())
        same = [torch.equal(masks[i], masks[i + 1]) for i in range(2)]
        kept = masks[0].float().mean().item()
        if any(same):
            return "FAIL", f"replays reused a mask (equal consecutive masks: {same})"
        return "PASS", f"3 replays, 3 different masks, kept fraction {kept:.3f}"

    def reduce_overhead():
        from torch._dynamo.utils import counters

        counters.clear()

        def f(x, r, w):
            out, res = addnorm.add_rms_norm(x, r, w, dropout_p=0.1, backend="triton")
            return out.float().sum() + res.float().sum()

        torch._dynamo.reset()
        cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
        vals = [cf(x, r, w).item() for _ in range(4)]
        skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
        breaks = sum(counters["graph_break"].values())
        if skips or breaks:
            return "FAIL", f"Inductor skipped CUDA graphs {skips} time(s); dynamo graph breaks: {breaks}"
        if len(set(vals)) == 1:
            return "FAIL", "every call gave the same value: the dropout mask did not change between replays"
        return "PASS", f"no CUDA-graph skip, no graph break; 4 calls, {len(set(vals))} different results"

    def inductor_sees_kernels():
        from torch._dynamo.utils import counters
        from torch._inductor.utils import run_and_get_code

        counters.clear()
        torch._dynamo.reset()
        xl, rl, wl = (t.float().requires_grad_(True) for t in (x, r, w))

        def f(x, r, w):
            out, res = addnorm.add_rms_norm(x, r, w, dropout_p=0.1, backend="triton")
            return out.square().sum() + res.sum()

        cf = torch.compile(f, fullgraph=True)

        def step():
            val = cf(xl, rl, wl)
            val.backward()
            return val

        _, codes = run_and_get_code(step)
        code = "\n".join(codes)
        launched = [k for k in ("fwd_rows_kernel", "bwd_rows_kernel") if k in code]
        opaque = "torch.ops.addnorm" in code

        def serve(x, r, w):  # the in-place serving op, compiled as a decode step would be
            addnorm.add_rms_norm_(x, r, w, 1e-6, backend="triton")
            return x

        xi, ri = x.clone(), r.clone()
        with torch.inference_mode():
            _, codes = run_and_get_code(torch.compile(serve, fullgraph=True), xi, ri, w)
        inplace_code = "\n".join(codes)
        inplace_ok = "fwd_rows_kernel" in inplace_code and "torch.ops.addnorm" not in inplace_code
        exp_out, exp_res = addnorm.add_rms_norm(x, r, w, 1e-6, backend="triton")
        inplace_ok = inplace_ok and torch.equal(xi, exp_out) and torch.equal(ri, exp_res)
        breaks = sum(counters["graph_break"].values())
        ok = len(launched) == 2 and not opaque and not breaks and xl.grad is not None and inplace_ok
        return ("PASS" if ok else "FAIL"), (
            f"kernels in the compiled code: {launched}; opaque addnorm op call: "
            f"{opaque}; in-place op compiled to the kernel and equal to eager: "
            f"{inplace_ok}; graph breaks: {breaks}"
        )

    def device_guard():
        if torch.cuda.device_count() < 2:
            return "SKIP", "one GPU"
        d1 = torch.device("cuda:1")
        x1, r1, w1 = x.to(d1), r.to(d1), w.to(d1)
        torch.cuda.set_device(0)
        out, res = addnorm.add_rms_norm(x1, r1, w1, 1e-6, backend="triton")
        torch.cuda.synchronize(d1)
        ref_out, ref_res = addnorm.add_rms_norm(x1, r1, w1, 1e-6, backend="reference")
        ok = out.device == d1 and torch.equal(res, ref_res) and (out.float() - ref_out.float()).abs().max() < 0.05
        return ("PASS" if ok else "FAIL"), f"cuda:1 tensors with cuda:0 current; matches the reference: {ok}"

    def shared_grad_and_inplace():
        xl = x.float().requires_grad_(True)
        rl = r.float().requires_grad_(True)
        xa, ra = xl * 1, rl * 1
        seen = {}
        xa.register_hook(lambda t: seen.__setitem__("x", t))
        ra.register_hook(lambda t: seen.__setitem__("r", t))
        out, res = addnorm.add_rms_norm(xa, ra, w.float(), 1e-6, backend="triton")
        (out.square().sum() + res.sum()).backward()
        shared = seen["x"].data_ptr() == seen["r"].data_ptr()
        xi, ri = x.clone(), r.clone()
        with torch.inference_mode():
            addnorm.add_rms_norm_(xi, ri, w, 1e-6, backend="triton")
        exp_out, exp_res = addnorm.add_rms_norm(x, r, w, 1e-6, backend="triton")
        inplace = torch.equal(xi, exp_out) and torch.equal(ri, exp_res)
        ok = shared and inplace
        return ("PASS" if ok else "FAIL"), f"dresidual is dx: {shared}; in place == out of place: {inplace}"

    def composed_features():
        from addnorm.compat import flash_attn as fa
        from addnorm.compat import liger
        from addnorm.ops.add_norm_multi import add_norm_multi

        def run(backend):
            torch.manual_seed(3)
            leaves = [t.float().clone().requires_grad_(True) for t in (x, r, x, w, w)]
            xl, rl, x1l, wl, w1l = leaves
            rs = torch.rand(x.shape[0], device=dev) + 0.5
            res = add_norm_multi(
                xl,
                rl,
                wl,
                None,
                1e-5,
                is_rms=True,
                x1=x1l,
                weight1=w1l,
                rowscale=rs,
                dropout_p=0.2,
                return_dropout_mask=True,
                backend=backend,
            )
            (res.out.square().sum() + res.out1.sum() + res.residual_out.sum()).backward()
            return res, [t.grad for t in leaves]

        a, ga = run("triton")
        b, gb = run("torch")
        masks = torch.equal(a.dropout_mask, b.dropout_mask) and torch.equal(a.dropout_mask1, b.dropout_mask1)
        res_equal = torch.equal(a.residual_out, b.residual_out)
        err = max(
            (u - v).abs().max().item() / (v.abs().max().item() + 1e-6)
            for u, v in [(a.out, b.out), (a.out1, b.out1)] + list(zip(ga, gb))
        )
        y = fa.rms_norm_fn(x, w, None, residual=r, prenorm=True, residual_in_fp32=True)
        z = liger.liger_fused_add_rms_norm(x, r, w, 1e-6, in_place=False)
        ok = masks and res_equal and err < 1e-4 and all(t.is_cuda for t in (*y, *z))
        return ("PASS" if ok else "FAIL"), (
            f"masks bitwise equal: {masks}; residual_out bitwise: {res_equal}; "
            f"max relative difference of outputs and gradients {err:.1e}"
        )

    check("graph capture with dropout", graph_capture)
    check("compile reduce-overhead", reduce_overhead)
    check("Inductor sees the Triton kernels", inductor_sees_kernels)
    check("device guard (cuda:1)", device_guard)
    check("shared dresidual, in-place ops", shared_grad_and_inplace)
    check("composed features and compat APIs", composed_features)
    failed = [name for name, verdict, _ in results if verdict == "FAIL"]
    print(
        f"graph checks: {len(results) - len(failed)} of {len(results)} passed or skipped"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
