"""Old and new addnorm in ONE process, timed in alternation (A B A B ...): the cpu kernels (forward_into, backward)
and the torch backend's public calls, best of each side over the rounds. On a shared machine this resolves far
smaller differences than two processes run one after the other.

The old tree is imported as ``addnorm_old``: a copy of its ``addnorm`` package with the imports renamed, e.g.

    mkdir -p /tmp/old && git -C <old checkout> archive HEAD src/addnorm | tar -x -C /tmp/old
    mv /tmp/old/src/addnorm /tmp/old/addnorm_old
    grep -rl addnorm /tmp/old/addnorm_old --include=*.py | xargs sed -i -E 's/\\baddnorm\\./addnorm_old./g'
    PYTHONPATH=src python benchmarks/compare_inprocess.py --old /tmp/old
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _best(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _pair(make, rounds: int, reps: int) -> tuple[float, float]:
    old, new = [], []
    for _ in range(rounds):
        old.append(_best(make("old"), reps))
        new.append(_best(make("new"), reps))
    return min(old), min(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="directory holding the renamed package addnorm_old/")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    sys.path.insert(0, args.old)
    from addnorm_old.ops import add_norm as old_api
    from addnorm_old.ops.cpu import launch as old_cpu

    from addnorm.ops import add_norm as new_api
    from addnorm.ops.cpu import launch as new_cpu

    cpu = {"old": old_cpu, "new": new_cpu}
    api = {"old": old_api, "new": new_api}
    print(f"load average before: {os.getloadavg()[0]:.1f}\n")
    print("| dtype | norm | M x N | what | old best ms | new best ms | new / old |")
    print("|---|---|---|---|---:|---:|---:|")
    for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for norm in ("rms", "layer"):
            for m, n in ((1, 4096), (8, 4096), (4096, 4096)):
                rms = norm == "rms"
                g = torch.Generator().manual_seed(0)
                x, r = torch.randn(m, n, generator=g).to(dt), torch.randn(m, n, generator=g).to(dt)
                w = torch.randn(n, generator=g).to(dt)
                b = None if rms else torch.randn(n, generator=g).to(dt)
                out, res = torch.empty_like(x), torch.empty_like(x)
                mean, rstd = (None if rms else torch.empty(m)), torch.empty(m)
                dout = torch.randn(m, n, generator=g).to(dt)
                leaves = [t.clone().requires_grad_() for t in (x, r, w)] + ([] if rms else [b.clone().requires_grad_()])
                reps = 200 if m < 100 else 5

                def fwd(side):
                    kw = dict(eps=1e-5, is_rms=rms, dropout_p=0.0, seed=None, zero_centered_weight=False)
                    return lambda: cpu[side].forward_into(out, res, mean, rstd, x, r, w, b, **kw)

                def bwd(side):
                    kw = dict(is_rms=rms, dropout_p=0.0, seed=None, zero_centered_weight=False, x_dtype=dt)
                    bd = None if rms else dt
                    return lambda: cpu[side].backward(
                        dout, None, res, w, mean, rstd, residual_dtype=None, bias_dtype=bd, **kw
                    )

                def torch_fwd(side):
                    def run():
                        with torch.no_grad():
                            if rms:
                                api[side].add_rms_norm(x, r, w, backend="torch")
                            else:
                                api[side].add_layer_norm(x, r, w, b, backend="torch")

                    return run

                def torch_fb(side):
                    def run():
                        f = api[side].add_rms_norm if rms else api[side].add_layer_norm
                        o, h = f(*leaves, backend="torch")
                        torch.autograd.grad([o, h], leaves, [dout, dout])

                    return run

                cases = [("cpu kernel fwd", fwd), ("cpu kernel bwd", bwd)]
                if m < 100:  # the torch backend's check is host time: visible at decode sizes only
                    cases += [("torch backend fwd", torch_fwd), ("torch backend fwd+bwd", torch_fb)]
                for what, make in cases:
                    a, bb = _pair(make, args.rounds, reps)
                    print(f"| {dn} | {norm} | {m}x{n} | {what} | {a * 1e3:.4g} | {bb * 1e3:.4g} | {bb / a:.2f} |")
                    sys.stdout.flush()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
