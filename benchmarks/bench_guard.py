"""The torch backend's finite-range guard at decode sizes: the public calls of several addnorm source trees in ONE
process, timed in alternation (A B C A B C ...), best of each side over the rounds. The guard's cost is host time
(reading the row statistics), so it shows at 1 and 8 rows; this resolves differences of a few per cent there on a
shared machine, where two processes run one after the other do not.

The tree on PYTHONPATH is "new"; each ``--tree LABEL=DIR/PKG`` adds a copy of another tree's ``addnorm`` package
renamed PKG (its imports renamed too), e.g. main's sources as ``addnorm_old``:

    mkdir -p /tmp/old && git -C <checkout> archive HEAD src/addnorm | tar -x -C /tmp/old
    mv /tmp/old/src/addnorm /tmp/old/addnorm_old
    grep -rl addnorm /tmp/old/addnorm_old --include=*.py | xargs sed -i -E 's/\\baddnorm\\./addnorm_old./g'
    PYTHONPATH=src python benchmarks/bench_guard.py --tree main=/tmp/old/addnorm_old

Modes: ``infer`` (under no_grad: RMSNorm in one dtype takes the decode shortcut), ``train-fwd`` (leaves that
require grad, the forward only), ``fwd+bwd`` (forward and autograd.grad of both outputs).
"""

from __future__ import annotations

import argparse
import importlib
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


def _call(api, norm, args, mode, dout):
    f = api.add_rms_norm if norm == "rms" else api.add_layer_norm
    if mode == "infer":

        def run():
            with torch.no_grad():
                f(*args, backend="torch")

    elif mode == "train-fwd":

        def run():
            f(*args, backend="torch")

    else:

        def run():
            o, h = f(*args, backend="torch")
            torch.autograd.grad([o, h], args, [dout, dout])

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], help="LABEL=DIR/PKG: a renamed addnorm package to compare")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=300, help="calls per round (best taken)")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--modes", default="infer,train-fwd,fwd+bwd")
    args = p.parse_args(argv)
    apis = {}
    for spec in args.tree:
        label, path = spec.split("=", 1)
        folder, pkg = os.path.split(path.rstrip("/"))
        sys.path.insert(0, folder)
        apis[label] = importlib.import_module(f"{pkg}.ops.add_norm")
    apis["new"] = importlib.import_module("addnorm.ops.add_norm")
    labels = list(apis)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average {os.getloadavg()}\n")
    head = " | ".join(f"{k} us" for k in labels) + " | " + " | ".join(f"new / {k}" for k in labels[:-1])
    print(f"| dtype | norm | M x N | mode | {head} |")
    print("|---" * 4 + "|---:" * (2 * len(labels) - 1) + "|")
    n = args.n
    for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for norm in ("rms", "layer"):
            for m in (int(v) for v in args.rows.split(",")):
                g = torch.Generator().manual_seed(0)
                x, r = torch.randn(m, n, generator=g).to(dt), torch.randn(m, n, generator=g).to(dt)
                w, b = torch.randn(n, generator=g).to(dt), torch.randn(n, generator=g).to(dt)
                dout = torch.randn(m, n, generator=g).to(dt)
                for mode in args.modes.split(","):
                    ts = [x, r, w] + ([] if norm == "rms" else [b])
                    if mode != "infer":
                        ts = [t.clone().requires_grad_() for t in ts]
                    runs = {k: _call(api, norm, ts, mode, dout) for k, api in apis.items()}
                    best = {k: float("inf") for k in labels}
                    for _ in range(args.rounds):
                        for k in labels:
                            best[k] = min(best[k], _best(runs[k], args.reps))
                    cells = " | ".join(f"{best[k] * 1e6:.2f}" for k in labels)
                    ratios = " | ".join(f"{best['new'] / best[k]:.2f}" for k in labels[:-1])
                    print(f"| {dn} | {norm} | {m}x{n} | {mode} | {cells} | {ratios} |")
                    sys.stdout.flush()
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
